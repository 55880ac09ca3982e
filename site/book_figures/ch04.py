"""The figures of chapter 4 (model parallelism)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minidist.comm import cost
from minidist.parallel import schedules as S
from minidist.parallel.pipeline_stage import PipelineStage
from minidist.plan import memory
from book_figures.common import (AXES_COLORS, DEMO, figure, gantt, INK, kind_patches, legend_below, MB)


@figure(4, "## 1. Stages",
        caption="Parameters per rank of the demo GPT cut into 2 and 4 stages: the blocks divide evenly, the "
                "ends are heavier with the embeddings and the head's copy of the tied embedding.",
        alt="A stacked bar chart of parameter counts per rank: one bar for p = 1, two for p = 2 and four for "
            "p = 4. Each bar has a blocks segment; rank 0 adds an embeddings segment and the last rank a head "
            "segment (the final LayerNorm and the copy of the tied token embedding), so the outer bars are "
            "taller than the middle ones. The counts are written on the bars.")
def ch04_stage_parameters():
    config = DEMO
    parts = {"embeddings (wte, wpe)": "#64b5cd", "blocks": "#4c72b0", "head (ln_f, tied wte copy)": "#ccb974"}
    fig, ax = plt.subplots(figsize=(7, 3.3))
    x, ticks = 0, []
    for p in (1, 2, 4):
        for rank in range(p):
            stage = PipelineStage(config, rank, p, seed=0)
            counts = dict.fromkeys(parts, 0)
            for name, param in stage.named_parameters():
                if name.startswith("h."):
                    counts["blocks"] += param.size
                elif name.startswith("wpe") or (name.startswith("wte") and stage.first):
                    counts["embeddings (wte, wpe)"] += param.size
                else:
                    counts["head (ln_f, tied wte copy)"] += param.size
            bottom = 0
            for key, color in parts.items():
                ax.bar(x, counts[key] / 1e3, bottom=bottom / 1e3, color=color, width=0.7, edgecolor="white")
                bottom += counts[key]
            ax.text(x, bottom / 1e3 + 8, f"{bottom:,}", ha="center", va="bottom", fontsize=7)
            ticks.append((x, f"p={p}\nrank {rank}"))
            x += 1
        x += 0.6
    ax.set_xticks(*zip(*ticks))
    ax.set(ylabel="parameters (thousands)", title="Demo GPT cut into stages (PipelineStage), parameters per rank")
    ax.grid(False, axis="x")
    legend_below(fig, [Patch(color=c, label=k) for k, c in parts.items()])
    return fig


@figure(4, "## 2. Messages: activations forward, gradients backward",
        caption="Bytes per step across one stage boundary against data parallelism's all-reduce: the "
                "pipeline's messages grow with the batch, the gradient all-reduce does not.",
        alt="A line chart of megabytes per step against the batch size from 1 to 64 sequences. The pipeline "
            "boundary's activation plus gradient is a straight line from nearly zero; two flat lines show the "
            "bytes each rank sends in data parallelism's all-reduce at dp = 2 and dp = 4. At the demo's batch "
            "of 16, marked by a dot, the pipeline sends about a third of the dp = 2 all-reduce.")
def ch04_messages():
    config = DEMO
    batches = np.arange(1, 65)
    element = 4 * config.block_size * config.n_embd  # bytes of one sequence's activation, float32
    grads = 4 * memory.param_count(config)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(batches, 2 * batches * element / MB, color=AXES_COLORS["pp"],
            label="pipeline, one boundary: activation forward + gradient backward, 2·b·s·h·4 B")
    for n, style in ((2, "--"), (4, ":")):
        sent = cost.terms("all_reduce", "ring", n, grads)[1]
        ax.axhline(sent / MB, color=AXES_COLORS["dp"], ls=style,
                   label=f"data parallelism, dp = {n}: ring all-reduce per rank")
    ax.plot([16], [2 * 16 * element / MB], "o", color=INK)
    ax.annotate("demo batch 16", (16, 2 * 16 * element / MB), xytext=(8, -14), textcoords="offset points")
    ax.set(xlabel="batch b (sequences of 64 tokens)", ylabel="MB per step",
           title="Demo GPT, float32: what a pipeline boundary sends vs a gradient all-reduce", ylim=(0, 7.2))
    ax.legend(loc="upper left")
    return fig


@figure(4, "## 4. The idle timeline",
        caption="Naive model parallelism with ideal timings (forward 1, backward 2): only one rank works at "
                "a time, and each idles (p − 1)/p of the step.",
        alt="Two Gantt charts, for 2 and 4 ranks. In each, rank 0 runs a blue forward, then every later rank "
            "runs its forward in turn, the last rank runs forward and an orange backward, and the backwards "
            "travel back to rank 0; every rank is shown idle in grey the rest of the time, which grows from "
            "half the step with 2 ranks to three quarters with 4.")
def ch04_idle_timeline():
    fig, axes = plt.subplots(2, 1, figsize=(7, 3.8), sharex=True, height_ratios=[2, 4])
    for ax, p in zip(axes, (2, 4)):
        events = S.simulate(S.all_ranks("gpipe", p, 1))
        gantt(ax, events, title=f"p = {p}: idle share {S.bubble_fraction(events):.2f} = (p − 1)/p")
    axes[-1].set_xlabel("time (one stage's forward = 1, backward = 2)")
    legend_below(fig, kind_patches(["forward", "backward", "wait"]))
    return fig
