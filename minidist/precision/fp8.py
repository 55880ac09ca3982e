"""fp8 matrix products with delayed scaling (chapter 10, the last section).

An 8-bit float has too little range to hold a tensor as it is. e4m3 spans 2^-9 .. 448 and
e5m2 2^-16 .. 57344, while a weight sits near 0.02 and a gradient near 1e-4. So each tensor
is stored *scaled*: one fp32 number s per tensor (per-tensor scaling) moves its values into the
format's range, and the product undoes it:

    x_q = round_to(x * s_x, "fp8_e4m3")                    x_q * (1/s_x) ~ x
    y   = (x_q @ w_q^T) * (1 / (s_x * s_w)) + b            an fp8 GEMM, as the hardware does it

The product of two fp8 significands (at most 4 bits each, the hidden one counted) is exact
in fp32, the sums are fp32's, and the scales are applied once to the result. This equals
(x_q/s_x) @ (w_q/s_w)^T up to one fp32 rounding.

Which scale? The best one maps the tensor's largest magnitude (its amax) to the format's
largest value: s = fp8_max / amax. Finding amax needs a pass over the tensor before the cast.
*Delayed scaling* (NVIDIA Transformer Engine's `DelayedScaling` recipe) skips that pass: the
scale used now comes from the amaxes of the last `amax_history_len` uses, recorded as each
tensor went by. What we follow from Transformer Engine (its `DelayedScaling` docs and its
amax-and-scale update kernel):

    - every quantised tensor has a scale (starts at 1.0) and an amax history (starts at zeros);
    - a use quantises with the current scale, clipping what falls outside the range (the scale
      is a forecast: a tensor larger than its history saturates rather than overflows);
    - then records its own amax, and the scale becomes
          s = fp8_max * 2^-margin / amax,  amax = max of the history  ("max"),
                                            or its most recent entry  ("most_recent");
      a zero or non-finite amax keeps the previous scale;
    - fp8_format "HYBRID": e4m3 (more precision) for the forward's inputs and weights, e5m2
      (more range) for the backward's output gradients; "E4M3" uses e4m3 for all three.

Ours differs in one number: `amax_history_len` defaults to 16 (Transformer Engine's is 1024),
because our runs are a few dozen steps. As in Transformer Engine, the first step runs with
scale 1.0: the recipe learns each tensor's range from the uses it has seen.

Backward, with g the output gradient quantised to e5m2 with its own delayed scale s_g:

    dx = (g_q @ w_q) * (1 / (s_g * s_w))      dW = (g_q^T @ x_q) * (1 / (s_g * s_x))

fp32 formulas on the fp8 operands (what forward saved: 1 byte per value); db is the sum of the
unquantised g's rows, as Transformer Engine computes it. Each gradient is then rounded to its
tensor's format by the autograd engine.

`use_fp8_mlp(model)` puts this on the MLPs of minidist's GPT, two thirds of a block's weight
FLOPs (8 C^2 of 12 C^2 per token); attention and the head stay in bf16. `compare_fp8_bf16()`
trains the sort task both ways.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.core.nn import Module
from minidist.precision import FORMATS, round_to
from minidist.core.tensor import Function
from minidist.training.train import OptimSettings, SerialTrainer

_FP32 = np.float32


@dataclass(frozen=True)
class DelayedScaling:
    """The recipe: Transformer Engine's `DelayedScaling` arguments, with its names."""

    margin: float = 0.0              # scale to fp8_max * 2^-margin: headroom for growth
    fp8_format: str = "HYBRID"       # "HYBRID": e4m3 forward, e5m2 backward; "E4M3": e4m3 throughout
    amax_history_len: int = 16
    amax_compute_algo: str = "max"   # or "most_recent"

    def __post_init__(self):
        if self.fp8_format not in ("HYBRID", "E4M3"):
            raise ValueError(f"DelayedScaling: fp8_format must be 'HYBRID' or 'E4M3', got {self.fp8_format!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling: amax_compute_algo must be 'max' or 'most_recent', "
                             f"got {self.amax_compute_algo!r}")
        if not isinstance(self.amax_history_len, (int, np.integer)) or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling: amax_history_len must be an integer >= 1, "
                             f"got {self.amax_history_len!r}")
        if not self.margin >= 0:
            raise ValueError(f"DelayedScaling: margin must be >= 0, got {self.margin}")

    @property
    def forward_format(self) -> str:
        return "fp8_e4m3"

    @property
    def backward_format(self) -> str:
        return "fp8_e5m2" if self.fp8_format == "HYBRID" else "fp8_e4m3"


