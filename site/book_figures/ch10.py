"""The figures of chapter 10 (mixed precision)."""
import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minidist.plan import memory
from minidist.precision.formats import FORMATS, round_to
from minidist.precision.loss_scale import DynamicLossScaler
from book_figures.common import (ALGORITHMS, figure, FORMAT_COLORS, INK, legend_below, lighter, log_ticks,
    PILE_NAMES, PILES, power, STAGES)


@figure(10, "## 2. The formats side by side (浮点格式)",
        caption="The range of each floating-point format on a log₂ scale, from its smallest subnormal through "
                "its smallest normal number to its largest: bf16 has fp32's range with fewer bits, fp16 a "
                "narrow one.",
        alt="Five horizontal bars on an axis of log2 of the magnitude from about −150 to 130. Each bar has a "
            "lighter hatched part for the subnormal numbers and a solid part for the normal ones. fp32 and bf16 "
            "span almost the whole axis, from −149 or −133 to 128; fp16 only from −24 to 16; fp8 e5m2 from −16 "
            "to 16; fp8 e4m3 from −9 to about 9. Each bar is labelled with its machine epsilon.")
def ch10_formats():
    fig, ax = plt.subplots(figsize=(7, 3.0))
    formats = list(FORMATS.values())
    for row, fmt in enumerate(formats):
        lo, mid, hi = (math.log2(v) for v in (fmt.smallest_subnormal, fmt.smallest_normal, fmt.max))
        color = FORMAT_COLORS[fmt.name]
        ax.barh(row, mid - lo, left=lo, color=lighter(color, 0.55), hatch="////", edgecolor="white", height=0.6)
        ax.barh(row, hi - mid, left=mid, color=color, height=0.6)
        ax.text(hi + 2, row, f"ε = {power(2, -fmt.mantissa_bits)}, max {fmt.max:.3g}", va="center", fontsize=7.5)
    ax.set_yticks(range(len(formats)), [f"{f.name} ({f.exponent_bits}e{f.mantissa_bits}m)" for f in formats])
    ax.set_ylim(len(formats) - 0.5, -0.5)
    ax.set_xlim(-155, 200)
    ax.axvline(0, color=INK, lw=0.6)
    ax.set(xlabel="log₂ |value|", title="precision.FORMATS: subnormal (hatched) and normal ranges")
    ax.grid(False, axis="y")
    legend_below(fig, [Patch(facecolor=lighter(INK, 0.7), hatch="////", edgecolor="white", label="subnormal"),
                       Patch(color=lighter(INK, 0.2), label="normal")])
    return fig


@figure(10, "## 4. Master weights (FP32 主权重)",
        caption="Eight updates of 2⁻¹³ to an fp16 weight of 1.0: applied to the fp16 weight each is lost; "
                "applied to an fp32 master they accumulate, and the rounded weight moves one ulp at step 5.",
        alt="A step chart of the weight minus 1, in units of 2 to the −13, against the update step from 0 to 8. "
            "The fp32 master rises in a straight line from 0 to 8. The fp16 weight rounded from the master stays "
            "at 0 until step 4 and jumps to 8 at step 5. The fp16 weight updated directly stays at 0 throughout.")
def ch10_master_weights():
    step_size, steps = 2.0 ** -13, np.arange(0, 9)
    master, rounded, direct = [], [], []
    weight = round_to(np.array([1.0], np.float32), "fp16")
    for k in steps:
        m = np.float32(1.0) + np.float32(k * step_size)
        master.append(float(m))
        rounded.append(float(round_to(np.array([m], np.float32), "fp16")[0]))
        direct.append(float(weight[0]))
        weight = round_to(weight.astype(np.float32) + np.float32(step_size), "fp16")
    fig, ax = plt.subplots(figsize=(7, 3.1))
    units = lambda values: (np.array(values) - 1.0) / step_size  # noqa: E731
    ax.plot(steps, units(master), "o-", color=FORMAT_COLORS["fp32"], label="fp32 master")
    ax.step(steps, units(rounded), where="post", color=FORMAT_COLORS["fp16"], lw=2,
            label="fp16 weight = master, rounded")
    ax.plot(steps, units(direct), "s--", color=ALGORITHMS["naive"], ms=4, label="fp16 weight updated directly")
    ax.axhline(4, color=INK, ls=":", lw=0.8)
    ax.text(0.1, 4.2, "halfway to the next fp16 number, 1 + 2⁻¹⁰", fontsize=7.5)
    ax.set(xlabel="AdamW step (each moves the weight by 2⁻¹³)", ylabel="weight − 1 (units of 2⁻¹³)",
           title="An fp16 weight of 1.0: its neighbour is 1 + 2⁻¹⁰, 8 updates away (precision.round_to)")
    ax.legend(loc="upper left")
    return fig


