"""Mixed-precision training (混合精度训练, chapter 10): compute in 16 bits, update in 32.

The recipe of Micikevicius et al. (2018), as DeepSpeed and Megatron-LM run it:

    the model's weights    fp16 or bf16    2 bytes per parameter   what forward and backward read
    its gradients          fp16 or bf16    2 bytes                 what backward writes
    the optimizer's state  fp32            12 bytes                a master copy of every weight,
                                                                   and AdamW's two moments

2 + 2 + 12 = 16 bytes per parameter, the K = 12 of the ZeRO paper. Why a master copy: AdamW's
step is often far smaller than the weight it changes, and an fp16 number cannot move by less
than 2^-11 of itself (half its epsilon): added to the fp16 weight, such a step is lost. It is
kept, and accumulates, in the fp32 master; the model's weight is the master rounded.

One step (`finish_step`), after backward of the scaled loss (`loss_scale.py`):

    1. the gradients as fp32 copies, multiplied by the fp32 reciprocal of the scale — exact,
       the scale being a power of two;
    2. any inf or NaN (an fp16 overflow) anywhere: the step is skipped on every rank and the
       scale halves (the flag is agreed by the caller over every rank that holds a piece);
    3. clip by the global norm of the unscaled gradients, AdamW on the masters, and the masters
       rounded into the model.

The forward runs under `precision.autocast` (which operations compute in which format).
"""
from __future__ import annotations

import math

import numpy as np

from minidist.optim import AdamW, set_lr
from minidist.precision import LOW_PRECISION, round_to

_FP32 = np.dtype(np.float32)


def to_low_precision(model, precision: str) -> dict[int, np.ndarray]:
    """Round the model's weights to `precision` in place; return their fp32 values by id(param)
    (the masters, taken before rounding: the update continues from the exact initial weights)."""
    if precision not in LOW_PRECISION:
        raise ValueError(f"mixed precision computes in {' or '.join(LOW_PRECISION)}, got {precision!r}")
    masters = {id(p): p.data.astype(_FP32) for p in model.parameters()}
    for p in model.parameters():
        p.data = round_to(p.data, precision)
    return masters


class MixedPrecisionAdamW(AdamW):
    """AdamW whose state holds each parameter's fp32 master next to its moments (12 bytes per
    parameter in all), and which writes the updated master, rounded, into the low-precision
    parameter. `step(grads)` takes the fp32 gradients explicitly: the parameters' own `.grad`
    stay in the low format (and are not touched)."""

    def __init__(self, params, masters: dict[int, np.ndarray], **hyper):
        super().__init__(params, **hyper)
        for state, p in zip(self.state, self.params()):
            state["master"] = masters[id(p)]  # by id: the optimizer's groups reorder the parameters

    def step(self, grads: list) -> None:
        self.step_count += 1
        for index, (p, group) in enumerate((p, group) for group in self.param_groups for p in group["params"]):
            if grads[index] is not None:
                self.update(p.data, grads[index], self.state[index], group)

    def update(self, param, grad, state, group):
        master = state["master"]
        super().update(master, grad, state, group)  # the moments are fp32, shaped like the master
        param[...] = master  # rounded to the parameter's format by the assignment


def unscaled_grads(params, scaler) -> tuple[list, bool]:
    """(fp32 copies of the gradients times 1/scale, found_inf on this rank)."""
    grads = [None if p.grad is None else p.grad.astype(_FP32) for p in params]
    return grads, scaler.unscale_(grads)


def clip_arrays_(grads: list, max_norm: float, total_norm: float | None = None) -> float:
    """optim.clip_grad_norm_'s rule on plain arrays (the fp32 gradients); returns the norm."""
    if total_norm is None:
        total_norm = math.sqrt(sum(float(np.dot(g.ravel(), g.ravel())) for g in grads if g is not None))
    scale = max_norm / (total_norm + 1e-6)
    if scale < 1.0:
        for g in grads:
            if g is not None:
                g *= np.float32(scale)
    return total_norm


def finish_step(optimizer: MixedPrecisionAdamW, scaler, settings, step: int, agree=None, norm=None) -> bool:
    """Steps 1-3 above for the parameters of `optimizer`; returns True if the step was skipped.

    `agree(found_inf) -> bool`: the flag combined over every rank that holds a piece of the
    gradients (MAX), so that all skip together — a scaler whose ranks disagree would hang the
    job at the next collective. `norm(grads) -> float`: the whole model's gradient norm, for
    strategies whose gradients are sharded (default: these gradients are the whole model's)."""
    grads, found_inf = unscaled_grads(optimizer.params(), scaler)
    if agree is not None:
        found_inf = agree(found_inf)
    skipped = scaler.should_skip(found_inf)
    if not skipped:
        if settings.clip:
            clip_arrays_(grads, settings.clip, None if norm is None else norm(grads))
        set_lr(optimizer, settings.lr_at(step))
        optimizer.step(grads)
    scaler.update(found_inf)
    scaler.record(step, skipped)
    return skipped
