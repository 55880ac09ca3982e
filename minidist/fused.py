"""The operations a transformer spends its time in, each fused into one Function.

Chapter 1. Composing `linear` or `layer_norm` from small operations would work (autograd makes
any composition differentiable) but would create and keep many temporaries. Like PyTorch's and
Megatron-LM's kernels, each operation here computes its forward in a few NumPy calls and its
backward from a derivation written once by hand, saving only what that derivation needs. Every
one is checked against finite differences in tests/test_functional.py.

Memory traffic decides their speed more than arithmetic does. Writing into a fresh array costs
about twice a pass over memory just used (the CPU reads each new cache line before writing it),
so where it is safe the operations write over arrays they own: the softmax over its scores, and
backward over what its own forward saved (the engine runs backward once per graph and then frees
it: LayerNorm, GELU and CrossEntropy do this). Chains of elementwise passes run block by block in
the CPU cache (`_blocks`).

Shapes follow PyTorch: `linear` weights are (out_features, in_features); attention takes
(batch, heads, time, head_dim); `cross_entropy` takes logits (..., vocab) and integer targets.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from minidist.tensor import Function, Tensor


def _same_dtype(name, *tensors):
    """Float tensors meeting in one operation must share a dtype (no silent float32 -> float64)."""
    dtypes = [t.dtype for t in tensors if t is not None and t.dtype.kind == "f"]
    for dtype in dtypes[1:]:
        if dtype != dtypes[0]:
            raise TypeError(f"{name}: tensors of dtypes {dtypes[0]} and {dtype}; cast one explicitly "
                            "(dtypes never change silently)")


# ----------------------------------------------------------------------------- linear


class Linear(Function):
    """y = x W^T + b. With x flattened to (N, in): dx = g W, dW = g^T x, db = sum of g's rows."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"linear: input has {x.shape[-1]} features (shape {x.shape}) "
                             f"but the weight expects {weight.shape[1]} (weight shape {weight.shape})")
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = x.reshape(-1, x.shape[-1]) @ weight.T
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved
        g2 = g.reshape(-1, g.shape[-1])
        gx = (g2 @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = g2.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = g2.sum(axis=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x, weight, bias=None):
    _same_dtype("linear", x, weight, bias)
    return Linear.apply(x, weight, bias)


# ----------------------------------------------------------------------------- embedding


class Embedding(Function):
    """Row lookup. The gradient of a row is the sum of the gradients of every position using it."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.ids, ctx.shape = ids, weight.shape
        return weight[ids]

    @staticmethod
    def backward(ctx, g):
        # Group the positions by id and add each group's rows up: sort the ids, then one
        # np.add.reduceat over the runs of equal ids. (np.add.at(grad, ids, rows) says the same
        # in one line, but adds one row at a time: measured, 1024 ids into 256 x 128 in
        # float64, 2.4 ms -> 1.1 ms; the sums agree to rounding, in another order.)
        ids, rows = ctx.ids.reshape(-1), g.reshape(-1, ctx.shape[1])
        grad = np.zeros(ctx.shape, dtype=g.dtype)
        if ids.size:
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
            grad[sorted_ids[starts]] = np.add.reduceat(rows[order], starts, axis=0)
        return None, grad


def embedding(ids, weight):
    """Look up rows of `weight` (num_embeddings, dim) for integer `ids` of any shape."""
    ids = ids.data if isinstance(ids, Tensor) else np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding: ids must be integers, got dtype {ids.dtype}")
    n = weight.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        bad = ids[(ids < 0) | (ids >= n)].flat[0]
        raise IndexError(f"embedding: id {bad} is outside the table of {n} rows (valid ids are 0..{n - 1})")
    return Embedding.apply(ids, weight)


# ----------------------------------------------------------------------------- layer norm


class LayerNorm(Function):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis.

    With xhat the normalised input and r = 1/sqrt(var + eps), the backward is
    dx = r * (gh - mean(gh) - xhat * mean(gh * xhat)), where gh = g * w.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        n = x.shape[-1]
        xhat = x - _row_means(x)
        var = np.einsum("...i,...i->...", xhat, xhat)[..., None]  # multiply and sum in one pass
        var *= 1.0 / n
        var += eps
        rstd = 1.0 / np.sqrt(var)
        xhat *= rstd
        ctx.save_for_backward(xhat, rstd, weight)
        y = xhat * weight
        y += bias
        return y

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, weight = ctx.saved
        n = xhat.shape[-1]
        rows_g, rows_xhat = g.reshape(-1, n), xhat.reshape(-1, n)
        gw = np.einsum("ij,ij->j", rows_g, rows_xhat) if ctx.needs_input_grad[1] else None
        gb = rows_g.sum(axis=0) if ctx.needs_input_grad[2] else None
        gx = g * weight                                                   # gh
        a = np.einsum("...i,...i->...", gx, xhat)[..., None] * (1.0 / n)  # mean(gh * xhat)
        gx -= _row_means(gx)
        # xhat is not needed after this (backward frees the graph), so it takes the product in
        # place: a fresh array here costs twice as much (measured in the model, float64)
        xhat *= a
        gx -= xhat
        gx *= rstd
        return gx, gw, gb, None


def _row_means(x):
    """Means over the last axis, keepdims, as a matrix-vector product: BLAS's gemv takes a
    quarter of the time of x.mean(axis=-1) on the model's (1024, 128) rows."""
    return (x.reshape(-1, x.shape[-1]) @ np.full(x.shape[-1], 1.0 / x.shape[-1], dtype=x.dtype)).reshape(*x.shape[:-1], 1)


def layer_norm(x, weight, bias, eps=1e-5):
    _same_dtype("layer_norm", x, weight, bias)
    return LayerNorm.apply(x, weight, bias, float(eps))


# ----------------------------------------------------------------------------- GELU

_GELU_C = math.sqrt(2.0 / math.pi)  # a Python float: keeps float32 arrays float32


class GELU(Function):
    """GELU, tanh form: 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3), c = sqrt(2/pi).

    d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2), with t = tanh(u).
    (x*x*x, never x**3: NumPy's power is ~200x slower here.)

    Speed: each formula is a chain of about ten elementwise passes, and at the demo's size
    (4 MB in float64) every pass would stream the arrays from main memory again. Working
    through the arrays in blocks that fit in the CPU cache (`_blocks`) lets the passes hit
    the cache instead: measured 3.3 -> 2.3 ms forward and 3.5 -> 2.2 ms backward per call in
    float64, with the same numbers.
    """

    @staticmethod
    def forward(ctx, x):
        y, t = np.empty_like(x), np.empty_like(x)
        for blocks in _blocks(x, y, t, whole=0):
            _gelu_forward(*blocks)
        ctx.save_for_backward(x, t)
        return y

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved
        # the gradient overwrites t, block by block (t is ours, and the graph is freed after
        # backward): cheaper than writing a fresh array
        for blocks in _blocks(x, t, np.ascontiguousarray(g), whole=0, scratch=2):
            _gelu_backward(*blocks)
        return (t,)


def _gelu_forward(x, y, t):
    np.multiply(x, x, out=t)
    t *= 0.044715 * _GELU_C
    t += _GELU_C
    t *= x                                      # u = c (x + 0.044715 x^3)
    np.tanh(t, out=t)                           # t = tanh(u), kept for backward
    np.add(t, 1.0, out=y)
    y *= x
    y *= 0.5                                    # y = 0.5 x (1 + t)


def _gelu_backward(x, t, g, d, s):
    """t becomes the gradient g * dGELU/dx (d and s are scratch)."""
    np.multiply(t, t, out=d)
    np.subtract(1.0, d, out=d)                  # 1 - t^2
    np.multiply(x, x, out=s)
    s *= 3 * 0.044715 * 0.5 * _GELU_C
    s += 0.5 * _GELU_C                          # 0.5 c (1 + 3 * 0.044715 x^2)
    d *= s
    d *= x                                      # 0.5 x (1 - t^2) du/dx
    t *= 0.5
    t += d
    t += 0.5                                    # + 0.5 (1 + t)
    t *= g


_BLOCK = 1 << 16  # elements per block: 256-512 KB per array, a few arrays fit in L2/L3


def _blocks(*arrays, whole=1, scratch=0):
    """Yield blocks of C-contiguous arrays that share their leading axes: views of about _BLOCK
    elements each, cut along the leading axes, keeping the last `whole` axes whole (0: flat
    blocks for elementwise work, 1: rows for a softmax, 2: (T, T) matrices for attention). For
    chains of passes that should hit the cache.

    `scratch` extra blocks for intermediate terms follow the arrays' blocks; they are allocated
    once, one block long: a full-size scratch array would be written out to memory for nothing
    (measured in the model, where memory is the bottleneck: GELU, forward and backward, 38.7 ->
    37.0 ms per step in float64, 14.1 -> 13.7 ms in float32)."""
    tails = [a.shape[a.ndim - whole:] for a in arrays]
    flat = [a.reshape(-1, *tail) for a, tail in zip(arrays, tails)]
    per_block = max(1, _BLOCK // max(1, math.prod(tails[0])))
    spare = [np.empty((min(per_block, len(flat[0])),) + tails[0], dtype=flat[0].dtype) for _ in range(scratch)]
    for start in range(0, len(flat[0]), per_block):
        blocks = [a[start:start + per_block] for a in flat]
        yield blocks + [s[:len(blocks[0])] for s in spare]


def gelu(x):
    return GELU.apply(x)


# ----------------------------------------------------------------------------- softmax family


def _softmax_array(x, axis):
    if axis not in (-1, x.ndim - 1) or not x.flags.c_contiguous:
        y = x - x.max(axis=axis, keepdims=True)
        np.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
        return y
    y = np.empty_like(x)  # over the last axis: rows in cache-sized blocks
    for rows_in, rows_out in _blocks(x, y):
        np.subtract(rows_in, rows_in.max(axis=-1, keepdims=True), out=rows_out)  # no overflow in exp
        np.exp(rows_out, out=rows_out)
        rows_out /= rows_out.sum(axis=-1, keepdims=True)
    return y


class Softmax(Function):
    """y = exp(x) / sum(exp(x)); dx = y * (g - sum(g * y))."""

    @staticmethod
    def forward(ctx, x, axis):
        y = _softmax_array(x, axis)
        ctx.save_for_backward(y)
        ctx.axis = axis
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        return y * (g - (g * y).sum(axis=ctx.axis, keepdims=True)), None


class LogSoftmax(Function):
    """y = x - logsumexp(x); dx = g - softmax(x) * sum(g)."""

    @staticmethod
    def forward(ctx, x, axis):
        shifted = x - x.max(axis=axis, keepdims=True)
        y = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
        ctx.save_for_backward(y)
        ctx.axis = axis
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        return g - np.exp(y) * g.sum(axis=ctx.axis, keepdims=True), None


def softmax(x, axis=-1):
    return Softmax.apply(x, axis)


def log_softmax(x, axis=-1):
    return LogSoftmax.apply(x, axis)


# ----------------------------------------------------------------------------- attention


class ScaledDotProductAttention(Function):
    """softmax(q k^T / sqrt(d) + causal mask) v, optionally with dropout on the weights.

    Backward, with a = softmax weights, a' = a * dropout mask, g = dL/dy:
    dv = a'^T g;  da = (g v^T) * mask;  ds = a * (da - sum(da * a)) / sqrt(d);
    dq = ds k;  dk = ds^T q.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, dropout_p, rng):
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = q @ np.swapaxes(k, -1, -2)
        if causal:  # the scale is applied inside, on blocks in the cache
            weights = _causal_softmax(scores, _causal_keep(*scores.shape[-2:]), scale)
        else:
            scores *= scale
            weights = _softmax_array(scores, -1)
        mask = None
        if dropout_p > 0.0:
            mask = _dropout_mask(weights.shape, weights.dtype, dropout_p, rng)
            dropped = weights * mask
        else:
            dropped = weights
        ctx.save_for_backward(q, k, v, weights, mask)
        return dropped @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, weights, mask = ctx.saved
        dropped = weights if mask is None else weights * mask
        gv = np.swapaxes(dropped, -1, -2) @ g
        ga = g @ np.swapaxes(v, -1, -2)
        if mask is not None:
            ga *= mask
        gs = ga
        gs -= np.einsum("...ij,...ij->...i", ga, weights)[..., None]
        gs *= weights
        scale = 1.0 / math.sqrt(q.shape[-1])  # applied to the (B,H,T,D) results, not to gs
        gq = gs @ k
        gq *= scale
        gk = np.swapaxes(gs, -1, -2) @ q
        gk *= scale
        return gq, gk, gv, None, None, None


@functools.lru_cache(maxsize=16)
def _causal_keep(t_q: int, t_k: int) -> np.ndarray:
    """True where query i may see key j (j <= i, with the queries aligned at the end)."""
    keep = np.tril(np.ones((t_q, t_k), dtype=bool), k=t_k - t_q)
    keep.flags.writeable = False
    return keep


def _causal_softmax(scores, keep, scale=1.0):
    """Softmax over the last axis of scale * scores (..., T_q, T_k), in place, over the entries
    `keep` only; the others get weight exactly 0 (as if their scores were -inf). (The scale, a
    positive number, is applied after the max is subtracted: max(scale * s) = scale * max(s).)

    Written with NumPy's `where=` instead of adding -inf above the diagonal: the masked max
    saves the pass that adds the mask, and the masked exp never sees -inf. NumPy's float64 exp
    leaves its fast vector loop for -inf (and for results that underflow): measured on 262k
    elements, half of them -inf, 1.24 ms against 0.36 ms with none. Per attention call in
    float64 3.1 -> 2.2 ms, float32 unchanged, and the same bits as the -inf version.
    Works through cache-sized blocks of whole (T_q, T_k) matrices (`_blocks`), and writes the
    weights over the scores (a fresh array costs more than a pass over memory just used).
    """
    for s, t in _blocks(scores, whole=2, scratch=1):  # t: one block of scratch
        np.subtract(s, np.max(s, axis=-1, where=keep, initial=-np.inf, keepdims=True), out=t)
        if scale != 1.0:
            t *= scale
        s.fill(0.0)                   # the weight of a masked entry
        np.exp(t, out=s, where=keep)  # above the diagonal t is garbage and never used
        s /= s.sum(axis=-1, keepdims=True)
    return scores


def scaled_dot_product_attention(q, k, v, causal=True, dropout_p=0.0, rng=None):
    """Attention over (batch, heads, time, head_dim) tensors, as torch's function of that name."""
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2]):
        raise ValueError(f"attention: incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    _same_dtype("attention", q, k, v)
    return ScaledDotProductAttention.apply(q, k, v, causal, float(dropout_p), rng)


# ----------------------------------------------------------------------------- dropout


def _dropout_mask(shape, dtype, p, rng):
    if rng is None:
        raise ValueError("dropout needs an explicit np.random.Generator (rng=...) so runs are reproducible")
    keep = rng.random(shape) >= p
    return keep.astype(dtype) * (1.0 / (1.0 - p))  # scale the kept ones so the mean is unchanged


class Dropout(Function):
    @staticmethod
    def forward(ctx, x, p, rng):
        mask = _dropout_mask(x.shape, x.dtype, p, rng)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved[0], None, None


def dropout(x, p, training=True, rng=None):
    """Zero each element with probability p (scaling the rest by 1/(1-p)); identity in eval."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    return Dropout.apply(x, float(p), rng)


# ----------------------------------------------------------------------------- cross-entropy


class CrossEntropy(Function):
    """Mean over counted tokens of -log softmax(logits)[target], fused and stable.

    dL/dlogits = (softmax(logits) - onehot(target)) / count for counted tokens, 0 for ignored.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        flat = logits.reshape(-1, logits.shape[-1])
        ids = targets.reshape(-1)
        counted = ids != ignore_index
        safe_ids = np.where(counted, ids, 0)
        rows = np.arange(flat.shape[0])
        # log p = shifted - log(sum(exp(shifted))): never log(0), even where p underflows
        probs = flat - flat.max(axis=-1, keepdims=True)
        picked = probs[rows, safe_ids]
        np.exp(probs, out=probs)
        total = probs.sum(axis=-1, keepdims=True)
        probs /= total
        count = max(int(counted.sum()), 1)
        loss = -np.where(counted, picked - np.log(total[:, 0]), 0.0).sum() / count
        ctx.save_for_backward(probs)
        ctx.rows, ctx.ids, ctx.counted, ctx.count, ctx.shape = rows, safe_ids, counted, count, logits.shape
        return np.asarray(loss, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, g):
        (probs,) = ctx.saved
        grad = probs  # in place: the graph, and with it probs, is freed after backward
        grad[ctx.rows, ctx.ids] -= 1.0
        grad *= (ctx.counted * (float(g) / ctx.count)).astype(grad.dtype)[:, None]
        return grad.reshape(ctx.shape), None, None


def cross_entropy(logits, targets, ignore_index=-100):
    """Mean cross-entropy of integer `targets` (...,) under `logits` (..., vocab).

    Targets equal to `ignore_index` are skipped and not counted in the mean.
    """
    targets = targets.data if isinstance(targets, Tensor) else np.asarray(targets)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: logits of shape {logits.shape} need targets of shape "
                         f"{logits.shape[:-1]}, got {targets.shape}")
    vocab = logits.shape[-1]
    counted = targets[targets != ignore_index]
    if counted.size and (counted.min() < 0 or counted.max() >= vocab):
        bad = counted[(counted < 0) | (counted >= vocab)][0]
        raise IndexError(f"cross_entropy: target {bad} is outside the vocabulary of size {vocab}")
    return CrossEntropy.apply(logits, targets, ignore_index)