def quantize(x: np.ndarray, scale, name: str) -> np.ndarray:
    """x * scale rounded to fp8 format `name`, saturating at its largest value (no inf, no NaN)."""
    largest = FORMATS[name].max
    return round_to(np.clip(np.asarray(x, dtype=_FP32) * _FP32(scale), -largest, largest), name)


def amax(x: np.ndarray) -> float:
    return float(np.max(np.abs(x))) if x.size else 0.0


class TensorScaling:
    """The delayed scale of one tensor (Transformer Engine's per-tensor "fp8 meta"): the scale
    to quantise with now, and the amaxes of the last `amax_history_len` uses, newest first.
    `log` keeps (scale used, amax seen) for every use, for plotting."""

    def __init__(self, recipe: DelayedScaling, fmt: str):
        self.recipe, self.format = recipe, fmt
        self.scale = _FP32(1.0)
        self.amax_history = np.zeros(recipe.amax_history_len, dtype=_FP32)
        self.log: list[tuple[float, float]] = []

    def quantize(self, x: np.ndarray) -> tuple[np.ndarray, np.float32]:
        """(x quantised with the current scale, that scale); then the history and scale move on."""
        scale, seen = self.scale, amax(x)
        x_q = quantize(x, scale, self.format)
        self.log.append((float(scale), seen))
        self.record(seen)
        return x_q, scale

    def record(self, value: float) -> None:
        """Push this use's amax into the history and compute the scale for the next use."""
        self.amax_history = np.roll(self.amax_history, 1)
        self.amax_history[0] = value
        recent = self.amax_history.max() if self.recipe.amax_compute_algo == "max" else self.amax_history[0]
        if np.isfinite(recent) and recent > 0:  # an all-zero tensor says nothing about the range
            self.scale = _FP32(FORMATS[self.format].max * 2.0 ** -self.recipe.margin / recent)


@dataclass
class Fp8Meta:
    """The three delayed scales of one fp8 linear layer (Transformer Engine's `fp8_meta`)."""

    input: TensorScaling
    weight: TensorScaling
    grad_output: TensorScaling

    @classmethod
    def new(cls, recipe: DelayedScaling) -> "Fp8Meta":
        forward, backward = recipe.forward_format, recipe.backward_format
        return cls(TensorScaling(recipe, forward), TensorScaling(recipe, forward), TensorScaling(recipe, backward))


class Fp8LinearFunction(Function):
    """y = x W^T + b with x and W in fp8 (forward) and the output gradient in fp8 (backward).
    `meta` (an Fp8Meta) holds the scales; each use moves them on."""

    autocast = "low"  # under autocast: bf16 in, bf16 out, like the Linear it replaces

    @staticmethod
    def forward(ctx, x, weight, bias, meta):
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"fp8 linear: input has {x.shape[-1]} features (shape {x.shape}) "
                             f"but the weight expects {weight.shape[1]} (weight shape {weight.shape})")
        x2 = x.reshape(-1, x.shape[-1])
        x_q, s_x = meta.input.quantize(x2)
        w_q, s_w = meta.weight.quantize(weight)
        y = (x_q.astype(_FP32) @ w_q.astype(_FP32).T) * (_FP32(1.0) / (s_x * s_w))
        if bias is not None:
            y += bias
        ctx.save_for_backward(x_q, w_q)  # the fp8 copies: 1 byte per value of activation memory
        ctx.scales, ctx.meta, ctx.x_shape, ctx.has_bias = (s_x, s_w), meta, x.shape, bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0]).astype(np.result_type(x.dtype, _FP32), copy=False)

    @staticmethod
    def backward(ctx, g):
        x_q, w_q = ctx.saved
        s_x, s_w = ctx.scales
        g2 = g.reshape(-1, g.shape[-1])
        g_q, s_g = ctx.meta.grad_output.quantize(g2)
        g_f = g_q.astype(_FP32)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = ((g_f @ w_q.astype(_FP32)) * (_FP32(1.0) / (s_g * s_w))).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            gw = (g_f.T @ x_q.astype(_FP32)) * (_FP32(1.0) / (s_g * s_x))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(axis=0)
        return gx, gw, gb, None


