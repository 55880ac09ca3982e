"""Check a backward against finite differences: the test every operation in minidist passes.

Chapter 1. For inputs x and a function f, the analytic gradient from `backward()` must match
(f(x + eps e_i) - f(x - eps e_i)) / (2 eps) for every element i. A non-scalar output is first
reduced to a scalar with fixed random weights, so every output element takes part.
Use float64: in float32 the finite difference itself is too noisy to check anything.
"""
from __future__ import annotations

import numpy as np

from minidist.core.tensor import Tensor, no_grad


def numerical_grad(fn, inputs, index, eps=1e-6, weights=None):
    """dL/d(inputs[index]) by central differences, L = sum(fn(*inputs) * weights)."""
    x = inputs[index].data
    grad = np.zeros_like(x)
    with no_grad():
        for i in np.ndindex(x.shape):
            old = x[i]
            x[i] = old + eps
            plus = _scalar(fn(*inputs), weights)
            x[i] = old - eps
            minus = _scalar(fn(*inputs), weights)
            x[i] = old
            grad[i] = (plus - minus) / (2 * eps)
    return grad


def _scalar(out, weights):
    data = out.data if isinstance(out, Tensor) else out
    return float(np.sum(data * weights)) if weights is not None else float(np.sum(data))


def gradcheck(fn, *inputs, eps=1e-6, atol=1e-6, rtol=1e-5, seed=0) -> bool:
    """Compare backward() with finite differences for every input that requires grad.

    Returns True, or raises AssertionError naming the input and the worst element.
    """
    for t in inputs:
        if isinstance(t, Tensor) and t.requires_grad and t.dtype != np.float64:
            raise TypeError(f"gradcheck needs float64 inputs, got {t.dtype}")
    out = fn(*inputs)
    weights = None
    if out.size != 1:
        weights = np.random.default_rng(seed).standard_normal(out.shape)
    for t in inputs:
        if isinstance(t, Tensor):
            t.grad = None
    loss = out.sum() if weights is None else (out * Tensor(weights)).sum()
    loss.backward()
    for index, t in enumerate(inputs):
        if not (isinstance(t, Tensor) and t.requires_grad):
            continue
        analytic = t.grad if t.grad is not None else np.zeros_like(t.data)
        numeric = numerical_grad(fn, list(inputs), index, eps, weights)
        if not np.allclose(analytic, numeric, atol=atol, rtol=rtol):
            worst = np.unravel_index(np.argmax(np.abs(analytic - numeric)), analytic.shape)
            raise AssertionError(
                f"gradcheck failed for input {index} (shape {t.shape}): at {worst} backward gives "
                f"{analytic[worst]:.8g}, finite differences {numeric[worst]:.8g}"
            )
    return True
