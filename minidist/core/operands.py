"""How an operation takes its operands, shared by `functional.py` and `shape_ops.py`.

Chapter 1. Python numbers stay Python floats (a NumPy float64 scalar would upcast a float32
array under NumPy 2's rules), arrays become constant tensors, two float tensors of different
dtypes may not meet, and a gradient is summed back over the axes that broadcasting added.
"""
from __future__ import annotations

import numpy as np

from minidist.core.tensor import Tensor, as_array, autocast_active


def unbroadcast(grad: np.ndarray, shape: tuple) -> np.ndarray:
    """Sum a gradient back down to `shape`, undoing NumPy broadcasting in the forward."""
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(i + extra for i, n in enumerate(shape) if n == 1 and grad.shape[i + extra] != 1)
    grad = grad.sum(axis=axes, keepdims=True) if axes else grad
    return grad.reshape(shape)


def operand(x):
    """A Tensor stays a Tensor; a Python number stays a Python float; arrays become constants."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (bool, int, float, np.integer, np.floating)):
        return float(x)
    return Tensor(as_array(x))


def check_dtypes(name, a, b):
    if autocast_active():  # chapter 10: the precision policy decides instead
        return
    da, db = getattr(a, "dtype", None), getattr(b, "dtype", None)
    if da is not None and db is not None and da != db and da.kind == "f" and db.kind == "f":
        raise TypeError(f"{name}: tensors of dtypes {da} and {db}; cast one explicitly (dtypes never change silently)")
