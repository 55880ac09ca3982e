"""The fast path: fused.py's operations tuned for the CPU's memory traffic, with the same numbers.

Chapter 1. `minidist.core.kernels` runs these unless told "plain" (fused.py's formulas, which a
learner should read first). Each class here subclasses its plain twin of the same name and
keeps its formula; tests/test_kernels.py holds the two paths to the same numbers. Operations
whose plain form is already as fast (Softmax, LogSoftmax and Dropout: not in the training
step's hot path) are the plain classes themselves.

Memory traffic decides the speed of these operations more than arithmetic does, and the tricks
are three:

- Write over arrays the operation owns: writing into a fresh array costs about twice a pass over
  memory just used (the CPU reads each new cache line before writing it). Backward may overwrite
  what its own forward saved, because the engine runs backward once per graph and then frees it.
- Run a chain of elementwise passes block by block through the CPU cache (`_blocks`) instead of
  streaming whole arrays from main memory once per pass.
- Leave NumPy's slow paths: a matrix-vector product for row means and sums (BLAS gemv), no short
  reductions where a view will do (the causal softmax shifts rows by the diagonal), no masked
  (`where=`) ufuncs (they leave the vector loops), and no -inf into float64 exp (which does too).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from minidist.core import fused
from minidist.core.fused import _GELU_C, _dropout_mask
from minidist.core.fused import Dropout, LogSoftmax, Softmax  # noqa: F401  (shared: the plain class is as fast)
from minidist.core.kernels import register_fast

_BLOCK_BYTES = 1 << 18  # 256 KB of each array per block: a chain's four or five arrays fit in a 2 MB L2


def _blocks(*arrays, whole=1, scratch=0):
    """Yield blocks of C-contiguous arrays that share their leading axes: views of about
    _BLOCK_BYTES each, cut along the leading axes, keeping the last `whole` axes whole (0: flat
    blocks for elementwise work, 2: (T, T) matrices for attention). For chains of passes that
    should hit the cache.

    `scratch` extra blocks for intermediate terms follow the arrays' blocks; they are allocated
    once, one block long (a full-size scratch array would be written out to memory for nothing).
    """
    for a in arrays:  # reshape of a non-contiguous array copies: writes would land in the copy
        if not a.flags.c_contiguous:
            raise ValueError(f"_blocks: array of shape {a.shape} and strides {a.strides} is not C-contiguous")
    tails = [a.shape[a.ndim - whole:] for a in arrays]
    flat = [a.reshape(-1, *tail) for a, tail in zip(arrays, tails)]
    per_block = max(1, _BLOCK_BYTES // max(1, flat[0].itemsize * math.prod(tails[0])))
    spare = [np.empty((min(per_block, len(flat[0])),) + tails[0], dtype=flat[0].dtype) for _ in range(scratch)]
    for start in range(0, len(flat[0]), per_block):
        blocks = [a[start:start + per_block] for a in flat]
        yield blocks + [s[:len(blocks[0])] for s in spare]


def _column_sums(rows):
    """Sums over the first axis of a (N, C) array as a matrix-vector product (BLAS gemv reads the
    rows once, where NumPy's axis-0 sum adds row after row), for float32 and float64; other dtypes
    (16-bit floats, chapter 10) keep NumPy's sum."""
    if rows.dtype not in (np.float32, np.float64):
        return rows.sum(axis=0)
    return np.ones(rows.shape[0], dtype=rows.dtype) @ rows


# ----------------------------------------------------------------------------- linear


class Linear(fused.Linear):
    """The plain formulas; the bias gradient (the sum of g's rows) as a matrix-vector product."""

    bias_grad = staticmethod(_column_sums)


# ----------------------------------------------------------------------------- embedding


class Embedding(fused.Embedding):
    """Backward groups the positions by id: sort the ids, then one np.add.reduceat over each run
    of equal ids (np.add.at adds one row at a time). The sums are the same, in the same order."""

    @staticmethod
    def backward(ctx, g):
        ids, rows = ctx.ids.reshape(-1), g.reshape(-1, ctx.shape[1])
        grad = np.zeros(ctx.shape, dtype=g.dtype)
        if ids.size:
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
            grad[sorted_ids[starts]] = np.add.reduceat(rows[order], starts, axis=0)
        return None, grad


# ----------------------------------------------------------------------------- layer norm


def _row_means(x):
    """Means over the last axis, keepdims, as a matrix-vector product (BLAS gemv beats x.mean)."""
    return (x.reshape(-1, x.shape[-1]) @ np.full(x.shape[-1], 1.0 / x.shape[-1], dtype=x.dtype)).reshape(*x.shape[:-1], 1)


class LayerNorm(fused.LayerNorm):
    """The plain formulas, with gemv row means, einsum sums of products, and in-place updates."""

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
        gb = _column_sums(rows_g) if ctx.needs_input_grad[2] else None
        gx = g * weight                                                   # gh
        a = np.einsum("...i,...i->...", gx, xhat)[..., None] * (1.0 / n)  # mean(gh * xhat)
        gx -= _row_means(gx)
        xhat *= a  # xhat is ours and unused after this: the product goes in place
        gx -= xhat
        gx *= rstd
        return gx, gw, gb, None


# ----------------------------------------------------------------------------- GELU


class GELU(fused.GELU):
    """The plain formula in another form, as chains of in-place passes run block by block in the
    cache: 0.5 (1 + tanh(u)) is the logistic sigmoid of 2u, so GELU(x) = x / (1 + exp(-2u)), and
    NumPy's exp is about twice as fast as its tanh in float64 (in float32 its tanh is the faster,
    so float32 takes the sigmoid as 0.5 + 0.5 tanh(u)). Backward starts from the saved sigmoid."""

    @staticmethod
    def forward(ctx, x):
        x = np.ascontiguousarray(x)  # the blocks are flat views: a transposed input must be copied
        y, sig = np.empty_like(x), np.empty_like(x)
        with np.errstate(over="ignore"):  # exp(-2u) overflows to inf far left of 0: sigmoid 0, as it should
            for blocks in _blocks(x, y, sig, whole=0):
                _gelu_forward(*blocks)
        ctx.save_for_backward(x, sig)
        return y

    @staticmethod
    def backward(ctx, g):
        x, sig = ctx.saved
        # the gradient overwrites sig (ours, freed with the graph): cheaper than a fresh array
        for blocks in _blocks(x, sig, np.ascontiguousarray(g), whole=0, scratch=2):
            _gelu_backward(*blocks)
        return (sig,)


def _gelu_forward(x, y, sig):
    np.multiply(x, x, out=sig)
    if sig.dtype == np.float32:                 # float32's tanh is faster than its exp and a reciprocal
        sig *= 0.044715 * _GELU_C
        sig += _GELU_C
        sig *= x                                # u = c (x + 0.044715 x^3)
        np.tanh(sig, out=sig)
        sig *= 0.5
        sig += 0.5                              # sigmoid(2u) = 0.5 (1 + tanh(u))
    else:
        sig *= -2 * 0.044715 * _GELU_C
        sig -= 2 * _GELU_C
        sig *= x                                # -2u = -2c (x + 0.044715 x^3)
        np.exp(sig, out=sig)
        sig += 1.0
        np.divide(1.0, sig, out=sig)            # sigmoid(2u), kept for backward
    np.multiply(x, sig, out=y)                  # y = x sigmoid(2u)


def _gelu_backward(x, sig, g, q, d):
    """sig becomes the gradient g * dGELU/dx = g sigmoid (1 + (1 - sigmoid) 2x du/dx) (q, d scratch)."""
    np.multiply(x, x, out=q)
    q *= 6 * 0.044715 * _GELU_C
    q += 2 * _GELU_C
    q *= x                                      # q = 2x du/dx = 2c x (1 + 3 * 0.044715 x^2)
    np.subtract(1.0, sig, out=d)
    q *= d
    q += 1.0
    sig *= q
    sig *= g


# ----------------------------------------------------------------------------- attention


class ScaledDotProductAttention(fused.ScaledDotProductAttention):
    """The plain formulas with a masked in-place causal softmax and in-place backward terms."""

    @staticmethod
    def forward(ctx, q, k, v, causal, dropout_p, rng):
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = q @ np.swapaxes(k, -1, -2)
        if causal:  # the scale is applied inside, on blocks in the cache
            weights = _causal_softmax(scores, scale)
        else:
            scores *= scale
            weights = fused._softmax(scores, -1)
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
        gv = _matmul_heads_side_by_side(np.swapaxes(dropped, -1, -2), g)
        ga = g @ np.swapaxes(v, -1, -2)
        if mask is not None:
            ga *= mask
        gs = ga
        gs -= np.einsum("...ij,...ij->...i", ga, weights)[..., None]
        gs *= weights
        scale = 1.0 / math.sqrt(q.shape[-1])  # applied to the (B,H,T,D) results, the smaller arrays
        gq = _matmul_heads_side_by_side(gs, k)
        gq *= scale
        gk = _matmul_heads_side_by_side(np.swapaxes(gs, -1, -2), q)
        gk *= scale
        return gq, gk, gv, None, None, None


def _matmul_heads_side_by_side(a, b):
    """a @ b for (B, H, T, T) by (B, H, T, D), written into an array laid out in memory as
    (B, T, H, D): the gradients of q, k and v go back through the model's split_heads (chapter 6:
    (B, T, H*D) seen as heads), and from this layout that is a view, not a copy. BLAS writes each
    (T, D) block as a strided matrix, with the same numbers. Other shapes: a plain a @ b.
    (Forward keeps its contiguous result: the copy that joins the heads again is an activation
    the memory ledger counts, on both paths.)"""
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    if len(shape) != 4 or a.dtype != b.dtype:
        return a @ b
    n, h, t, d = shape
    return np.matmul(a, b, out=np.empty((n, t, h, d), a.dtype).transpose(0, 2, 1, 3))


@functools.lru_cache(maxsize=16)
def _causal_masks(t_q: int, t_k: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(fused._causal_mask: 0 where query i may see key j, -inf where not; the same as 1 and 0)."""
    bias = fused._causal_mask(t_q, t_k, np.dtype(dtype))
    keep = (bias == 0).astype(dtype)
    bias.flags.writeable = keep.flags.writeable = False
    return bias, keep


def _causal_softmax(scores, scale=1.0):
    """Softmax over the last axis of scale * scores (..., T_q, T_k) under the causal mask, in
    place, block by block in the cache; masked keys get weight exactly 0. (The scale, a positive
    number, is applied after the shift: scale * s - scale * d = scale * (s - d).)

    The number subtracted from a row before exp need not be its max: the row's sum divides it out
    again, and any number keeps exp in range unless the row's scores rise far above it. Each row
    here subtracts its query's score with its own key (the diagonal, always kept), a strided view:
    row maxima would be T_q short reductions per matrix, slow in NumPy. Rows whose sum comes out
    above `_FAR_ABOVE` (a score far above the diagonal: exp may overflow, and its arguments round
    coarsely) are done again from their maxima. Every choice is the row's own, so a row never
    depends on later queries, to the last bit (the model's causality, tests/test_model.py).

    Plain passes only: NumPy's masked (`where=`) exp leaves its vector loop (5-20 times slower)
    and float64 exp slows down on -inf, so there the masked entries are zeroed by multiplies
    with the 0/1 mask instead. Row sums as a matrix-vector product.
    """
    t_k = scores.shape[-1]
    bias, keep = _causal_masks(*scores.shape[-2:], scores.dtype)
    ones = np.ones(t_k, dtype=scores.dtype)
    for s, t in _blocks(scores, whole=2, scratch=1):  # t: one block of scratch; s keeps the scores until the end
        own = np.diagonal(s, offset=t_k - s.shape[-2], axis1=-2, axis2=-1)[..., None]  # query i's own key
        sums = _shifted_exp(s, t, own, scale, bias, keep, ones)
        far = ~(sums <= _FAR_ABOVE)                    # (NaN too)
        if far.any():                                  # those rows again, each from its own max
            masked = (s + bias).reshape(-1, t_k)[far]  # -inf where masked
            redone = np.exp(scale * (masked - np.fmax.reduce(masked, axis=-1, keepdims=True)))
            t.reshape(-1, t_k)[far] = redone
            sums[far] = redone @ ones
        np.multiply(t, 1.0 / sums.reshape(*t.shape[:-1], 1), out=s)
    return scores


_FAR_ABOVE = 2.0 ** 16  # a row's sum of exp(scale (s - own)) above this: a score over 11 - ln(T_k) above the diagonal


def _shifted_exp(s, t, own, scale, bias, keep, ones):
    """t = exp(scale * (s - own)) where the causal mask keeps an entry, 0 where it does not;
    returns the row sums. float64 exp slows down on -inf, so there the masked entries are
    zeroed before exp (exp(0) = 1) and after it, by multiplies with `keep`."""
    if t.dtype == np.float64:
        np.subtract(s, own, out=t)
        t *= keep
    else:
        np.add(s, bias, out=t)                         # -inf where masked
        t -= own
    if scale != 1.0:
        t *= scale
    with np.errstate(over="ignore"):                 # a score far above its diagonal: inf, and the row is redone
        np.exp(t, out=t)
    if t.dtype == np.float64:
        t *= keep                                      # the masked weights: exactly 0
    return t.reshape(-1, t.shape[-1]) @ ones


# ----------------------------------------------------------------------------- cross-entropy


class CrossEntropy(fused.CrossEntropy):
    """The plain formulas, with the probabilities computed in place and overwritten by backward."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        flat = logits.reshape(-1, logits.shape[-1])
        ids = targets.reshape(-1)
        counted = ids != ignore_index
        safe_ids = np.where(counted, ids, 0)
        rows = np.arange(flat.shape[0])
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


# ----------------------------------------------------------------------------- AdamW


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """optim.adamw_update's equations with every intermediate term in one scratch array `s`
    instead of a fresh temporary per operation, the bias corrections folded into scalars."""
    ### BEGIN REFERENCE assignment=adamw_update stub=from minidist.core.optim import plain_adamw_update; return plain_adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay)
    beta1, beta2 = betas
    s = np.empty_like(param)
    if weight_decay:
        param *= 1.0 - lr * weight_decay    # p -= lr * wd * p
    exp_avg *= beta1
    np.multiply(grad, 1.0 - beta1, out=s)
    exp_avg += s                          # m = b1 m + (1 - b1) g
    exp_avg_sq *= beta2
    np.multiply(grad, grad, out=s)
    s *= 1.0 - beta2
    exp_avg_sq += s                       # v = b2 v + (1 - b2) g^2
    np.sqrt(exp_avg_sq, out=s)
    s *= 1.0 / math.sqrt(1.0 - beta2**step)
    s += eps                              # sqrt(v / (1 - b2^t)) + eps
    np.divide(exp_avg, s, out=s)
    s *= lr / (1.0 - beta1**step)
    param -= s                            # p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)
    ### END REFERENCE


# ----------------------------------------------------------------------------- the fast path

# On the fast path (minidist.core.kernels), each operation of fused.py runs as its namesake here.
for _plain in (fused.Linear, fused.Embedding, fused.LayerNorm, fused.GELU, fused.Softmax, fused.LogSoftmax,
               fused.ScaledDotProductAttention, fused.Dropout, fused.CrossEntropy):
    register_fast(_plain, globals()[_plain.__name__])
