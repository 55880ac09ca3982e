"""Differentiable operations, each a `Function` with its forward and backward side by side.

Chapter 1. Read any class here to see the chain rule for one operation: `forward` computes with
NumPy and saves what the gradient will need; `backward` receives dL/d(output) and returns
dL/d(input) for each input. The operations that only move elements are in `minidist/core/shape_ops.py`,
and the neural-network operations that a transformer spends its time in
(linear, layer_norm, gelu, softmax, attention, cross_entropy) live in `minidist/core/fused.py`, each
written as one fused operation with a hand-derived backward, because that is how fast libraries
do it and because the derivation is worth reading. Both are imported here, so that
`minidist.core.functional` is the one place to find every operation, as in torch.nn.functional; and
the end of this file gives `Tensor` its operators (`a + b` is `add(a, b)`).

Conventions: Python numbers stay Python floats, so they never change a tensor's dtype (a NumPy
float64 scalar would upcast a float32 array under NumPy 2's rules); two float tensors of
different dtypes may not meet in one operation — cast one explicitly with `cast`.
"""
from __future__ import annotations

import builtins

import numpy as np

from minidist.core import fused_fast  # noqa: F401  (registers the fast kernels with minidist.core.kernels)
from minidist.core.fused import (  # noqa: F401  (re-exported: see the docstring)
    cross_entropy,
    dropout,
    embedding,
    gelu,
    layer_norm,
    linear,
    log_softmax,
    scaled_dot_product_attention,
    softmax,
)
from minidist.core.operands import check_dtypes, operand, unbroadcast
from minidist.core.shape_ops import (  # noqa: F401  (re-exported: see the docstring)
    cat,
    chunk,
    concat,
    getitem,
    masked_fill,
    permute,
    reshape,
    split,
    transpose,
    where,
)
from minidist.core.tensor import Function, Tensor

# ----------------------------------------------------------------------------- arithmetic


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (np.shape(a), np.shape(b))
        return a + b

    @staticmethod
    def backward(ctx, g):
        return unbroadcast(g, ctx.shapes[0]), unbroadcast(g, ctx.shapes[1])


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = (np.shape(a), np.shape(b))
        return a - b

    @staticmethod
    def backward(ctx, g):
        return unbroadcast(g, ctx.shapes[0]), unbroadcast(-g, ctx.shapes[1])


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        ga = unbroadcast(g * b, np.shape(a)) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(g * a, np.shape(b)) if ctx.needs_input_grad[1] else None
        return ga, gb


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        ga = unbroadcast(g / b, np.shape(a)) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(-g * a / (b * b), np.shape(b)) if ctx.needs_input_grad[1] else None
        return ga, gb


def _binary(function, name):
    def op(a, b):
        a, b = operand(a), operand(b)
        check_dtypes(name, a, b)
        return function.apply(a, b)

    op.__name__ = name
    op.__doc__ = f"Elementwise {name} with NumPy broadcasting; the gradient is summed back over broadcast axes."
    return op


add, sub, mul, div = _binary(Add, "add"), _binary(Sub, "sub"), _binary(Mul, "mul"), _binary(Div, "div")


class Neg(Function):
    @staticmethod
    def forward(ctx, x):
        return -x

    @staticmethod
    def backward(ctx, g):
        return (-g,)


class Pow(Function):
    @staticmethod
    def forward(ctx, x, p):
        ctx.save_for_backward(x)
        ctx.p = p
        return _power(x, p)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved
        if ctx.p == 0:  # x**0 is constant: its gradient is 0, even at x = 0 (not 0 * 0**-1 = nan)
            return np.zeros_like(g), None
        return g * (ctx.p * _power(x, ctx.p - 1)), None


def _power(x, p):
    # small integer powers as products: NumPy's general power is far slower than x*x*x
    if p == 0:
        return np.ones_like(x)
    if p == 1:
        return x
    if p == 2:
        return x * x
    if p == 3:
        return x * x * x
    return np.power(x, x.dtype.type(p))


def neg(x):
    return Neg.apply(x)


def pow(x, exponent):  # noqa: A001  (mirrors torch.pow)
    """x ** exponent for a Python-number exponent."""
    if isinstance(exponent, Tensor) or np.ndim(exponent) != 0:
        raise TypeError("pow: only a scalar exponent is supported")
    return Pow.apply(x, float(exponent))


class Cast(Function):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return x.astype(dtype)

    @staticmethod
    def backward(ctx, g):
        return g.astype(ctx.dtype), None


def cast(x, dtype):
    """Change a tensor's dtype explicitly (the gradient is cast back)."""
    return Cast.apply(x, np.dtype(dtype))


# ----------------------------------------------------------------------------- unary math


class Exp(Function):
    @staticmethod
    def forward(ctx, x):
        y = np.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return (g * ctx.saved[0],)


