"""Operations that move elements without changing them: reshape, permute, index, join, split,
select.

Chapter 1. Their backward passes send each gradient element back to where its value came
from: a reshape reshapes the gradient back, a permutation applies the inverse permutation, an
index scatters into zeros (adding, where an integer index picks an element twice), a split
concatenates. Re-exported by `minidist.core.functional`, where every operation can be found.
"""
from __future__ import annotations

import builtins

import numpy as np

from minidist.core.operands import check_dtypes, operand, unbroadcast
from minidist.core.tensor import Function, Tensor

# ----------------------------------------------------------------------------- shapes


class Reshape(Function):
    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape), None


class Permute(Function):
    @staticmethod
    def forward(ctx, x, axes):
        ctx.axes = axes
        return np.transpose(x, axes)

    @staticmethod
    def backward(ctx, g):
        return np.transpose(g, np.argsort(ctx.axes)), None


def reshape(x, shape):
    return Reshape.apply(x, tuple(shape) if not isinstance(shape, int) else (shape,))


def permute(x, axes):
    return Permute.apply(x, tuple(a % x.ndim for a in axes))


def transpose(x, axis1=-2, axis2=-1):
    axes = list(range(x.ndim))
    axes[axis1], axes[axis2] = axes[axis2], axes[axis1]
    return Permute.apply(x, tuple(axes))


def _is_basic_index(index) -> bool:
    """Slices, ints, None and Ellipsis select each element at most once (a view in NumPy)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (int, np.integer, slice)) or i is None or i is Ellipsis for i in items)


class GetItem(Function):
    @staticmethod
    def forward(ctx, x, index):
        ctx.shape, ctx.dtype, ctx.index = x.shape, x.dtype, index
        return x[index]

    @staticmethod
    def backward(ctx, g):
        grad = np.zeros(ctx.shape, dtype=ctx.dtype)
        if _is_basic_index(ctx.index):
            grad[ctx.index] = g
        else:  # integer-array indexing may pick an element twice: add, don't overwrite
            np.add.at(grad, ctx.index, g)
        return grad, None


def getitem(x, index):
    """`x[index]` for slices, integers and integer/boolean arrays; gradients flow to the picks."""
    if isinstance(index, Tensor):
        index = index.data
    elif isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return GetItem.apply(x, index)


class Concat(Function):
    @staticmethod
    def forward(ctx, axis, *arrays):
        ctx.axis = axis
        ctx.bounds = np.cumsum([a.shape[axis] for a in arrays])[:-1]
        return np.concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, g):
        return (None, *np.split(g, ctx.bounds, axis=ctx.axis))


def concat(tensors, axis=0):
    """Join tensors along an existing axis (torch.cat)."""
    tensors = [operand(t) for t in tensors]
    for t in tensors[1:]:
        check_dtypes("concat", tensors[0], t)
    return Concat.apply(axis, *tensors)


cat = concat


def split(x, sizes, axis=0):
    """Split into pieces of the given sizes (a list) or into pieces of one size (an int)."""
    length = x.shape[axis]
    if isinstance(sizes, int):
        sizes = [sizes] * (length // sizes) + ([length % sizes] if length % sizes else [])
    if builtins.sum(sizes) != length:
        raise ValueError(f"split: sizes {list(sizes)} do not add up to {length} along axis {axis}")
    pieces, start = [], 0
    for size in sizes:
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + size)
        pieces.append(getitem(x, tuple(index)))
        start += size
    return pieces


def chunk(x, chunks, axis=0):
    """Split into `chunks` nearly equal pieces (the first ones one longer, like np.array_split)."""
    length = x.shape[axis]
    return split(x, [length // chunks + (1 if i < length % chunks else 0) for i in range(chunks)], axis)


# ----------------------------------------------------------------------------- selection


class Where(Function):
    @staticmethod
    def forward(ctx, condition, a, b):
        ctx.condition, ctx.shapes = condition, (np.shape(a), np.shape(b))
        return np.where(condition, a, b)

    @staticmethod
    def backward(ctx, g):
        zero = g.dtype.type(0)
        ga = unbroadcast(np.where(ctx.condition, g, zero), ctx.shapes[0])
        gb = unbroadcast(np.where(ctx.condition, zero, g), ctx.shapes[1])
        return None, ga, gb


def where(condition, a, b):
    """Pick from `a` where `condition` holds, else from `b` (broadcasting all three)."""
    condition = condition.data if isinstance(condition, Tensor) else np.asarray(condition, dtype=bool)
    a, b = operand(a), operand(b)
    check_dtypes("where", a, b)
    return Where.apply(condition, a, b)


def masked_fill(x, mask, value):
    """Put `value` where `mask` is True (no gradient flows there), keep `x` elsewhere."""
    return where(mask, float(value), x)
