"""Sequence parallelism (序列并行): the parts tensor parallelism left whole, split along the sequence.

Chapter 6, part 3 (Megatron-LM, Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models"). Tensor parallelism (`tensor_layers.py`, `tensor_parallel.py`)
splits the matrices, but between them the LayerNorms, the residual adds and the dropouts still
work on the whole (B, T, C) activation, identically on every rank: t copies of the same numbers.
Those operations are independent per token, so each rank can do them for T/t of the tokens
instead.

The one idea: an all-reduce *is* a reduce-scatter followed by an all-gather (that is how the
ring does it). Megatron's g (all-reduce after a row-parallel layer) is cut in two: the
reduce-scatter leaves each rank the *sum* for its T/t tokens — exactly what its LayerNorm,
dropout and residual add need — and the all-gather is postponed to where the next
column-parallel layer needs every token. Same bytes on the wire; the activations between the
two halves are 1/t the size.

    tensor parallel:     ... row -> g (all-reduce) -> dropout, +, LayerNorm -> f -> column ...
    sequence parallel:   ... row -> reduce-scatter -> dropout, +, LayerNorm (T/t tokens)
                                 -> all-gather (Megatron's g-bar) -> column ...

The three conjugate functions (Megatron-LM's names), with the sequence as axis 1 of (B, T, ...):

    scatter_to_sequence_parallel_region          forward: keep my T/t    backward: all-gather
    gather_from_sequence_parallel_region         forward: all-gather     backward: reduce-scatter
    reduce_scatter_to_sequence_parallel_region   forward: reduce-scatter backward: all-gather

Our collectives work on flat arrays and give rank r the r-th contiguous chunk. Megatron keeps
its activations as (T, B, C) so that a slice of the sequence is contiguous; we keep the book's
(B, T, C) and move the sequence axis to the front just for the message (one copy each way).

Replicated parameters used inside the sequence-parallel region (LayerNorm gains and biases,
the row-parallel biases, the position embedding) now see only T/t tokens on each rank: each rank
holds a *partial* gradient, and the true one is their sum. `allreduce_sequence_parallel_grads`
adds them up in one all-reduce after backward (Megatron marks them `p.sequence_parallel = True`
and all-reduces them in `finalize_model_grads`). Without it the replicas would drift apart.

The layers extend tensor parallelism's, changing only their communication (Megatron-LM's
`sequence_parallel=True`): `SequenceParallelColumnLinear` all-gathers its input's tokens where
`ColumnParallelLinear` applies f, `SequenceParallelRowLinear` and `SequenceParallelEmbedding`
reduce-scatter where theirs apply g. `SequenceParallelLayers` lists them, with the dropout, for
`SequenceParallelGPT` (`tensor_parallel.py`). The memory formula is
`memory.sequence_parallel_activation_bytes`.
"""
from __future__ import annotations

import numpy as np

from minidist.comm import all_gather, all_reduce, reduce_scatter
from minidist.comm.world import World
from minidist.core.nn import Module
from minidist.parallel.tensor_layers import (ColumnParallelLinear, RowParallelLinear, TensorParallelLayers,
                                             VocabParallelEmbedding)
from minidist.core.tensor import Function


def check_sequence_length(length: int, tp: int) -> None:
    """Raise ValueError if a sequence of `length` tokens cannot be cut into tp equal chunks.
    Arithmetic only: every rank raises it before any message is sent."""
    if length % tp:
        raise ValueError(f"sequence parallel: sequence length T={length} is not divisible by tp={tp} "
                         "(each rank keeps an equal share of the tokens)")


def _sequence_first(x: np.ndarray) -> np.ndarray:
    """(B, T, ...) -> contiguous (T, B, ...): a chunk of the sequence is a contiguous chunk."""
    return np.ascontiguousarray(np.moveaxis(x, 1, 0))


def _split_along_sequence(x: np.ndarray, group: World) -> np.ndarray:
    check_sequence_length(x.shape[1], group.size)
    n = x.shape[1] // group.size
    return np.ascontiguousarray(x[:, group.rank * n:(group.rank + 1) * n])


def _gather_along_sequence(x: np.ndarray, group: World) -> np.ndarray:
    """Every rank's (B, T/t, ...) -> the whole (B, T, ...), rank r's tokens at r·T/t."""
    t = group.size
    if t == 1:
        return x
    flat = np.empty(x.size * t, dtype=x.dtype)
    all_gather(_sequence_first(x), group=group, out=flat)
    full = flat.reshape(x.shape[1] * t, x.shape[0], *x.shape[2:])
    return np.moveaxis(full, 0, 1)


