"""Low-precision numbers (chapter 10): the formats, and which operations run in them.

A floating-point format is a sign, e bits of exponent and m bits of mantissa. The exponent sets
the range, the mantissa the precision (machine epsilon 2^-m, the gap from 1 to the next number):

    format      bits  exponent  mantissa   epsilon     smallest normal   largest
    fp32         32       8        23      2^-23       2^-126 ~ 1.2e-38  ~ 3.4e38
    bf16         16       8         7      2^-7        2^-126 ~ 1.2e-38  ~ 3.4e38
    fp16         16       5        10      2^-10       2^-14  ~ 6.1e-5   65504
    fp8 e4m3      8       4         3      2^-3        2^-6              448
    fp8 e5m2      8       5         2      2^-2        2^-14             57344

(fp16's subnormals reach down to 2^-24 ~ 6e-8; below that a value flushes to zero.) bf16 keeps
fp32's exponent, so it has fp32's range with fewer digits; fp16 has more digits but a range of
only 2^-24 .. 65504, which is why fp16 training needs a loss scaler (`loss_scale.py`) and bf16
does not.

How minidist runs them. Values are stored in their real dtypes (`np.float16`; `bfloat16` and the
fp8 types from the `ml_dtypes` package, round-to-nearest-even). Each operation reads its inputs,
converts them to fp32 (exact), computes in fp32 and rounds its result to the output's format —
what a GPU kernel does when it loads fp16, computes in fp32 registers and stores fp16. For a
matrix product this is "fp16 multiply, fp32 accumulate": the product of two 11-bit significands
fits fp32's 24 exactly, and the sums are fp32's. (NumPy's own float16 matmul has no BLAS and
would take seconds; bf16 it does not have at all.)

Which operations run in the low format follows PyTorch autocast's lists, written once here
(`POLICY`, by the name of the autograd Function):

    low      matrix products: Linear, MatMul, ScaledDotProductAttention. Inputs are rounded to
             the low format; so is the output.
    fp32     numerically touchy ones: LayerNorm (its statistics), Softmax, LogSoftmax,
             CrossEntropy (the loss), Exp, Log, Pow, Sqrt, Sum (reductions). Output in fp32.
    promote  everything else (adds, GELU, dropout, reshapes, the embedding): output in the widest
             float format among the inputs (low + low -> low; low + fp32 -> fp32).
    pass     a Function that declares `autocast = "pass"` sees its arrays as they are: explicit
             casts, and the communication Functions of chapter 6 (messages carry the format).

`with autocast("fp16"):` turns the policy on (the model's forward runs inside it); backward
follows what forward recorded, in fp32, and each gradient is rounded to its tensor's format.
Outside `autocast` nothing changes: fp32 and the float64 exactness mode run as before.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from minidist.core import tensor


@dataclass(frozen=True)
class Format:
    name: str
    dtype: np.dtype
    exponent_bits: int
    mantissa_bits: int

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1 and the next representable number, 2^-m."""
        return 2.0 ** -self.mantissa_bits

    @property
    def max(self) -> float:
        return float(ml_dtypes.finfo(self.dtype).max)  # ml_dtypes' finfo knows NumPy's types too

    @property
    def smallest_normal(self) -> float:
        return float(ml_dtypes.finfo(self.dtype).smallest_normal)

    @property
    def smallest_subnormal(self) -> float:
        return float(ml_dtypes.finfo(self.dtype).smallest_subnormal)


FORMATS = {
    "fp32": Format("fp32", np.dtype(np.float32), 8, 23),
    "bf16": Format("bf16", np.dtype(ml_dtypes.bfloat16), 8, 7),
    "fp16": Format("fp16", np.dtype(np.float16), 5, 10),
    "fp8_e4m3": Format("fp8_e4m3", np.dtype(ml_dtypes.float8_e4m3fn), 4, 3),
    "fp8_e5m2": Format("fp8_e5m2", np.dtype(ml_dtypes.float8_e5m2), 5, 2),
}
LOW_PRECISION = ("bf16", "fp16")  # what a model can compute in (fp8: see the chapter's last section)

POLICY = {
    **dict.fromkeys(("Linear", "MatMul", "ScaledDotProductAttention"), "low"),
    **dict.fromkeys(("LayerNorm", "Softmax", "LogSoftmax", "CrossEntropy", "Exp", "Log", "Pow", "Sqrt", "Sum"),
                    "fp32"),
    "Cast": "pass",
}

_FP32 = np.dtype(np.float32)
_RANK = {np.dtype(np.float16): 0, np.dtype(ml_dtypes.bfloat16): 0, _FP32: 1, np.dtype(np.float64): 2}


def format_of(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown precision {name!r}; choose from {', '.join(FORMATS)}")
    return FORMATS[name]


def round_to(array: np.ndarray, name: str) -> np.ndarray:
    """The array's values rounded to format `name` (round to nearest even), stored in its dtype.
    fp16 and bf16 overflow to inf as IEEE says; the fp8 e4m3 format has no inf, and ml_dtypes
    would give NaN past 448, so it saturates instead (as fp8 recipes clip)."""
    fmt = format_of(name)
    if name == "fp8_e4m3":
        array = np.clip(array, -fmt.max, fmt.max)
    with np.errstate(over="ignore"):  # overflow to inf is the format's answer, not an accident
        return np.asarray(array).astype(fmt.dtype)


class Policy:
    """The table above, applied to one operation's input arrays (tensor.Function.apply calls it)."""

    def __init__(self, name: str):
        if name not in LOW_PRECISION:
            raise ValueError(f"autocast computes in {' or '.join(LOW_PRECISION)}, got {name!r}")
        self.format = FORMATS[name]
        self.low = self.format.dtype

    def prepare(self, function, arrays: list):
        """(arrays to compute with, dtype of the result) — or (arrays, None): leave it alone."""
        rule = getattr(function, "autocast", None) or POLICY.get(function.__name__, "promote")
        floats = [a.dtype for a in arrays if isinstance(a, np.ndarray) and a.dtype in _RANK]
        if rule == "pass" or not floats or np.dtype(np.float64) in floats:
            return arrays, None  # float64 is the exactness mode: never lowered
        if rule == "low":
            out = self.low
            arrays = [a.astype(self.low).astype(_FP32) if _is_float(a) else a for a in arrays]
            return arrays, out
        if rule == "fp32":
            out = _FP32
        else:
            widest = max(floats, key=lambda d: _RANK[d])
            out = widest if len(set(floats)) == 1 or _RANK[widest] > 0 else _FP32  # fp16 + bf16 -> fp32
        return [a.astype(_FP32) if _is_float(a) else a for a in arrays], out


def _is_float(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype in _RANK


@contextlib.contextmanager
def autocast(name: str | None):
    """Run the operations inside in low precision (`POLICY`); `autocast(None)` is a no-op."""
    if name is None or name == "fp32":
        yield
        return
    previous = tensor.set_autocast(Policy(name))
    try:
        yield
    finally:
        tensor.set_autocast(previous)
