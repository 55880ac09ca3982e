"""FlashAttention's tiling: attention in blocks, with the online softmax (chapter 11).

minidist's attention (`ScaledDotProductAttention` in minidist/core/fused.py) builds the whole
(B, H, T, T) matrix of scores, its softmax, and keeps the softmax for backward: B H T^2 numbers
per layer, growing with the square of the sequence. FlashAttention (Dao et al. 2022) never
builds it. It walks over blocks of queries and, for each, over blocks of keys, and keeps per
query row only a running maximum m, a running sum l and an unnormalised output acc:

    S = Q_blk K_blk^T / sqrt(D)                       one (block_q x block_k) tile of scores
    m' = max(m, rowmax(S))                            the new running maximum
    P = exp(S - m'),   c = exp(m - m')                this tile's weights; the old ones' correction
    l  <- c l + rowsum(P),    acc <- c acc + P V_blk
    out = acc / l,    lse = m + log l                 once every key block has been seen

Rescaling by c keeps every exponent <= 0 (no overflow) and gives exactly the softmax over all
keys: the online softmax (Milakov and Gimelshein 2018). The largest array is one tile; what it
keeps for backward is `out` and one `lse` per query, B H T (D + 1) numbers instead of the
output and the B H T^2 weights (its backward recomputes each tile's P = exp(S - lse), as ring
attention's does in minidist/parallel/context_parallel.py). Tiles the causal mask hides whole
are skipped.

On a GPU the tiles live in on-chip memory, which is the point: here they are NumPy arrays, so
this shows the arithmetic and the memory, not the speed. Forward only, in one process.
"""
from __future__ import annotations

import math

import numpy as np


def blocked_attention(q, k, v, block_q: int = 16, block_k: int = 16, causal: bool = True) -> dict:
    """softmax(q k^T / sqrt(D) + mask) v over (B, H, T, D) arrays, one tile at a time.

    The causal mask is minidist's: query i sees key j when j <= i + T_k - T_q (queries aligned
    with the last keys). Returns `out`, `lse` (B, H, T_q), and what was computed: `tiles` run,
    `skipped` (hidden whole by the mask), `largest_tile` (elements of the biggest score array)."""
    q, k, v = (np.asarray(a) for a in (q, k, v))
    t_q, t_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if causal and t_q > t_k:
        raise ValueError(f"causal attention with {t_q} queries but only {t_k} keys "
                         "(the first queries would see no key)")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    shift = t_k - t_q  # query i sees keys j <= i + shift
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    lse = np.empty(q.shape[:-1], dtype=q.dtype)
    tiles = skipped = largest = 0
    for q0 in range(0, t_q, block_q):
        q1 = min(q0 + block_q, t_q)
        q_blk = q[..., q0:q1, :] / math.sqrt(d)
        m = np.full(q_blk.shape[:-1], -np.inf, dtype=q.dtype)
        l = np.zeros(q_blk.shape[:-1], dtype=q.dtype)
        acc = np.zeros(q_blk.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
        for k0 in range(0, t_k, block_k):
            k1 = min(k0 + block_k, t_k)
            if causal and k0 > q1 - 1 + shift:  # no query of this block sees any of these keys
                skipped += 1
                continue
            s = q_blk @ np.swapaxes(k[..., k0:k1, :], -1, -2)
            if causal and k1 - 1 > q0 + shift:  # the tile crosses the diagonal: mask inside it
                rows, cols = np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :]
                s = np.where(cols <= rows + shift, s, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1))  # finite: a query sees key 0 in the first tile
            p = np.exp(s - m_new[..., None])
            correction = np.exp(m - m_new)
            l = correction * l + p.sum(axis=-1)
            acc = correction[..., None] * acc + p @ v[..., k0:k1, :]
            m = m_new
            tiles += 1
            largest = max(largest, s.size)
        out[..., q0:q1, :] = acc / l[..., None]
        lse[..., q0:q1] = m + np.log(l)
    return {"out": out, "lse": lse, "tiles": tiles, "skipped": skipped, "largest_tile": largest}


def kept_for_backward(batch: int, heads: int, seq: int, head_dim: int, itemsize: int, blocked: bool) -> int:
    """Bytes one attention keeps for its backward beyond its inputs q, k, v: its output and the
    softmax, B H T (D + T) (minidist's kernel without dropout, what `graph_bytes` measures), or its
    output and one lse per query, B H T (D + 1) (the blocked one)."""
    per_row = head_dim + (1 if blocked else seq)
    return batch * heads * seq * per_row * itemsize
