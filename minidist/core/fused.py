"""The operations a transformer spends its time in, each one Function with a hand-derived backward.

Chapter 1. Composing `linear` or `layer_norm` from small operations would work (autograd makes
any composition differentiable) but would create and keep many temporaries. Like PyTorch's and
Megatron-LM's kernels, each operation here computes its forward in a few NumPy calls and its
backward from a derivation written once by hand, saving only what that derivation needs (which
is what chapter 1's activation count reads off). Every one is checked against finite
differences in tests/test_functional.py.

This file is the plain path: each operation written as its formula. `fused_fast.py` holds the
same operations tuned for speed, and `minidist.core.kernels` chooses between the two (fast unless
told otherwise); tests/test_kernels.py holds them to the same numbers. The functions at the end
of each section (`linear`, `gelu`, ...) check their inputs and run the class `kernels.chosen`
names: the one here, or its namesake in fused_fast.py (which builds on this file, and so tells
`kernels` its classes rather than being imported here).

Shapes follow PyTorch: `linear` weights are (out_features, in_features); attention takes
(batch, heads, time, head_dim); `cross_entropy` takes logits (..., vocab) and integer targets.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from minidist.core.kernels import chosen
from minidist.core.tensor import Function, Tensor, autocast_active


def _same_dtype(name, *tensors):
    """Float tensors meeting in one operation must share a dtype (no silent float32 -> float64).
    Under autocast (chapter 10) the policy decides each operation's dtypes instead."""
    if autocast_active():
        return
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
        y = x.reshape(-1, x.shape[-1]) @ weight.T  # one matrix product for all positions
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @classmethod
    def backward(cls, ctx, g):
        x, weight = ctx.saved
        g2 = g.reshape(-1, g.shape[-1])
        gx = (g2 @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = g2.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        gb = cls.bias_grad(g2) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb

    @staticmethod
    def bias_grad(g2):
        """db: the sum of g's rows (the fast path's twin sums them by a matrix-vector product)."""
        return g2.sum(axis=0)


def linear(x, weight, bias=None):
    _same_dtype("linear", x, weight, bias)
    return chosen(Linear).apply(x, weight, bias)


# ----------------------------------------------------------------------------- embedding


class Embedding(Function):
    """Row lookup. The gradient of a row is the sum of the gradients of every position using it."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.ids, ctx.shape = ids, weight.shape
        return weight[ids]

    @staticmethod
    def backward(ctx, g):
        grad = np.zeros(ctx.shape, dtype=g.dtype)
        np.add.at(grad, ctx.ids.reshape(-1), g.reshape(-1, ctx.shape[1]))  # repeated ids add up
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
    return chosen(Embedding).apply(ids, weight)


# ----------------------------------------------------------------------------- layer norm


class LayerNorm(Function):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis.

    With xhat the normalised input and r = 1/sqrt(var + eps), the backward is
    dx = r * (gh - mean(gh) - xhat * mean(gh * xhat)), where gh = g * w.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        centred = x - x.mean(-1, keepdims=True)
        var = (centred * centred).mean(-1, keepdims=True)
        rstd = 1.0 / np.sqrt(var + eps)
        xhat = centred * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        return xhat * weight + bias

    @staticmethod
    def backward(ctx, g):
        xhat, rstd, weight = ctx.saved
        n = xhat.shape[-1]
        gw = (g * xhat).reshape(-1, n).sum(axis=0) if ctx.needs_input_grad[1] else None
        gb = g.reshape(-1, n).sum(axis=0) if ctx.needs_input_grad[2] else None
        gh = g * weight
        gx = rstd * (gh - gh.mean(-1, keepdims=True) - xhat * (gh * xhat).mean(-1, keepdims=True))
        return gx, gw, gb, None


def layer_norm(x, weight, bias, eps=1e-5):
    _same_dtype("layer_norm", x, weight, bias)
    return chosen(LayerNorm).apply(x, weight, bias, float(eps))


# ----------------------------------------------------------------------------- GELU

_GELU_C = math.sqrt(2.0 / math.pi)  # a Python float: keeps float32 arrays float32


class GELU(Function):
    """GELU, tanh form: 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3), c = sqrt(2/pi).

    d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2), with t = tanh(u).
    (x*x*x, never x**3: NumPy's power is ~200x slower here.)
    """

    @staticmethod
    def forward(ctx, x):
        t = np.tanh(_GELU_C * (x + 0.044715 * x * x * x))
        ctx.save_for_backward(x, t)  # backward needs tanh(u): keep it rather than recompute it
        return 0.5 * x * (1.0 + t)

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved
        du = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
        return (g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du),)


def gelu(x):
    return chosen(GELU).apply(x)


# ----------------------------------------------------------------------------- softmax family


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))  # subtracting the max: exp never overflows
    return e / e.sum(axis=axis, keepdims=True)


class Softmax(Function):
    """y = exp(x) / sum(exp(x)); dx = y * (g - sum(g * y))."""

    @staticmethod
    def forward(ctx, x, axis):
        y = _softmax(x, axis)
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
    return chosen(Softmax).apply(x, axis)


def log_softmax(x, axis=-1):
    return chosen(LogSoftmax).apply(x, axis)


# ----------------------------------------------------------------------------- attention


class ScaledDotProductAttention(Function):
    """softmax(q k^T / sqrt(d) + causal mask) v, optionally with dropout on the weights.

    Backward, with a = softmax weights, a' = a * dropout mask, g = dL/dy:
    dv = a'^T g;  da = (g v^T) * mask;  ds = a * (da - sum(da * a)) / sqrt(d);
    dq = ds k;  dk = ds^T q.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, dropout_p, rng):
        scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
        if causal:
            scores = scores + _causal_mask(*scores.shape[-2:], scores.dtype)
        weights = _softmax(scores, -1)
        mask = _dropout_mask(weights.shape, weights.dtype, dropout_p, rng) if dropout_p > 0.0 else None
        dropped = weights if mask is None else weights * mask
        ctx.save_for_backward(q, k, v, weights, mask)
        return dropped @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v, weights, mask = ctx.saved
        dropped = weights if mask is None else weights * mask
        gv = np.swapaxes(dropped, -1, -2) @ g
        ga = g @ np.swapaxes(v, -1, -2)
        if mask is not None:
            ga = ga * mask
        gs = weights * (ga - (ga * weights).sum(-1, keepdims=True)) / math.sqrt(q.shape[-1])
        return gs @ k, np.swapaxes(gs, -1, -2) @ q, gv, None, None, None


