"""Tensor parallelism (张量并行), the layers: one matrix multiply split across t ranks.

Chapter 6, part 1 (the model and the trainer are in `tensor_parallel.py`). The one idea: a
linear layer Y = X W^T can be cut along either side of W, and the two cuts fit together so that
a whole MLP (or attention) needs one all-reduce forward and one backward.

    ColumnParallelLinear   W cut by output features (rows of our (out, in) weight):
                           rank r computes Y_r = X W_r^T, a slice of Y's columns. Needs the
                           whole X; leaves Y split (or gathers it: gather_output=True).
    RowParallelLinear      W cut by input features (columns of our weight): rank r computes
                           the partial sum X_r W_r^T from its slice X_r of the input; the full
                           Y is the sum over ranks -> one all-reduce.

Column then row (the Megatron MLP): X -> [column: X A_r] -> GELU (elementwise, so it works on
the slice) -> [row: GELU(X A_r) B_r] -> sum over ranks. No communication between the two.

The communication lives in two conjugate autograd functions (Megatron-LM's f and g):

    f = copy_to_tensor_parallel_region:      forward identity,    backward all-reduce
    g = reduce_from_tensor_parallel_region:  forward all-reduce,  backward identity

Why conjugate: the backward of an operation is its transpose (adjoint). "Copy x to t ranks"
is the linear map x -> (x, x, ..., x); its transpose maps (g_1, ..., g_t) -> g_1 + ... + g_t,
a sum: an all-reduce. "Sum the t partial results" is the map (y_1, ..., y_t) -> y_1+...+y_t
delivered to everyone; its transpose hands the same gradient to every y_r: the identity on
each rank. So each of f and g is the other's backward. (tests/test_parallel_tensor.py checks
both against the serial layers' gradients.)

The vocabulary, too, is split across ranks: `VocabParallelEmbedding` (each rank holds V/t rows
of the table; ids outside its range give zero rows, then g sums) and
`vocab_parallel_cross_entropy`, which computes the exact loss over all V logits without ever
gathering them on one rank: an all-reduce of the row maxima, then one of the sums of exp and
of the target's logit.

Each layer names its communication in one small method — `enter` (f) on the column-parallel
layer, `reduce` (g) on the row-parallel layer and the embedding — and nothing else: sequence
parallelism (`sequence.py`) extends these classes by overriding just those methods, and
`TensorParallelLayers` lists the classes a tensor-parallel GPT is built from.

Parameters cut across ranks carry `p.tensor_model_parallel = True` and `p.partition_dim`
(Megatron-LM's attribute names); the others are replicated, identical on every rank.
"""
from __future__ import annotations

import numpy as np

from minidist.core import functional as F
from minidist.comm import all_gather, all_reduce, get_world
from minidist.comm.world import World
from minidist.core.nn import Dropout, Module, Parameter
from minidist.core.tensor import Function, Tensor

# ----------------------------------------------------------------------------- communication


def _gather_last_dim(x: np.ndarray, group: World) -> np.ndarray:
    """Concatenate every rank's x along the last axis (all_gather concatenates flat arrays)."""
    t = group.size
    flat = np.empty(x.size * t, dtype=x.dtype)
    all_gather(np.ascontiguousarray(x), group=group, out=flat)
    return np.concatenate(np.split(flat.reshape(t, *x.shape), t, axis=0), axis=-1)[0]


def _my_slice(x: np.ndarray, group: World) -> np.ndarray:
    return np.ascontiguousarray(np.split(x, group.size, axis=-1)[group.rank])


class CopyToTensorParallelRegion(Function):
    """f: identity forward, all-reduce (sum) of the gradient backward.

    Placed where a replicated activation enters a column-parallel layer: each rank's layer
    contributes only its share of dL/dx (through its slice of the weight); the sum is the
    whole gradient, which every rank needs to continue backward through replicated layers."""

    autocast = "pass"  # chapter 10 (messages carry the tensor's own format)

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        """f's backward: the sum over the tensor-parallel group (`ctx.group`) of each rank's
        gradient `g`, returned as (gradient of x, None for the group). `g` may be an array other
        operations still read: reduce a copy, never `g` in place."""
        ### BEGIN SOLUTION assignment=tensor_parallel_f_g
        g = np.array(g, copy=True)  # the incoming gradient may be shared: never reduce in place
        return all_reduce(g, group=ctx.group), None
        ### END SOLUTION


