"""DeepSpeed-Ulysses: context parallelism by two all-to-alls around ordinary attention.

Chapter 11, part 2 (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models"). The ring of `context_parallel.py` keeps
the heads together and passes the keys round; Ulysses swaps what is split instead. Each of N
ranks holds T/N tokens of every sequence with all H heads. Attention needs all tokens but each
head is independent of the others, so:

    (B, H, T/N, D) on every rank      q, k, v: my tokens, all heads
        all-to-all                    rank j gets heads j·H/N ... of my tokens, I get mine of theirs
    (B, H/N, T, D)                    all tokens, my H/N heads
        ordinary causal attention     (F.scaled_dot_product_attention: the serial kernel)
        all-to-all back               (B, H, T/N, D): my tokens again, every head

Forward: one all-to-all of q, k and v together, one of the output; backward the same two,
reversed (the transpose of an all-to-all is the all-to-all the other way). Each all-to-all of S
elements per rank sends (N-1)/N · S, so a rank sends 8 (N-1)/N · B·H·(T/N)·D elements per
attention, forward and backward: less as N grows, where the ring's stays 6 (N-1)·B·H·(T/N)·D.
The constraint: N must divide the number of heads (`check_ulysses`), so N ≤ H.

Memory: each rank runs the serial kernel on H/N heads of length T, so its attention keeps
B·(H/N)·T² weights for backward: 1/N of the serial T² — but still quadratic in T, where the
ring keeps none.

The tokens a rank holds need not be contiguous (the zigzag split of `context_parallel.py`):
`order` lists every rank's token positions, rank after rank, and the all-to-all puts each token
back at its place in the sequence before attention, and takes it from there afterwards.
"""
from __future__ import annotations

import numpy as np

from minidist.core import functional as F
from minidist.comm import all_to_all
from minidist.core.tensor import Function


def check_ulysses(n_head: int, cp: int) -> None:
    """Raise ValueError if n_head heads cannot be dealt out evenly to cp ranks."""
    if n_head % cp:
        raise ValueError(f"Ulysses: n_head={n_head} is not divisible by cp={cp} "
                         "(after the all-to-all each rank computes attention for n_head/cp whole heads)")


def sequence_to_heads(x: np.ndarray, group, order: np.ndarray) -> np.ndarray:
    """(..., H, T/N, D) my tokens, every head -> (..., H/N, T, D) every token, my heads.
    `order[i]` is the position in the sequence of the i-th token received (rank after rank)."""
    n, lead = group.size, x.shape[:-3]
    h, t, d = x.shape[-3:]
    # chunk j of the message (heads j·H/N ...) goes to rank j: heads to the front
    send = np.ascontiguousarray(np.moveaxis(x.reshape(*lead, n, h // n, t, d), -4, 0))
    received = all_to_all(send, group=group).reshape(n, *lead, h // n, t, d)  # by source rank
    tokens = np.moveaxis(received, 0, -3).reshape(*lead, h // n, n * t, d)  # rank after rank
    out = np.empty_like(tokens)
    out[..., order, :] = tokens  # each token at its place in the sequence
    return out


def heads_to_sequence(y: np.ndarray, group, order: np.ndarray) -> np.ndarray:
    """`sequence_to_heads` backwards: (..., H/N, T, D) -> (..., H, T/N, D)."""
    n, lead = group.size, y.shape[:-3]
    h, t, d = y.shape[-3:]
    tokens = y[..., order, :].reshape(*lead, h, n, t // n, d)  # rank j's tokens are chunk j
    send = np.ascontiguousarray(np.moveaxis(tokens, -3, 0))
    received = all_to_all(send, group=group).reshape(n, *lead, h, t // n, d)  # rank j sent heads j
    return np.moveaxis(received, 0, -4).reshape(*lead, n * h, t // n, d)


class SequenceToHeads(Function):
    """q, k, v -> one array (3, B, H/N, T, D): one all-to-all for the three. Backward: the
    all-to-all back, of the three gradients together."""

    @staticmethod
    def forward(ctx, q, k, v, group, order):
        ctx.group, ctx.order = group, order
        return sequence_to_heads(np.stack([q, k, v]), group, order)

    @staticmethod
    def backward(ctx, g):
        dq, dk, dv = heads_to_sequence(g, ctx.group, ctx.order)
        return dq, dk, dv, None, None


class HeadsToSequence(Function):
    """The attention output back to my tokens, every head. Backward: to every token, my heads."""

    @staticmethod
    def forward(ctx, y, group, order):
        ctx.group, ctx.order = group, order
        return heads_to_sequence(y, group, order)

    @staticmethod
    def backward(ctx, g):
        return sequence_to_heads(g, ctx.group, ctx.order), None, None


def ulysses_attention(q, k, v, group, order=None, causal: bool = True, stats=None):
    """Attention over the whole sequence of (B, H, T/N, D) local q, k, v: all-to-all to heads,
    the serial kernel, all-to-all back. `order`: every rank's token positions, rank after rank
    (default: contiguous). `stats` (optional) counts the score entries this rank computes."""
    n = group.size
    check_ulysses(q.shape[1], n)
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"Ulysses: q {q.shape}, k {k.shape} and v {v.shape} must have one shape (B, H, T/N, D)")
    length = q.shape[2] * n
    order = np.arange(length) if order is None else np.asarray(order)
    if sorted(order.tolist()) != list(range(length)):
        raise ValueError(f"Ulysses: order must list each of the {length} positions once, got {order.tolist()}")
    qkv = SequenceToHeads.apply(q, k, v, group, order)
    y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], causal=causal)
    if stats is not None:  # (B, H/N, T, T) weights, kept for backward by the serial kernel
        b, h = q.shape[0], q.shape[1] // n
        stats.add(b * h * length * length, b * h * (length * (length + 1) // 2 if causal else length * length),
                  b * h * length * length * q.dtype.itemsize)
    return HeadsToSequence.apply(y, group, order)


def ulysses_traffic(batch: int, n_head: int, length: int, head_dim: int, cp: int, itemsize: int = 8) -> dict:
    """Bytes and messages one rank sends for one Ulysses attention (forward and backward).

    Each all-to-all of S elements per rank sends (N-1)/N · S in N-1 messages. Forward: q, k, v
    (3S) and the output (S), S = B·H·(T/N)·D; backward: the same sizes back."""
    s = batch * n_head * (length // cp) * head_dim
    per_direction = 4 * (cp - 1) * (s // cp) * itemsize  # H divisible by N: S/N is whole
    return {"forward": per_direction, "backward": per_direction, "bytes": 2 * per_direction,
            "messages": 4 * (cp - 1)}
