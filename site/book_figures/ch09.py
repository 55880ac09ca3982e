"""The figures of chapter 9 (frameworks)."""
import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from minidist.comm import cost
from minidist.parallel import mesh
from minidist.plan import search
from minidist.plan.hardware import PRESETS as DEVICES
from minidist.plan.predict import Cluster, predict, Workload
from minidist.plan.step_time import pp_messages, tp_calls
from minidist.training.layout import Layout
from book_figures.common import (AXES_COLORS, figure, GB, GPT3, INK, KIND, legend_below, lighter, log_ticks,
    MB)


@figure(9, "## 2. The device mesh (设备网格)",
        caption="The mesh dp 2 × tp 2 × pp 2 on two machines of 4 ranks, from mesh.layout: tensor-parallel and "
                "data-parallel groups stay inside a machine, only the pipeline crosses between machines.",
        alt="Two large boxes for machine 0 and machine 1, each holding four ranks in a two-by-two grid, labelled "
            "with their rank and (pp, dp, tp) coordinates: ranks 0 to 3 in machine 0 (pipeline stage 0), ranks 4 "
            "to 7 in machine 1 (stage 1). Red lines join each tensor-parallel pair side by side, blue lines join "
            "each data-parallel pair one above the other, both inside a machine; green curved arrows go from each "
            "rank in machine 0 to the rank with the same dp and tp in machine 1.")