@figure(10, "### The scaler's rule",
        caption="The dynamic loss scale of DynamicLossScaler driven by a fixed overflow rule: it backs off from "
                "2²⁴ to the largest scale that does not overflow, then keeps probing one binade higher every "
                "growth interval and backing off.",
        alt="A step chart of log2 of the loss scale against the training step from 0 to 120. It starts at 24, "
            "falls by one at each of the first steps, marked with red crosses for skipped steps, down to 18; "
            "then it forms a saw-tooth: ten clean steps at 18, a step up to 19, an immediate overflow marked "
            "with a red cross and a step back to 18, repeated about every eleven steps.")
def ch10_loss_scale():
    fp16_max, largest = FORMATS["fp16"].max, 2.0 ** 18.5  # overflow once scale · max|g| > 65504
    g_max = fp16_max / largest
    scaler = DynamicLossScaler(init_scale=2.0 ** 24, growth_interval=10)
    for step in range(120):
        found_inf = scaler.scale * g_max > fp16_max
        skipped = scaler.should_skip(found_inf)
        scaler.update(found_inf)
        scaler.record(step, skipped)
    steps = np.array([s for s, _, _ in scaler.history])
    skipped = np.array([k for _, _, k in scaler.history])
    before = np.log2([2.0 ** 24] + [scale for _, scale, _ in scaler.history[:-1]])  # the scale each step used
    fig, ax = plt.subplots(figsize=(7, 3.1))
    ax.step(steps, before, where="post", color=FORMAT_COLORS["fp16"], label="scale used at the step")
    ax.plot(steps[skipped], before[skipped], "x", color=ALGORITHMS["naive"], ms=6, label="overflow: step skipped")
    ax.axhline(math.log2(largest), color=INK, ls=":", lw=0.8, label="above it, the gradients overflow fp16")
    ax.set(xlabel="step", ylabel="log₂ loss scale",
           title=f"DynamicLossScaler(init 2²⁴, growth_interval 10): {int(skipped.sum())} of {len(steps)} "
                 "steps skipped")
    ax.legend(loc="upper right")
    return fig


@figure(10, "## 8. Memory: 2Ψ + 2Ψ + 12Ψ",
        caption="Model states per parameter and rank, fp32 AdamW against mixed precision, for each ZeRO stage: "
                "the totals are equal without ZeRO and at stage 3, and mixed precision gains most where stages 1 "
                "and 2 keep its smaller 16-bit piles whole.",
        alt="Two charts. Left, pairs of stacked bars for ZeRO stages 0 to 3 at 2 ranks, fp32 and mixed, in bytes "
            "per parameter: both 16 at stage 0, 12 and 10 at stage 1, 10 and 9 at stage 2, both 8 at stage 3. "
            "Right, the ratio of mixed to fp32 against the number of ranks from 1 to 1024: stages 0 and 3 stay at "
            "1, stages 1 and 2 fall towards 0.5.")
def ch10_mixed_vs_fp32():
    psi, n = 1.0, 2
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.4), width_ratios=[1.2, 1])
    for stage in range(4):
        for offset, precision in ((-0.19, "fp32"), (0.19, "mixed")):
            piles = memory.model_state_bytes(psi, n, stage, precision)
            bottom = 0.0
            for key in ("params", "grads", "optimizer"):
                left.bar(stage + offset, piles[key], 0.36, bottom=bottom, color=PILES[key], edgecolor="white",
                         hatch="" if precision == "fp32" else "///")
                bottom += piles[key]
            left.text(stage + offset, bottom + 0.3, "fp32" if precision == "fp32" else "mixed", ha="center",
                      fontsize=6.5, rotation=90, va="bottom")
    left.set_xticks(range(4), [f"stage {s}" for s in range(4)])
    left.set(ylabel="bytes per parameter per rank", title=f"N = {n} ranks", ylim=(0, 21))
    left.grid(False, axis="x")
    ranks = 2 ** np.arange(0, 11)
    for stage in range(4):
        ratio = [memory.model_state_bytes(psi, int(k), stage, "mixed")["total"]
                 / memory.model_state_bytes(psi, int(k), stage, "fp32")["total"] for k in ranks]
        right.plot(ranks, ratio, "o-", ms=3, color=STAGES[stage], label=f"stage {stage}",
                   **(dict(lw=4, alpha=0.6) if stage == 0 else {}))  # stages 0 and 3 coincide
    right.set(xscale="log", xlabel="data-parallel ranks N", ylabel="mixed / fp32", title="the ratio", ylim=(0.4, 1.05))
    log_ticks(right.xaxis, [1, 8, 64, 512])
    right.legend(loc="lower left")
    legend_below(fig, [Patch(color=PILES[k], label=PILE_NAMES[k]) for k in ("params", "grads", "optimizer")]
                 + [Patch(facecolor="white", edgecolor=INK, hatch="///", label="mixed precision")])
    return fig
