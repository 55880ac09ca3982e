"""The Linear layers' matrix products timed inside a real training step, and the same ones alone.

Chapter 1. `bench step`'s floor times every GEMM of a step in a loop over a few arrays that stay
in the CPU's cache. Inside a step they do not: forward writes each output into memory that no
cache holds any more, and backward reads back activations that forward saved long before (the
step's activations are tens of MB, more than the cache). So the same products run slower inside
the step than in the loop, and no step can reach that floor. This measures by how much:

    seconds_inside, seconds_alone, by_shape = linear_gemms_in_step(step, steps=10)

`TimedLinear` is the fast path's Linear with a stopwatch around each of its three products (the
forward, and backward's to the input and to the weight); the same numbers, tests/test_kernels.py.
While measuring it stands in for the fast Linear (`kernels.register_fast`), then steps aside.
"""
from __future__ import annotations

import time

import numpy as np

from minidist.core import fused, fused_fast
from minidist.core.kernels import chosen, kernels, register_fast
from minidist.parallel.stage_balance import median_seconds

KINDS = ("forward", "to the input", "to the weight")  # y = x W^T,  dx = g W,  dW = g^T x


class TimedLinear(fused_fast.Linear):
    """fused_fast.Linear, each GEMM timed into `TimedLinear.log` as (kind, a's shape, b's shape,
    dtype, seconds), a and b as the floor writes them: x and W, g and W, g and x."""

    log: list = []

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        rows = x.reshape(-1, x.shape[-1])
        y = _timed("forward", rows, weight, lambda: rows @ weight.T)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @classmethod
    def backward(cls, ctx, g):
        x, weight = ctx.saved
        g2, rows = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gx = _timed("to the input", g2, weight, lambda: g2 @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = _timed("to the weight", g2, rows, lambda: g2.T @ rows) if ctx.needs_input_grad[1] else None
        gb = cls.bias_grad(g2) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _timed(kind, a, b, product):
    start = time.perf_counter()
    out = product()
    TimedLinear.log.append((kind, a.shape, b.shape, a.dtype.name, time.perf_counter() - start))
    return out


def _alone(kind, a_shape, b_shape, dtype, repeats):
    """Median seconds of one such GEMM in a loop over the same arrays: the floor's way."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(a_shape).astype(dtype), rng.standard_normal(b_shape).astype(dtype)
    product = {"forward": lambda: a @ b.T, "to the input": lambda: a @ b, "to the weight": lambda: a.T @ b}[kind]
    return median_seconds(product, repeats)


def linear_gemms_in_step(step, steps: int = 10, warmup: int = 2, repeats: int = 20):
    """Time the Linear GEMMs of `step()` (a training step on the fast path) inside `steps` real
    steps, then each shape alone. Returns (seconds per step inside, the same GEMMs alone, and
    {(kind, a's shape, b's shape, dtype): (calls per step, median inside, median alone)})."""
    inside: dict[tuple, list] = {}
    with kernels("fast"):
        previous = chosen(fused.Linear)  # fused_fast.Linear, unless someone stood in for it already
        register_fast(fused.Linear, TimedLinear)
        try:
            for _ in range(warmup):
                step()
            TimedLinear.log.clear()
            for _ in range(steps):
                step()
        finally:
            register_fast(fused.Linear, previous)
    for *key, seconds in TimedLinear.log:
        inside.setdefault(tuple(key), []).append(seconds)
    TimedLinear.log.clear()
    by_shape = {}
    for key, times in inside.items():
        by_shape[key] = (len(times) // steps, float(np.median(times)), _alone(*key, repeats))
    seconds_inside = sum(calls * t for calls, t, _ in by_shape.values())
    seconds_alone = sum(calls * t for calls, _, t in by_shape.values())
    return seconds_inside, seconds_alone, by_shape