def ch09_mesh():
    world, dp, tp, pp, per_machine = 8, 2, 2, 2, 4
    places = mesh.layout(world, dp=dp, tp=tp, pp=pp)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.set_axis_off()
    where = {}
    for place in places:
        machine = place.rank // per_machine
        where[place.rank] = (machine * 6.0 + 1.2 + 2.4 * place.tp, 1.0 + 2.0 * place.dp)
    for machine in range(world // per_machine):
        ax.add_patch(Rectangle((machine * 6.0, -0.2), 4.8, 4.4, facecolor="#f5f5f5", edgecolor="#999999",
                               linewidth=1))
        ax.text(machine * 6.0 + 2.4, 4.35, f"machine {machine}", ha="center", va="bottom", fontsize=8.5)
    drawn = set()
    for place in places:
        for axis, group in (("tp", place.tp_group), ("dp", place.dp_group)):
            if group in drawn or len(group) < 2:
                continue
            drawn.add(group)
            xs, ys = zip(*(where[r] for r in group))
            ax.plot(xs, ys, color=AXES_COLORS[axis], lw=3, zorder=1, solid_capstyle="round")
        if place.pp_group.index(place.rank) + 1 < len(place.pp_group):
            nxt = place.pp_group[place.pp_group.index(place.rank) + 1]
            ax.add_patch(FancyArrowPatch(where[place.rank], where[nxt], arrowstyle="-|>", mutation_scale=11,
                                         color=AXES_COLORS["pp"], lw=1.4, shrinkA=16, shrinkB=16,
                                         connectionstyle=f"arc3,rad={-0.28 if place.tp == 0 else 0.28}", zorder=2))
    for place in places:
        x, y = where[place.rank]
        ax.add_patch(Rectangle((x - 0.55, y - 0.45), 1.1, 0.9, facecolor="white", edgecolor=INK, lw=0.8, zorder=3))
        ax.text(x, y + 0.12, f"rank {place.rank}", ha="center", va="center", fontsize=8, zorder=4)
        ax.text(x, y - 0.2, f"({place.pp}, {place.dp}, {place.tp})", ha="center", va="center", fontsize=7, zorder=4,
                color="#555555")
    ax.set_xlim(-0.3, 11.1)
    ax.set_ylim(-0.5, 4.9)
    ax.set_aspect("equal")
    ax.set_title("mesh.layout(8, dp=2, tp=2, pp=2), 4 ranks per machine; (pp, dp, tp) under each rank", loc="left")
    legend_below(fig, [Line2D([], [], color=AXES_COLORS["tp"], lw=3, label="tp group"),
                       Line2D([], [], color=AXES_COLORS["dp"], lw=3, label="dp group"),
                       Line2D([], [], color=AXES_COLORS["pp"], lw=1.4, marker=">", label="pp: activations")])
    return fig


def _gpt3(gpus: int = 1024):
    """The planner's GPT-3 175B workload (its preset: batch 1536, mixed precision) on `gpus` A100 80GB."""
    _, batch, precision, _ = search.PRESETS["gpt3-175b"]
    workload = Workload(GPT3, batch, GPT3.block_size, precision, "megatron")
    return workload, Cluster.of(DEVICES["a100-80gb"], gpus, precision)


@figure(9, "## 6. Why tensor parallelism stays inside a node and the pipeline goes across",
        caption="GPT-3 175B in the layout tp 8 × pp 4 × dp 32, per GPU and step: the tensor-parallel "
                "all-reduces are a small share of the compute over NVLink but as long as the whole compute "
                "over the network; the pipeline's messages are cheap either way.",
        alt="A horizontal bar chart on a logarithmic time axis in seconds. A reference bar shows about 17 s of "
            "compute per step. Tensor parallelism's all-reduces take about 1.5 s inside a node and about 17 s "
            "between nodes; the pipeline's messages take about 0.02 s inside and 0.2 s between.")
def ch09_axis_time():
    w, cluster = _gpt3()
    layout = Layout.parse("dp32-tp8-pp4-zero1-m48")
    t, p, m = layout.tp, layout.pp, layout.microbatches
    b = w.global_batch // (layout.dp * m)
    activation = b * w.seq * w.config.n_embd * 2  # bytes of one micro-batch's activation, 16-bit
    compute = predict(w, layout, cluster)["compute"]
    rows = [("compute (planner)", compute, KIND["compute"])]
    for inside in (True, False):
        alpha, beta = cluster.link(inside)
        where = "inside a node" if inside else "between nodes"
        tp_time = tp_calls(w, layout) * cost.predict("all_reduce", "ring", t, activation, alpha, beta)
        color = AXES_COLORS["tp"] if inside else lighter(AXES_COLORS["tp"], 0.4)
        rows.append((f"tp all-reduces, {where}", tp_time, color))
    for inside in (True, False):
        alpha, beta = cluster.link(inside)
        where = "inside a node" if inside else "between nodes"
        pp_time = pp_messages(p, m) * (alpha + activation * beta)
        color = AXES_COLORS["pp"] if inside else lighter(AXES_COLORS["pp"], 0.4)
        rows.append((f"pp messages, {where}", pp_time, color))
    fig, ax = plt.subplots(figsize=(7, 3.0))
    for i, (label, seconds, color) in enumerate(rows):
        ax.barh(i, seconds, color=color, height=0.6)
        ax.text(seconds * 1.15, i, f"{seconds:.3g} s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xscale("log")
    ax.set_xlim(0.005, 200)
    log_ticks(ax.xaxis, [0.01, 0.1, 1, 10, 100])
    ax.set(xlabel="seconds per step on one GPU",
           title=f"GPT-3 175B, {layout}, A100s: {tp_calls(w, layout)} tp all-reduces and\n"
                 f"{pp_messages(p, m)} pp messages of {activation / MB:.1f} MB per step, NVLink or the network")
    ax.grid(False, axis="y")
    return fig


@figure(9, "## 11. The layout planner",
        caption="The planner's landscape for GPT-3 175B on 1024 A100s: the best predicted step of every "
                "tensor × pipeline split (1F1B; ZeRO-1, or ZeRO-3 without a pipeline), the rest data parallel; "
                "the good region is t = 8 inside a node with a few pipeline stages.",
        alt="A heat map with tensor-parallel size t from 1 to 32 on the vertical axis and pipeline stages p "
            "from 1 to 64 on the horizontal. Each valid cell shows the best predicted step time in seconds, "
            "coloured from dark (fast) to light (slow); cells where no layout fits in 80 GB are grey and marked "
            "with a dash. The fastest cell, outlined in red, is t = 8, p = 4 at about 20 seconds, with t = 8 and "
            "8 to 32 stages close behind; t of 4 or less never fits, and t = 16 or 32 are two to five times "
            "slower.")
def ch09_planner_landscape():
    w, cluster = _gpt3()
    layouts = search.candidate_layouts(w.config, cluster.gpus, w.global_batch, (1, 3), ("1f1b",))
    best, tried = {}, set()
    for layout in layouts:
        key = (layout.tp, layout.pp)
        tried.add(key)
        row = predict(w, layout, cluster, simulate=False)
        if row["fits"] and row["step_seconds"] < best.get(key, (math.inf,))[0]:
            best[key] = (row["step_seconds"], layout)
    tps = sorted({t for t, _ in tried})
    pps = sorted({p for _, p in tried})
    grid = np.full((len(tps), len(pps)), np.nan)
    for (t, p), (seconds, _) in best.items():
        grid[tps.index(t), pps.index(p)] = seconds
    fig, ax = plt.subplots(figsize=(7, 3.4))
    low, high = np.log10(np.nanmin(grid)), np.log10(np.nanmax(grid))
    image = ax.imshow(np.log10(grid), cmap="viridis", aspect="auto", vmin=low, vmax=high)
    for i, t in enumerate(tps):
        for j, p in enumerate(pps):
            if (t, p) not in tried:
                continue
            if np.isnan(grid[i, j]):
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#dddddd", edgecolor="white"))
                ax.text(j, i, "–", ha="center", va="center", fontsize=8, color="#777777")
            else:
                value = grid[i, j]
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7.5,
                        color="white" if np.log10(value) < (low + high) / 2 else INK)
    seconds, winner = min(best.values(), key=lambda item: item[0])
    i, j = tps.index(winner.tp), pps.index(winner.pp)
    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="none", edgecolor="#d62728", lw=2))
    ax.set_xticks(range(len(pps)), [str(p) for p in pps])
    ax.set_yticks(range(len(tps)), [str(t) for t in tps])
    ax.grid(False)
    ax.set(xlabel="pipeline stages p", ylabel="tensor-parallel ranks t",
           title=f"Best predicted step (s) for each t × p, dp = 1024/(t·p); best: {winner}, {seconds:.1f} s")
    colorbar = fig.colorbar(image, ax=ax, shrink=0.85)
    ticks = [t for t in (20, 30, 50, 70, 100) if low <= np.log10(t) <= high]
    colorbar.set_ticks(np.log10(ticks), labels=[str(x) for x in ticks])
    colorbar.set_label("step (s)")
    return fig


