"""Dynamic loss scaling (动态损失缩放): keeping fp16 gradients out of the underflow zone.

Chapter 10 (mixed precision). One idea: multiply the loss by a scale S before backward, divide
the gradients by S after, and let S find its own level by backing off on overflow and growing
after a run of clean steps. `DynamicLossScaler` follows `torch.amp.GradScaler` exactly: the same
fp32 scale, the same fp32 reciprocal, the same update rule (tests/test_loss_scale.py drives both
with the same overflow pattern and compares every scale bit for bit).

Why scale at all. fp16 has a 5-bit exponent: its largest value is 65504, its smallest normal
2^-14 (about 6.1e-5) and its smallest subnormal 2^-24 (about 6.0e-8). A gradient below 2^-24
has no fp16 to go to: under half of it, it rounds to zero (it "flushes to zero"), and between
2^-24 and 2^-14 it keeps only the few bits a subnormal has.
Gradients of a deep network are often that small, so training in fp16 silently loses them.
Backward is linear in the loss, so multiplying the loss by S multiplies every gradient by S:
with S = 2^k every gradient moves up by k binades (powers of two), out of the underflow zone,
with its mantissa untouched (a power of two scales exactly).

The training step with a scaler:

    loss = model(x)
    scaler.scale_loss(loss).backward()          # gradients are S times too large
    found_inf = scaler.unscale_(grads)          # g *= fp32(1/S), and look for inf/NaN
    found_inf = allreduce(found_inf, MAX)       # every rank must decide alike
    clip_grad_norm(...)                         # clipping sees the true gradients
    if not scaler.should_skip(found_inf):
        optimizer.step()                        # an inf/NaN step would ruin the weights
    scaler.update(found_inf)                    # back off or grow S

Unscale before clipping: a clip threshold is chosen for the true gradient norm, and a norm of
S times the truth would clip almost every step. Skip on overflow: if S was too large, some
gradient overflowed to inf (or an inf became NaN); those numbers carry no information, so the
step is dropped, S is halved (`backoff_factor`) and the growth count restarts. Grow after
`growth_interval` clean steps in a row, S is doubled (`growth_factor`): it probes for the
largest S that does not overflow, since larger S keeps more small gradients. The scale lives in
fp32 (like torch's float32 tensor) and stops growing at the largest finite fp32 value.

Why bf16 needs none. bf16 keeps fp32's 8-bit exponent (smallest normal 2^-126, largest about
3.4e38) and gives up mantissa bits instead (8 significant bits against fp32's 24). Its range
is fp32's range, so gradients do not underflow or overflow any more than in fp32; bf16 training
runs without a scaler (`enabled=False`: the loss and the gradients are left as they are and
no step is skipped).

The learning rate on a skipped step. In minidist the learning rate is a function of the step
index, `optim.lr_at(step)`, so a skipped step still advances the schedule: the next step uses
the next learning rate, exactly as in PyTorch when `scheduler.step()` is called every iteration
whether or not `GradScaler.step` ran the optimizer (PyTorch warns "Detected call of
`lr_scheduler.step()` before `optimizer.step()`" when the very first optimizer step was skipped,
because the optimizer never ran). Megatron-LM does the opposite. In
`megatron/training/training.py`, `train_step` gets `update_successful` from `optimizer.step()`
(`MixedPrecisionOptimizer.step` in `megatron/core/optimizer/optimizer.py` returns `False, None,
None` when the all-reduced `found_inf` is set, after the scaler's `update`) and then runs
`opt_param_scheduler.step(increment=get_num_microbatches() * micro_batch_size *
data_parallel_size)` only `if update_successful`, else it sets `skipped_iter = 1`; the outer
loop still does `iteration += 1` and `consumed_train_samples += batch_size`. So in Megatron a
skipped iteration uses up its batch and its iteration number but not the learning-rate (and
weight-decay) schedule, which counts the samples of successful updates; after k skips the
schedule lags the iteration by k global batches. minidist keeps the schedule a pure function of
the step so that every rank and every resumed run computes it from the step number alone; once S
has settled, skips are rare (about one per `growth_interval` steps, as each growth probes one
binade higher), so the two choices differ by one step of schedule per skip, small against
the length of a run. (Megatron's
`DynamicGradScaler` also differs from torch's rule: it backs off only once `hysteresis`
overflows, 2 by default, have been seen since the last growth, and never below `min_scale`;
minidist follows torch.)

The caller combines `found_inf` over all ranks with MAX before `update`, so every rank skips the
same steps and holds the same scale: replicas stay identical, as chapter 3 requires.
"""
from __future__ import annotations

import numpy as np

# ----------------------------------------------------------------------------- helpers


def non_finite(arrays) -> bool:
    """True if any element of any array is inf or NaN (None entries are skipped)."""
    return any(not np.isfinite(a).all() for a in arrays if a is not None)