class Log(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return np.log(x)

    @staticmethod
    def backward(ctx, g):
        return (g / ctx.saved[0],)


class Sqrt(Function):
    @staticmethod
    def forward(ctx, x):
        y = np.sqrt(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return (g * 0.5 / ctx.saved[0],)


class Tanh(Function):
    @staticmethod
    def forward(ctx, x):
        y = np.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved
        return (g * (1.0 - y * y),)


class Relu(Function):
    @staticmethod
    def forward(ctx, x):
        y = np.maximum(x, 0.0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return (g * (ctx.saved[0] > 0),)


def exp(x): return Exp.apply(x)
def log(x): return Log.apply(x)
def sqrt(x): return Sqrt.apply(x)
def tanh(x): return Tanh.apply(x)
def relu(x): return Relu.apply(x)


# ----------------------------------------------------------------------------- matmul


class MatMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
            raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align (need (..., n, k) @ (..., k, m))")
        ctx.save_for_backward(a, b)
        if b.ndim == 2:  # (..., n, k) @ (k, m): one big GEMM instead of a loop over the batch
            return (a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[-1])
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = unbroadcast(g @ np.swapaxes(b, -1, -2), a.shape)
        if ctx.needs_input_grad[1]:
            if b.ndim == 2:
                gb = a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])
            else:
                gb = unbroadcast(np.swapaxes(a, -1, -2) @ g, b.shape)
        return ga, gb


def matmul(a, b):
    """Batched matrix product `a @ b` over the last two axes, batch axes broadcast."""
    a, b = operand(a), operand(b)
    check_dtypes("matmul", a, b)
    return MatMul.apply(a, b)


# ----------------------------------------------------------------------------- reductions


def _normalize_axis(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % ndim for a in axes)


def _expand_back(g, axes, keepdims):
    """Give a reduced gradient back the reduced axes (as size 1) so it broadcasts to the input."""
    return g if keepdims else np.expand_dims(g, axes)


class Sum(Function):
    @staticmethod
    def forward(ctx, x, axis, keepdims):
        ctx.shape, ctx.axes, ctx.keepdims = x.shape, _normalize_axis(axis, x.ndim), keepdims
        return np.sum(x, axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, g):
        return np.broadcast_to(_expand_back(g, ctx.axes, ctx.keepdims), ctx.shape), None, None


class Max(Function):
    @staticmethod
    def forward(ctx, x, axis, keepdims):
        ctx.axes, ctx.keepdims = _normalize_axis(axis, x.ndim), keepdims
        out = np.max(x, axis=ctx.axes, keepdims=True)
        ctx.save_for_backward(x, out)
        return out if keepdims else np.squeeze(out, ctx.axes)

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved
        winners = x == out  # ties share the gradient equally
        share = winners / winners.sum(axis=ctx.axes, keepdims=True)
        return (share * _expand_back(g, ctx.axes, ctx.keepdims)).astype(x.dtype), None, None


def sum(x, axis=None, keepdims=False):  # noqa: A001
    return Sum.apply(x, axis, keepdims)


def mean(x, axis=None, keepdims=False):
    count = int(np.prod([x.shape[a] for a in _normalize_axis(axis, x.ndim)]))
    return Sum.apply(x, axis, keepdims) * (1.0 / builtins.max(count, 1))


def max(x, axis=None, keepdims=False):  # noqa: A001
    return Max.apply(x, axis, keepdims)


# ----------------------------------------------------------------------------- Tensor's operators

# `a + b`, `a @ w`, `x.sum()`, `x.T`: Python's operators and methods on a Tensor run the
# operations of this file. The engine (tensor.py) comes before the operations (each is one of
# its `Function`s), so it cannot import them; they are attached to the class here instead, the
# way JAX gives its arrays their methods (`jax/_src/numpy/array_methods.py`). `import minidist`
# loads this file, so every Tensor has them.


class _TensorMethods:
    """The methods this file gives `Tensor`: each defined here, then set on the class below."""

    def __add__(self, other): return add(self, other)
    def __radd__(self, other): return add(other, self)
    def __sub__(self, other): return sub(self, other)
    def __rsub__(self, other): return sub(other, self)
    def __mul__(self, other): return mul(self, other)
    def __rmul__(self, other): return mul(other, self)
    def __truediv__(self, other): return div(self, other)
    def __rtruediv__(self, other): return div(other, self)
    def __neg__(self): return neg(self)
    def __pow__(self, exponent): return pow(self, exponent)
    def __matmul__(self, other): return matmul(self, other)
    def __rmatmul__(self, other): return matmul(other, self)
    def __getitem__(self, index): return getitem(self, index)

    def sum(self, axis=None, keepdims=False): return sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return mean(self, axis, keepdims)
    def max(self, axis=None, keepdims=False): return max(self, axis, keepdims)
    def exp(self): return exp(self)
    def log(self): return log(self)
    def sqrt(self): return sqrt(self)
    def tanh(self): return tanh(self)
    def reshape(self, *shape): return reshape(self, shape[0] if len(shape) == 1 else shape)
    def transpose(self, axis1=-2, axis2=-1): return transpose(self, axis1, axis2)
    def permute(self, *axes): return permute(self, axes[0] if len(axes) == 1 else axes)
    def astype(self, dtype) -> Tensor: return cast(self, dtype)

    @property
    def T(self):
        return permute(self, tuple(reversed(range(self.ndim))))


for _name, _method in list(vars(_TensorMethods).items()):
    if callable(_method) or isinstance(_method, property):  # not __module__, __doc__, ...
        setattr(Tensor, _name, _method)