@figure(9, "## 11. The layout planner",
        caption="Where the step goes in five layouts of GPT-3 175B on 1024 A100s, as the planner predicts "
                "them: the best balances all parts; the others lose to all-reduces across nodes, to the bubble, "
                "or to ZeRO-3's gathers, or do not fit.",
        alt="Five horizontal stacked bars of predicted seconds per step, each split into compute, "
            "tensor-parallel, pipeline, bubble, data-parallel and optimizer time. The best layout, "
            "dp32-tp8-pp4-zero1-m48, is about 20 s, mostly compute. tp 16 adds a long tensor-parallel segment "
            "(about 48 s in all); tp 4 with 8 stages is about as fast but its memory label says it does not "
            "fit; a pipeline of 32 stages has a long bubble; ZeRO-3 with 512 replicas has a long data-parallel "
            "segment, about 68 s. Each bar is labelled with its memory per GPU.")
def ch09_step_breakdown():
    w, cluster = _gpt3()
    names = ["dp32-tp8-pp4-zero1-m48", "dp32-tp16-pp2-zero1-m48", "dp32-tp4-pp8-zero1-m48",
             "dp32-pp32-zero1-m48", "dp512-tp2-zero3-m3"]
    parts = {"compute": KIND["compute"], "tp": AXES_COLORS["tp"], "pp": AXES_COLORS["pp"], "bubble": KIND["wait"],
             "dp": AXES_COLORS["dp"], "optimizer": KIND["optimizer"]}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, name in enumerate(names):
        row = predict(w, Layout.parse(name), cluster)
        left = 0.0
        for key, color in parts.items():
            ax.barh(i, row[key], left=left, color=color, height=0.6, edgecolor="white", linewidth=0.5)
            left += row[key]
        peak = row["memory"]["peak"] / GB
        verdict = "fits" if row["fits"] else "does not fit"
        ax.text(left + 0.8, i, f"{row['step_seconds']:.1f} s, {peak:.0f} GB: {verdict}", va="center", fontsize=7.5)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, 100)
    ax.set(xlabel="predicted seconds per step", title="GPT-3 175B on 1024 A100 80GB (plan.predict)")
    ax.grid(False, axis="y")
    labels = {"compute": "compute", "tp": "tp all-reduces", "pp": "pp messages", "bubble": "bubble",
              "dp": "dp (exposed)", "optimizer": "optimizer"}
    legend_below(fig, [Patch(color=c, label=labels[k]) for k, c in parts.items()], ncols=6)
    return fig