class ReduceFromTensorParallelRegion(Function):
    """g: all-reduce (sum) forward, identity backward.

    Placed after a row-parallel layer: the partial sums of the ranks add up to the output.
    The output feeds replicated layers on every rank, so its gradient is already the same on
    every rank and is exactly the gradient of each partial sum (d(y_1+...+y_t)/dy_r = 1)."""

    autocast = "pass"  # chapter 10 (messages carry the tensor's own format)

    @staticmethod
    def forward(ctx, x, group):
        """g's forward: the sum of every rank's partial output `x` over `group`, a new array
        (`x` stays as it was)."""
        ### BEGIN SOLUTION assignment=tensor_parallel_f_g
        return all_reduce(np.array(x, copy=True), group=group)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, g):
        return g, None


class GatherFromTensorParallelRegion(Function):
    """All-gather along the last axis forward; backward keeps this rank's slice of the gradient."""

    autocast = "pass"  # chapter 10 (messages carry the tensor's own format)

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, g):
        return _my_slice(g, ctx.group), None


class ScatterToTensorParallelRegion(Function):
    """Keep this rank's slice of the last axis forward; all-gather the gradient backward."""

    autocast = "pass"  # chapter 10 (messages carry the tensor's own format)

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_slice(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last_dim(g, ctx.group), None


def copy_to_tensor_parallel_region(x, group):
    return CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    return ReduceFromTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x, group):
    return GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x, group):
    return ScatterToTensorParallelRegion.apply(x, group)


# ----------------------------------------------------------------------------- layers


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"tensor parallel: {what}={numerator} is not divisible by tp={denominator}")
    return numerator // denominator


def _split_parameter(shape, partition_dim: int, group: World, dtype=None) -> Parameter:
    """A Parameter holding this rank's slice of a weight of full shape `shape`."""
    local = list(shape)
    local[partition_dim] //= group.size
    p = Parameter(np.zeros(local), dtype)
    p.tensor_model_parallel, p.partition_dim, p.full_shape = True, partition_dim, tuple(shape)
    return p


