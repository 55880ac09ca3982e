"""The figures of chapter 8 (zero)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minidist.comm import cost
from minidist.core.model import GPT
from minidist.parallel.zero_partition import make_units
from minidist.plan import memory
from minidist.plan.hardware import PRESETS as DEVICES
from book_figures.common import (DEMO, figure, GB, INK, legend_below, log_ticks, MB, PILE_NAMES, PILES, RANKS,
    STAGES)


@figure(8, "## 2. The partitioner",
        caption="The demo GPT's units as ZeRO flattens them for 4 ranks: each unit is one flat buffer and rank "
                "r owns its r-th contiguous quarter, whatever parameters that cuts through.",
        alt="Five horizontal bars, one per unit: a short root unit (embeddings and final LayerNorm) and four "
            "longer, equal block units h.0 to h.3. Each bar is split into four equal coloured quarters for "
            "ranks 0 to 3, with thin black ticks marking where one parameter ends and the next begins; the "
            "ticks do not line up with the quarters.")
def ch08_partition():
    n = 4
    model = GPT(DEMO, seed=0)
    units = make_units(model, n, 0)
    fig, ax = plt.subplots(figsize=(7, 2.9))
    for row, unit in enumerate(units):
        for r in range(n):
            ax.barh(row, unit.chunk / 1e3, left=r * unit.chunk / 1e3, color=RANKS[r], height=0.6, edgecolor="white")
        if unit.padded > unit.numel:
            ax.barh(row, (unit.padded - unit.numel) / 1e3, left=unit.numel / 1e3, height=0.6, color="none",
                    hatch="////", edgecolor=INK)
        for offset in unit.offsets[1:-1]:
            ax.plot([offset / 1e3] * 2, [row - 0.3, row + 0.3], color=INK, lw=0.5)
        ax.text(unit.padded / 1e3 + 2, row, f"{unit.numel:,} elements, {unit.chunk:,} per rank", va="center",
                fontsize=7.5)
    ax.set_yticks(range(len(units)), [u.name for u in units])
    ax.set_ylim(len(units) - 0.5, -0.5)
    ax.set_xlim(0, max(u.padded for u in units) / 1e3 * 1.45)
    ax.set(xlabel="element of the unit's flat buffer (thousands)",
           title=f"make_units(model, {n}, rank): demo GPT, one flat buffer per unit (ticks: parameter boundaries)")
    ax.grid(False, axis="y")
    legend_below(fig, [Patch(color=RANKS[r], label=f"owned by rank {r}") for r in range(n)])
    return fig


@figure(8, "## 3. The three stages (ZeRO-1/2/3, 优化器状态/梯度/参数分片)",
        caption="Model states per device of a 7.5B-parameter model in mixed precision: stages 1 and 2 level "
                "off at the piles they keep whole, only stage 3 keeps falling as ranks are added.",
        alt="Two charts. Left, log-log lines of gigabytes per device against data-parallel ranks from 1 to "
            "1024 for ZeRO stages 0 to 3, with a dashed line at 80 GB: stage 0 is flat at 120 GB, stage 1 falls "
            "and levels off near 30 GB, stage 2 near 15 GB, stage 3 falls in a straight line to about 0.1 GB. "
            "Right, stacked bars at 64 ranks for each stage, split into parameters, gradients and optimizer "
            "states, with totals of 120, 31.4, 16.6 and 1.88 GB.")
def ch08_stages_vs_ranks():
    psi, device = 7.5e9, DEVICES["a100-80gb"].memory
    ranks = 2 ** np.arange(0, 11)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.4), width_ratios=[1.25, 1])
    for stage in range(4):
        left.plot(ranks, [memory.model_state_bytes(psi, int(n), stage)["total"] / GB for n in ranks], "o-", ms=3,
                  color=STAGES[stage], label=f"stage {stage}")
    left.axhline(device / GB, color=INK, ls="--", lw=0.8)
    left.text(1024, device / GB * 1.12, "80 GB", fontsize=7.5, ha="right")
    left.set(xscale="log", yscale="log", xlabel="data-parallel ranks N", ylabel="GB per device",
             title="model states per device")
    log_ticks(left.xaxis, [1, 4, 16, 64, 256, 1024])
    log_ticks(left.yaxis, [0.1, 1, 10, 100])
    left.legend(loc="lower left")
    for stage in range(4):
        piles = memory.model_state_bytes(psi, 64, stage)
        bottom = 0.0
        for key in ("params", "grads", "optimizer"):
            right.bar(stage, piles[key] / GB, bottom=bottom, color=PILES[key], width=0.6, edgecolor="white")
            bottom += piles[key] / GB
        right.text(stage, bottom + 1.5, f"{bottom:.3g} GB", ha="center", fontsize=7.5)
    right.set_xticks(range(4), [f"stage {s}" for s in range(4)])
    right.set(ylabel="GB per device", title="at N = 64 (the ZeRO paper's Figure 1)")
    right.grid(False, axis="x")
    legend_below(fig, [Patch(color=PILES[k], label=PILE_NAMES[k]) for k in ("params", "grads", "optimizer")])
    return fig


@figure(8, "## 8. Traffic, measured",
        caption="Model states and bytes sent per rank and step for the demo GPT, stage by stage: stages 1 and 2 "
                "save memory at no extra traffic, stage 3 saves the most and sends about 1.5 times the bytes.",
        alt="Two line charts against the ZeRO stage from 0 to 3, one line each for 2, 4 and 8 ranks. Left, "
            "megabytes of model states per rank: every line starts at about 13 MB at stage 0 and falls with each "
            "stage, more steeply the more ranks there are, to about 1.7 MB at stage 3 on 8 ranks. Right, "
            "megabytes sent per rank per step: each line is flat across stages 0, 1 and 2 and jumps up by about "
            "half at stage 3.")
def ch08_memory_traffic():
    model = GPT(DEMO, seed=0)
    psi = memory.param_count(DEMO)
    stages = range(4)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.2))
    for n, color in ((2, STAGES[1]), (4, STAGES[2]), (8, STAGES[3])):
        numel = [unit.numel for unit in make_units(model, n, 0)]
        left.plot(stages, [memory.model_state_bytes(psi, n, z, "fp32")["total"] / MB for z in stages], "o-",
                  color=color, label=f"N = {n}")
        right.plot(stages, [cost.zero_bytes_sent(z, n, numel) / MB for z in stages], "o-", color=color,
                   label=f"N = {n}")
    left.set(ylabel="MB of model states per rank", title="memory (memory.model_state_bytes)", ylim=(0, None))
    right.set(ylabel="MB sent per rank per step", title="traffic (cost.zero_bytes_sent)", ylim=(0, None))
    for ax in (left, right):
        ax.set_xticks(list(stages), [f"stage {z}" for z in stages])
        ax.set_xlim(-0.35, 3.35)
        ax.legend(loc="lower left" if ax is left else "upper left")
    fig.suptitle("Demo GPT, float32 AdamW, ZeRO stages 0-3 on N data-parallel ranks", fontsize=9.5, x=0.02,
                 ha="left")
    return fig
