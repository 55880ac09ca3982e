"""Hiding communication behind computation: how much of each message stays exposed (chapter 11).

A GPU computes on one stream and communicates on another, so a message that does not depend on
the running computation can travel while it runs. Two uses:

- **Prefetch** (FSDP / ZeRO-3, chapter 8): layer i + 1's weights are all-gathered while layer i
  computes. Layer i + 1 starts when both are done, so per layer only
  max(0, comm(i + 1) - compute(i)) of the message is exposed.
- **Async tensor parallelism**: a sequence-parallel all-gather before a column-parallel matrix
  product (chapter 6) is cut into its N pieces; the rank multiplies the piece it holds while the
  next arrives. The same two streams, with N chunks of compute and N - 1 messages.

`two_streams` replays the two streams with given times (an ideal timing model, one process):
message i may start once message i - 1 is done and, with prefetch depth d, once layer i - d has
started (only d layers' gathered weights may be held ahead); layer i starts once layer i - 1 is
done and message i has arrived. With equal layers (c, m) and d = 1 that gives

    total = m + (L - 1) max(c, m) + c,        exposed = total - L c = m + (L - 1) max(0, m - c).
"""
from __future__ import annotations


def two_streams(compute, comm, prefetch: int = 1) -> dict:
    """Replay a compute stream and a communication stream; layer i needs message i first.

    `compute[i]`, `comm[i]`: seconds of layer i and of its message (0: nothing to wait for).
    `prefetch`: how many layers ahead a message may start; 0 runs each message only after the
    previous layer (no overlap). Returns the timeline and `total`, `exposed` (total minus the
    compute: the communication nobody hid)."""
    if len(compute) != len(comm) or prefetch < 0:
        raise ValueError(f"two_streams needs as many messages as layers and prefetch >= 0; got "
                         f"{len(compute)} layers, {len(comm)} messages, prefetch={prefetch}")
    layers, messages = [], []
    comm_free = 0.0  # when the communication stream is free
    for i, (c, m) in enumerate(zip(compute, comm)):
        previous_end = layers[-1][1] if layers else 0.0
        if prefetch == 0:
            allowed = previous_end
        else:  # once layer i - prefetch has started (the first `prefetch` messages go at once)
            allowed = layers[i - prefetch][0] if i >= prefetch else 0.0
        start_m = max(comm_free, allowed)
        messages.append((start_m, start_m + m))
        comm_free = start_m + m
        start_c = max(previous_end, comm_free if m else 0.0)
        layers.append((start_c, start_c + c))
    total = layers[-1][1] if layers else 0.0
    return {"layers": layers, "messages": messages, "total": total, "exposed": total - sum(compute)}


def hiding_tokens(flops: float, bandwidth: float, itemsize: int = 2, ranks: int | None = None) -> float:
    """Tokens per rank from which a layer's weight all-gather hides behind its forward (prefetch).

    A layer of P weights all-gathers (N - 1)/N of P e bytes while computing 2 P FLOPs per token
    of its b s tokens: hidden when 2 P b s / F >= (N - 1)/N P e / beta, that is
    b s >= F e (N - 1) / (2 N beta) — the layer's size, and so the width, cancels. `ranks=None`: N large."""
    share = 1.0 if ranks is None else (ranks - 1) / ranks
    return flops * itemsize * share / (2.0 * bandwidth)