@figure(9, "### The paper's trade-offs",
        caption="The planner's predictions for four sweeps Narayanan et al. measured on 64 A100s, one line per "
                "batch; the shaded band is where the paper's sentence puts the best (Figure 13: tp 8; 16: "
                "micro-batch 2) or its ordering (14 and 15: the left end, falling to the right). Figure 13 and the "
                "large batches agree; small batches of 14 and 15, and Figure 16, do not.",
        alt="Four line charts of predicted TFLOP/s per GPU. Figure 13, tensor against pipeline size for a 162B "
            "model: both batch sizes peak at tp 8, where the paper's best is shaded. Figure 14, pipeline against "
            "data parallel size for a 5.9B model: at batch 512 the line falls from pp 2 to 32 as the paper found, "
            "at batch 32 it rises to pp 8 first. Figure 15, tensor against data parallel size: at batch 512 it "
            "falls from tp 2, at batches 32 and 128 it peaks at tp 8 and 4, and everywhere drops steeply beyond "
            "tp 8. Figure 16, micro-batch size at tp 8 by pp 8 for a 91B model: both lines are highest at "
            "micro-batch 1 where the paper's best, shaded, is 2.")
def ch09_paper_tradeoffs():
    from minidist.plan.against_sweeps import predictions
    from minidist.plan.published_sweeps import FIGURE_13, FIGURE_14, FIGURE_15, FIGURE_16
    panels = [(FIGURE_13, "tp", "tp (pp = 64 / tp)", 8), (FIGURE_14, "pp", "pp (dp = 64 / pp)", 2),
              (FIGURE_15, "tp", "tp (dp = 64 / tp)", 2), (FIGURE_16, "micro_batch", "micro-batch (tp 8 × pp 8)", 2)]
    fig, axes = plt.subplots(1, 4, figsize=(10, 2.9), sharey=True)
    for ax, (sweep, knob, label, paper) in zip(axes, panels):
        lines: dict[int, dict] = {}
        for point, row in predictions(sweep).items():
            lines.setdefault(point.global_batch, {})[getattr(point, knob)] = row["tflops_per_device"]
        for i, (batch, line) in enumerate(sorted(lines.items())):
            xs = sorted(line)
            ax.plot(xs, [line[x] for x in xs], marker="o", ms=3.5, color=f"C{i}", label=f"batch {batch}")
        ax.axvspan(paper / 1.3, paper * 1.3, color="#f2c94c", alpha=0.35, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.set(xlabel=label, title=sweep.name.replace("Narayanan 2021 ", ""))
        ax.legend(fontsize=7, loc="lower left")
    axes[0].set_ylabel("predicted TFLOP/s per GPU")
    axes[0].set_ylim(0, 200)
    return fig
