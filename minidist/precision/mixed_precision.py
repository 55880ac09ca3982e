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

`Precision` holds all of it for a trainer — the format, the masters, the scaler, the end of the
step — so that every layout runs the same code in every precision (in fp32 the same calls do
nothing: no masters, no scaling, no skip).
"""
from __future__ import annotations

import math

import numpy as np

from minidist import timeline
from minidist.precision.loss_scale import DynamicLossScaler
from minidist.core.optim import AdamW, clip_grad_norm_, set_lr
from minidist.precision import LOW_PRECISION, autocast, round_to

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


class Precision:
    """Chapter 10 as one object each trainer holds: the number format of its weights, their fp32
    masters, the loss scaler, and the end of a step that depends on them.

        amp = Precision("fp16", settings)          # settings: train.OptimSettings (lr, clip, scaler's)
        masters = amp.cast(module)                  # 16-bit weights; their fp32 masters (fp32: None)
        optimizer = make_optimizer(module, settings, masters)
        with amp.autocast():                        # the forward in the format (fp32: unchanged)
            logits, loss = module(x, y)
        amp.scale(loss).backward()                  # x the loss scale (fp16 only)
        amp.step(optimizer, step, agree=..., norm=...)   # unscale, skip together, clip, update
        amp.report()                                # the demo's --json keys (fp32: none)

    `agree(found_inf) -> bool` combines the overflow flag over every rank that holds a piece of the
    gradients (they must all skip, or none); `norm(grads) -> float` is the whole model's gradient
    norm from this rank's pieces (sharded strategies), by default these gradients' own."""

    def __init__(self, name: str = "fp32", settings=None):
        if name != "fp32" and name not in LOW_PRECISION:
            raise ValueError(f"precision must be fp32 or one of {', '.join(LOW_PRECISION)}, got {name!r}")
        self.name, self.settings = name, settings
        # dynamic for fp16; none for fp32 and bf16, whose 8-bit exponent reaches as low as fp32's
        self.scaler = DynamicLossScaler(init_scale=getattr(settings, "initial_loss_scale", 2.0**16),
                                        growth_interval=getattr(settings, "loss_scale_window", 2000),
                                        enabled=name == "fp16")

    @property
    def low(self) -> bool:
        """Are the weights kept in 16 bits (with fp32 masters)?"""
        return self.name != "fp32"

    def cast(self, module) -> dict[int, np.ndarray] | None:
        """Round `module`'s weights to the format; their fp32 masters by id(param), or None in fp32."""
        return to_low_precision(module, self.name) if self.low else None

    def autocast(self):
        return autocast(self.name)

    def scale(self, loss):
        """The loss to run backward from: times the loss scale in fp16, itself otherwise."""
        return self.scaler.scale_loss(loss)

    def step(self, optimizer, step: int, agree=None, norm=None) -> bool:
        """The end of the step for `optimizer`'s parameters; True if it was skipped (an overflow).
        fp32: clip by the norm, schedule, AdamW. 16 bits: `finish_step` (unscale, agree, skip or
        clip and update the masters). Every trainer's optimizer step passes here: a trace's span."""
        with timeline.span("optimizer", "optimizer"):
            if self.low:
                return finish_step(optimizer, self.scaler, self.settings, step, agree, norm)
            params = optimizer.params()
            if self.settings.clip:
                total = None if norm is None else norm([p.grad for p in params])
                clip_grad_norm_(params, self.settings.clip, total)
            set_lr(optimizer, self.settings.lr_at(step))
            optimizer.step()
            return False

    def report(self) -> dict:
        """The demo's --json keys of a run's precision: the format, and the loss scale's history."""
        if not self.low:
            return {}
        history = self.scaler.history
        return {"precision": self.name, "loss_scale": [{"step": s, "scale": scale, "skipped": skipped}
                                                       for s, scale, skipped in history],
                "skipped_steps": [s for s, _, skipped in history if skipped]}