def _causal_mask(t_q, t_k, dtype):
    """0 where query i may see key j, -inf where it may not: j <= i + t_k - t_q (queries aligned
    at the end, so the last query sees every key), as exp(-inf) = 0 gives those keys no weight."""
    return np.triu(np.full((t_q, t_k), -np.inf, dtype=dtype), k=t_k - t_q + 1)


def scaled_dot_product_attention(q, k, v, causal=True, dropout_p=0.0, rng=None):
    """Attention over (batch, heads, time, head_dim) tensors, as torch's function of that name.

    With fewer queries than keys, the causal mask aligns the queries with the *last* keys (query
    i sees keys j <= i + T_k - T_q), as a decoder with a KV cache needs; PyTorch's `is_causal`
    aligns them with the first."""
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2]):
        raise ValueError(f"attention: incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(f"attention: causal with {q.shape[-2]} queries but only {k.shape[-2]} keys "
                         "(the first queries would see no key)")
    _same_dtype("attention", q, k, v)
    return chosen(ScaledDotProductAttention).apply(q, k, v, causal, float(dropout_p), rng)


# ----------------------------------------------------------------------------- dropout


_rows = [None]  # (first, total) inside `dropout_rows`


@contextlib.contextmanager
def dropout_rows(first: int, total: int):
    """Inside, every dropout mask is drawn for the whole batch of `total` rows, and this process
    keeps its rows first, first + 1, ...: each row (sample) gets the mask a serial run of the
    whole batch draws for it, whichever rank holds it and however many rows that rank holds.
    For data parallelism with a changing split (chapter 3, `--balance`): the masks follow the
    rows, so the run is the serial one whatever the split. It costs a draw of the whole batch's
    masks on every rank. The batch is the first axis of every mask (tokens, attention weights)."""
    previous, _rows[0] = _rows[0], (first, total)
    try:
        yield
    finally:
        _rows[0] = previous


def _dropout_mask(shape, dtype, p, rng):
    if rng is None:
        raise ValueError("dropout needs an explicit np.random.Generator (rng=...) so runs are reproducible")
    if _rows[0] is None:
        keep = rng.random(shape) >= p
    else:  # the whole batch's draw, then this rank's rows (see dropout_rows)
        first, total = _rows[0]
        keep = rng.random((total, *shape[1:]))[first:first + shape[0]] >= p
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
    return chosen(Dropout).apply(x, float(p), rng)


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
        safe_ids = np.where(counted, ids, 0)  # any valid row index; ignored tokens count 0 below
        rows = np.arange(flat.shape[0])
        shifted = flat - flat.max(axis=-1, keepdims=True)
        e = np.exp(shifted)
        total = e.sum(axis=-1)
        log_p = shifted[rows, safe_ids] - np.log(total)  # never log(0), even where p underflows
        count = max(int(counted.sum()), 1)
        loss = -np.where(counted, log_p, 0.0).sum() / count
        probs = e / total[:, None]
        ctx.save_for_backward(probs)
        ctx.rows, ctx.ids, ctx.counted, ctx.count, ctx.shape = rows, safe_ids, counted, count, logits.shape
        return np.asarray(loss, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, g):
        (probs,) = ctx.saved
        onehot = np.zeros_like(probs)
        onehot[ctx.rows, ctx.ids] = 1.0
        per_token = (ctx.counted * (float(g) / ctx.count)).astype(probs.dtype)  # 0 for ignored tokens
        return ((probs - onehot) * per_token[:, None]).reshape(ctx.shape), None, None


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
    return chosen(CrossEntropy).apply(logits, targets, ignore_index)