def _is_float(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 and float8 types have kind "V" but "float" in their names
    return dtype.kind == "f" or "float" in dtype.name


def _unscale_in_place(g: np.ndarray, inv_scale: np.float32) -> None:
    """g *= inv_scale, rounded as torch's `_amp_foreach_non_finite_check_and_unscale_` does."""
    with np.errstate(over="ignore"):  # an overflow here is reported by found_inf, not warned
        if g.dtype == np.float64:
            g *= np.float64(inv_scale)  # a float64 gradient times the fp32 reciprocal, in float64
        elif g.dtype == np.float32:
            np.multiply(g, inv_scale, out=g)
        else:  # float16, bfloat16, fp8: multiply in float32 and round once on the way back
            g[...] = (g.astype(np.float32) * inv_scale).astype(g.dtype)


def _fp32(x: float) -> float:
    """x rounded to the nearest float32, as a Python float (overflow gives inf, silently)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


# ----------------------------------------------------------------------------- the scaler


class DynamicLossScaler:
    """Loss scaling with torch.amp.GradScaler's rule; the arrays are NumPy, the scale is fp32.

    `scale` (a Python float holding an fp32 value) and `growth_tracker` (consecutive finite
    steps since the last growth or backoff) are plain attributes; `history` holds the
    `(step, scale, skipped)` tuples appended by `record`.
    """

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):
        if not (np.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1.0, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or int(growth_interval) != growth_interval \
                or growth_interval < 1:
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval}")
        self.enabled = bool(enabled)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        # torch keeps the scale in a float32 tensor; disabled, get_scale() reports 1.0
        self.scale = _fp32(init_scale) if self.enabled else 1.0
        self.growth_tracker = 0
        self.history: list[tuple[int, float, bool]] = []
        self._unscaled = False  # unscale_ ran since the last update()

    # -- the training step -------------------------------------------------------------------

    def scale_loss(self, loss):
        """loss * scale (a minidist Tensor, a NumPy value or a float); the loss itself if disabled."""
        if not self.enabled:
            return loss
        return loss * self.scale

    @property
    def inv_scale(self) -> np.float32:
        """fp32(1/scale): the reciprocal taken in float64 and rounded once, as torch does."""
        with np.errstate(divide="ignore"):  # a scale backed off to 0 gives inf, as in torch
            return np.float32(1.0 / np.float64(self.scale))

    def unscale_(self, grads: list) -> bool:
        """Divide every gradient by the scale in place; return True if any is inf or NaN.

        `grads` holds NumPy arrays of any float dtype (None entries are skipped). A non-finite
        value before unscaling counts, and so does one created by it (possible only when the
        scale is below 1 and a large fp16 value overflows); torch checks only before. torch
        refuses fp16 gradients here (it expects fp32 master gradients); minidist accepts them
        and multiplies in fp32. Disabled, the gradients are left alone and the flag still
        reports what they hold.
        """
        grads = [g for g in grads if g is not None]
        for i, g in enumerate(grads):  # fail before touching any gradient
            if not isinstance(g, np.ndarray) or not _is_float(g.dtype):
                kind = g.dtype if isinstance(g, np.ndarray) else type(g).__name__
                raise TypeError(f"unscale_ needs NumPy float arrays, grads[{i}] is {kind}")
        if not self.enabled:
            return non_finite(grads)
        if self._unscaled:
            raise RuntimeError("unscale_() has already been called on these gradients since "
                               "the last update()")
        inv_scale = self.inv_scale
        found_inf = False
        for g in grads:
            found_inf = found_inf or non_finite([g])
            _unscale_in_place(g, inv_scale)
            # multiplying by inv_scale <= 1 cannot overflow, so look again only when it is > 1
            if not found_inf and inv_scale > 1.0:
                found_inf = non_finite([g])
        self._unscaled = True
        return found_inf

    def should_skip(self, found_inf) -> bool:
        """The optimizer step is skipped iff a gradient was inf/NaN (never when disabled)."""
        return self.enabled and bool(found_inf)

    def update(self, found_inf) -> None:
        """torch's `_amp_update_scale_`: back off on overflow, grow after growth_interval clean steps.

        `found_inf` must already be combined over all ranks (MAX), so every rank updates alike.
        Products are taken in float64 and rounded to fp32, as the kernel multiplies a float
        scale by a double factor and stores a float.
        """
        self._unscaled = False
        if not self.enabled:
            return
        ### BEGIN SOLUTION assignment=loss_scaler_update
        if bool(found_inf):
            self.scale = _fp32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        successful = self.growth_tracker + 1
        if successful == self.growth_interval:
            grown = _fp32(self.scale * self.growth_factor)
            if np.isfinite(grown):  # do not grow past the largest fp32 value to inf
                self.scale = grown
            self.growth_tracker = 0
        else:
            self.growth_tracker = successful
        ### END SOLUTION

    def record(self, step: int, skipped: bool) -> None:
        """Append (step, scale now, skipped) to `history`: call it after update()."""
        self.history.append((int(step), self.scale, bool(skipped)))

    # -- checkpoints -------------------------------------------------------------------------

    _KEYS = ("scale", "growth_tracker", "growth_factor", "backoff_factor", "growth_interval",
             "enabled")

    def state_dict(self) -> dict:
        """The scale, the tracker and the settings, as flat NumPy arrays (for a checkpoint file)."""
        return {
            "scale": np.array(self.scale, dtype=np.float32),
            "growth_tracker": np.array(self.growth_tracker, dtype=np.int64),
            "growth_factor": np.array(self.growth_factor, dtype=np.float64),
            "backoff_factor": np.array(self.backoff_factor, dtype=np.float64),
            "growth_interval": np.array(self.growth_interval, dtype=np.int64),
            "enabled": np.array(self.enabled),
        }

    def load_state_dict(self, state) -> None:
        """Restore what state_dict() returned; a disabled scaler ignores it, as torch's does."""
        missing = [k for k in self._KEYS if k not in state]
        if missing:
            raise ValueError(f"loss-scaler state lacks {missing}; it has {sorted(state)}")
        if not self.enabled:
            return
        if not bool(state["enabled"]):
            raise ValueError("loss-scaler state was saved from a disabled scaler "
                             f"(scale {float(state['scale'])}); it cannot restore an enabled one")
        self.scale = _fp32(float(state["scale"]))
        self.growth_tracker = int(state["growth_tracker"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._unscaled = False

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale}, growth_tracker={self.growth_tracker}, "
                f"growth_interval={self.growth_interval}, enabled={self.enabled})")