def _reduce_scatter_along_sequence(x: np.ndarray, group: World) -> np.ndarray:
    """(B, T, ...) partial sums on every rank -> the sum, for this rank's T/t tokens."""
    check_sequence_length(x.shape[1], group.size)
    if group.size == 1:
        return x
    mine = reduce_scatter(_sequence_first(x), group=group)
    local = mine.reshape(x.shape[1] // group.size, x.shape[0], *x.shape[2:])
    return np.moveaxis(local, 0, 1)


class ScatterToSequenceParallelRegion(Function):
    """Forward: keep this rank's T/t tokens of a replicated X. Backward: all-gather.

    x_r = X[:, chunk r] is a selection, so dL/dX is the gradients of the chunks put side by side:
    dL/dX[:, chunk r] = dL/dx_r, which lives on rank r. X was replicated (everything before it
    runs the same on every rank), so every rank needs all of dL/dX: an all-gather."""

    autocast = "pass"  # chapter 10 (messages carry the tensor's own format)

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_sequence(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_along_sequence(g, ctx.group), None


class GatherFromSequenceParallelRegion(Function):
    """Forward: all-gather the tokens (Megatron's g-bar, before a column-parallel layer).
    Backward: reduce-scatter.

    Every rank r uses the gathered X in its own column-parallel slice and so computes only its
    share dL_r/dX of the gradient (as for f, the total is the sum over ranks). Rank q's chunk
    x_q appears in every rank's copy of X, so dL/dx_q = Σ_r dL_r/dX[:, chunk q]: the sum over
    ranks, of chunk q only, delivered to rank q — a reduce-scatter."""

    autocast = "pass"  # chapter 10 (messages carry the tensor's own format)

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_along_sequence(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_along_sequence(g, ctx.group), None


class ReduceScatterToSequenceParallelRegion(Function):
    """Forward: reduce-scatter the partial sums of a row-parallel layer (half of g).
    Backward: all-gather.

    y_q = (Σ_r Y_r)[:, chunk q], so dL/dY_r[:, chunk q] = dL/dy_q for every r: each rank's
    partial sum needs the gradient of *every* chunk, and chunk q's gradient lives on rank q — an
    all-gather. (The transpose of "sum, then keep chunk q" is "take every chunk, copy to all".)"""

    autocast = "pass"  # chapter 10 (messages carry the tensor's own format)

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along_sequence(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_along_sequence(g, ctx.group), None


def scatter_to_sequence_parallel_region(x, group):
    return ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group):
    return GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return ReduceScatterToSequenceParallelRegion.apply(x, group)


# ----------------------------------------------------------------------------- the layers


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """A column-parallel layer whose input is this rank's T/t tokens: they are all-gathered
    (Megatron's g-bar; backward reduce-scatter) where the tensor-parallel layer applies f."""

    @staticmethod
    def enter(x, group):
        return gather_from_sequence_parallel_region(x, group)


class SequenceParallelRowLinear(RowParallelLinear):
    """A row-parallel layer whose partial sums are reduce-scattered along the sequence where the
    tensor-parallel layer all-reduces them (g): the output, and the bias added after, are this
    rank's T/t tokens. The bias, replicated, now gets a partial gradient: tagged for the sum."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            self.bias.sequence_parallel = True

    @staticmethod
    def reduce(partial, group):
        return reduce_scatter_to_sequence_parallel_region(partial, group)


class SequenceParallelEmbedding(VocabParallelEmbedding):
    """The vocabulary-parallel embedding whose rows are reduce-scattered along the sequence:
    this rank gets the embeddings of its T/t tokens."""

    @staticmethod
    def reduce(rows, group):
        return reduce_scatter_to_sequence_parallel_region(rows, group)


# ----------------------------------------------------------------------------- dropout, gradients


class _ApplyMask(Function):
    """x * mask, with the mask saved for backward (so graph_bytes counts it, as for Dropout)."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved[0], None


class SequenceParallelDropout(Module):
    """Dropout on this rank's T/t tokens with the serial model's mask.

    Each rank draws the mask for the whole (B, T, C), from the same seeded generator as the
    serial Dropout, and keeps its chunk: parallel equals serial, at the price of drawing t times
    the random numbers it uses. (Megatron instead gives every rank its own generator here —
    different tokens need different masks — which is cheaper but not reproducible across t.)"""

    def __init__(self, p: float, group: World, seed: int = 0):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.group = p, group
        self.rng = np.random.default_rng(seed)

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        full = (x.shape[0], x.shape[1] * self.group.size, *x.shape[2:])
        keep = _split_along_sequence(self.rng.random(full) >= self.p, self.group)
        return _ApplyMask.apply(x, keep.astype(x.dtype) / (1.0 - self.p))


def mark_sequence_parallel(*modules: Module) -> None:
    """Tag the parameters of `modules` (replicated ones used on T/t tokens) for the all-reduce."""
    for module in modules:
        for p in module.parameters():
            p.sequence_parallel = True


def allreduce_sequence_parallel_grads(model: Module, group: World) -> int:
    """Sum the partial gradients of the parameters tagged `sequence_parallel` over the TP group,
    in one message (they are small: LayerNorms, biases, wpe). Returns the elements reduced.

    Why a sum: the loss is a sum over tokens, and a replicated parameter's gradient is the sum of
    its per-token contributions. Rank r computed the contributions of its T/t tokens; adding the
    t partial gradients gives every rank the serial gradient, identical on all ranks again."""
    return allreduce_partial_grads(model.parameters(), group)


def allreduce_partial_grads(params, group: World) -> int:
    """`allreduce_sequence_parallel_grads` for a list of parameters (those not tagged are left
    alone): ZeRO reduces its units one at a time and completes each unit's first."""
    params = [p for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if group.size == 1 or not params:
        return 0
    flat = np.concatenate([p.grad.ravel() for p in params])
    all_reduce(flat, group=group)
    offset = 0
    for p in params:
        p.grad[...] = flat[offset:offset + p.grad.size].reshape(p.grad.shape)
        offset += p.grad.size
    return flat.size


# ----------------------------------------------------------------------------- what the model is built from


class SequenceParallelLayers(TensorParallelLayers):
    """The layers `SequenceParallelGPT` is built from: tensor parallelism's list, every entry
    replaced by its sequence-parallel extension."""

    column = SequenceParallelColumnLinear
    row = SequenceParallelRowLinear
    embedding = SequenceParallelEmbedding
    dropout = SequenceParallelDropout