class ColumnParallelLinear(Module):
    """Y = X A^T + b with A (out, in) cut by rows: this rank holds A_r (out/t, in) and b_r.

    The input X is replicated; the output is this rank's out/t features, or the whole Y if
    gather_output=True. `copy_input=False` skips f when the caller has applied it once for
    several layers reading the same input (attention's q, k, v: one all-reduce in backward
    instead of three, which Megatron gets from its single fused qkv projection).

    `group` is the model's verified group (`TensorParallelGPT`), or any World: then every
    collective checks its arguments first (chapter 7)."""

    def __init__(self, in_features: int, out_features: int, group: World | None = None, bias: bool = True,
                 gather_output: bool = False, copy_input: bool = True, dtype=None):
        self.group = get_world() if group is None else group
        self.in_features, self.out_features = in_features, out_features
        self.output_size_per_partition = divide(out_features, self.group.size, "out_features")
        self.gather_output, self.copy_input = gather_output, copy_input
        self.weight = _split_parameter((out_features, in_features), 0, self.group, dtype)
        self.bias = _split_parameter((out_features,), 0, self.group, dtype) if bias else None

    @staticmethod
    def enter(x, group):
        """f: the replicated input enters the split layer (identity; backward all-reduce)."""
        return copy_to_tensor_parallel_region(x, group)

    def forward(self, x):
        if self.copy_input:
            x = self.enter(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(Module):
    """Y = X A^T + b with A (out, in) cut by columns: this rank holds A_r (out, in/t).

    The input is already split by features (input_is_parallel=True, the output of a
    column-parallel layer) or is split here. Each rank's X_r A_r^T is a partial sum of Y; g adds
    them up. The bias is replicated and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, group: World | None = None, bias: bool = True,
                 input_is_parallel: bool = True, dtype=None):
        self.group = get_world() if group is None else group
        self.in_features, self.out_features = in_features, out_features
        self.input_size_per_partition = divide(in_features, self.group.size, "in_features")
        self.input_is_parallel = input_is_parallel
        self.weight = _split_parameter((out_features, in_features), 1, self.group, dtype)
        self.bias = Parameter(np.zeros(out_features), dtype) if bias else None

    @staticmethod
    def reduce(partial, group):
        """g: the ranks' partial sums add up to the output (all-reduce; backward identity)."""
        return reduce_from_tensor_parallel_region(partial, group)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        y = self.reduce(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(Module):
    """An embedding table cut by rows (vocabulary entries): this rank holds ids
    [vocab_start_index, vocab_end_index). Ids outside the range look up a zero row; g sums the
    ranks' rows, and exactly one rank contributed each id's embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: World | None = None, dtype=None):
        self.group = get_world() if group is None else group
        self.num_embeddings = num_embeddings
        per_rank = divide(num_embeddings, self.group.size, "vocab_size")
        self.vocab_start_index = self.group.rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.weight = _split_parameter((num_embeddings, embedding_dim), 0, self.group, dtype)

    @staticmethod
    def reduce(rows, group):
        """g: the ranks' rows add up to the embedding (one rank looked up each id)."""
        return reduce_from_tensor_parallel_region(rows, group)

    def forward(self, ids):
        ids = np.asarray(ids.data if isinstance(ids, Tensor) else ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"embedding: ids must be in 0..{self.num_embeddings - 1}, got {ids.min()}..{ids.max()}")
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = np.where(outside, 0, ids - self.vocab_start_index)  # any valid row; zeroed next
        rows = F.masked_fill(F.embedding(local_ids, self.weight), outside[..., None], 0.0)
        return self.reduce(rows, self.group)


class TensorParallelLayers:
    """The layers a tensor-parallel GPT is built from (`tensor_parallel.py`). Sequence
    parallelism (`sequence.py`) builds the same GPT from its own list: chosen once, with the model."""

    column = ColumnParallelLinear
    row = RowParallelLinear
    embedding = VocabParallelEmbedding

    @staticmethod
    def dropout(p: float, group: World, seed: int) -> Module:
        """Dropout on the replicated activation: every rank draws the serial model's mask."""
        return Dropout(p, seed=seed)


# ----------------------------------------------------------------------------- loss


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy where each rank holds logits for V/t vocabulary entries.

    Serially: loss = log(sum_v exp(z_v - m)) - (z_target - m), with m = max_v z_v. Each of the
    three global quantities is a reduction over v, so each rank reduces its slice and an
    all-reduce combines them: max for m, then sum for (sum of exp, z_target - m) — the target's
    logit lives on exactly one rank, the others contribute 0. Backward needs no message:
    dL/dz_v = (softmax_v - [v = target]) / count, and each rank has softmax for its own v."""

    autocast = "fp32"  # chapter 10 (the loss in fp32, as CrossEntropy)

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, ignore_index):
        n_local = logits.shape[-1]
        flat = logits.reshape(-1, n_local)
        ids = targets.reshape(-1)
        rows = np.arange(flat.shape[0])
        counted = ids != ignore_index
        row_max = flat.max(axis=-1)
        all_reduce(row_max, op="max", group=group)
        shifted = flat - row_max[:, None]
        local = ids - vocab_start
        mine = counted & (local >= 0) & (local < n_local)  # rows whose target is in my slice
        local = np.where(mine, local, 0)
        stats = np.zeros((2, flat.shape[0]), dtype=flat.dtype)
        stats[1] = np.where(mine, shifted[rows, local], 0.0)
        np.exp(shifted, out=shifted)
        stats[0] = shifted.sum(axis=-1)
        all_reduce(stats, group=group)  # one message for both sums
        total, picked = stats
        count = max(int(counted.sum()), 1)
        loss = -np.where(counted, picked - np.log(total), 0.0).sum() / count
        shifted /= total[:, None]  # now the softmax over the whole vocabulary, my slice of it
        ctx.save_for_backward(shifted)
        ctx.rows, ctx.local, ctx.mine, ctx.counted, ctx.count, ctx.shape = rows, local, mine, counted, count, logits.shape
        return np.asarray(loss, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, g):
        (probs,) = ctx.saved
        grad = probs.copy()
        grad[ctx.rows[ctx.mine], ctx.local[ctx.mine]] -= 1.0
        grad *= (ctx.counted * (float(g) / ctx.count)).astype(grad.dtype)[:, None]
        return grad.reshape(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, group, vocab_start: int, vocab_size: int, ignore_index=-100):
    """Mean cross-entropy of `targets` (...,) under this rank's logits (..., V/t) for the
    vocabulary entries vocab_start .. vocab_start + V/t - 1. Same value on every rank."""
    targets = np.asarray(targets.data if isinstance(targets, Tensor) else targets)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: logits of shape {logits.shape} need targets of shape "
                         f"{logits.shape[:-1]}, got {targets.shape}")
    counted = targets[targets != ignore_index]
    if counted.size and (counted.min() < 0 or counted.max() >= vocab_size):
        raise IndexError(f"cross_entropy: targets must be in 0..{vocab_size - 1}, got {counted.min()}..{counted.max()}")
    return VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, ignore_index)


def vocab_parallel_argmax(logits: np.ndarray, group: World, vocab_start: int) -> np.ndarray:
    """argmax over the whole vocabulary from each rank's slice (ties: the lowest id, as
    np.argmax): all-reduce the maxima, then the lowest id reaching the maximum."""
    best = logits.max(axis=-1)
    global_best = best.copy()  # a copy: the all-reduce works in place
    all_reduce(global_best, op="max", group=group)
    ids = np.where(best == global_best, logits.argmax(axis=-1) + vocab_start, np.iinfo(np.int64).max)
    return all_reduce(np.ascontiguousarray(ids, dtype=np.int64), op="min", group=group)