class Fp8Linear(Module):
    """A drop-in for an `nn.Linear`: the same weight and bias Parameters (so the optimizer, the
    names and the state dict do not change), computed by `Fp8LinearFunction`."""

    def __init__(self, linear, recipe: DelayedScaling | None = None):
        self.recipe = recipe or DelayedScaling()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.meta = Fp8Meta.new(self.recipe)

    def forward(self, x):
        return Fp8LinearFunction.apply(x, self.weight, self.bias, self.meta)


def use_fp8_mlp(model, recipe: DelayedScaling | None = None) -> dict[str, Fp8Linear]:
    """Swap every block's `mlp.c_fc` and `mlp.c_proj` for an `Fp8Linear` sharing its Parameters
    (attention and the head keep their Linears). Returns the new layers by dotted name."""
    blocks = getattr(model, "h", None)
    if blocks is None or not all(hasattr(b, "mlp") for b in blocks):
        raise ValueError(f"use_fp8_mlp: expected minidist's GPT (blocks in model.h, each with an .mlp), "
                         f"got {type(model).__name__}")
    recipe = recipe or DelayedScaling()
    layers = {}
    for i, block in enumerate(blocks):
        for name in ("c_fc", "c_proj"):
            linear = getattr(block.mlp, name)
            if isinstance(linear, Fp8Linear):
                raise ValueError(f"use_fp8_mlp: h.{i}.mlp.{name} is already fp8")
            layers[f"h.{i}.mlp.{name}"] = Fp8Linear(linear, recipe)
            setattr(block.mlp, name, layers[f"h.{i}.mlp.{name}"])
    return layers


# ----------------------------------------------------------------------------- the chapter's comparison

SMALL = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=64)


def compare_fp8_bf16(steps: int = 60, seed: int = 0, config: GPTConfig = SMALL, batch_size: int = 32,
                     lr: float = 3e-3, recipe: DelayedScaling | None = None, layer: str = "h.0.mlp.c_fc") -> dict:
    """Train the sort task twice from the same weights and batches: bf16 mixed precision, and the
    same with fp8 MLPs. Returns {"bf16": losses, "fp8": losses, "layer": layer, and that layer's
    per-step "amax" and "scale" for "input", "weight" and "grad_output"}."""
    if steps < 1:
        raise ValueError(f"compare_fp8_bf16: steps must be >= 1, got {steps}")
    names = [f"h.{i}.mlp.{n}" for i in range(config.n_layer) for n in ("c_fc", "c_proj")]
    if layer not in names:
        raise ValueError(f"compare_fp8_bf16: no fp8 layer {layer!r}; choose from {', '.join(names)}")
    task = make_task("sort", config.block_size, seed=seed)
    settings = OptimSettings(lr=lr, min_lr=lr / 10, warmup=max(1, steps // 10), steps=steps)
    runs, layers = {}, {}
    for name in ("bf16", "fp8"):
        trainer = SerialTrainer(config, settings, task, batch_size, seed=seed, precision="bf16")
        if name == "fp8":
            layers = use_fp8_mlp(trainer.model, recipe)
        runs[name] = [trainer.step(s)[0] for s in range(steps)]
    meta = layers[layer].meta
    tensors = {"input": meta.input, "weight": meta.weight, "grad_output": meta.grad_output}
    return {**runs, "layer": layer,
            "amax": {k: [a for _, a in t.log] for k, t in tensors.items()},
            "scale": {k: [s for s, _ in t.log] for k, t in tensors.items()}}
