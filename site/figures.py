"""The book's figures, drawn from minidist's own code: python site/figures.py [OUT]

Every figure is computed when it is drawn — a pipeline schedule simulated, a formula of
`minidist.plan.memory` evaluated, a collective run rank by rank in the simulated world of
`minidist.comm.sim`, a small model's gradients taken — never typed in, so a figure cannot drift
from the code it shows. No MPI: every figure comes from one process, and all of them together
take about ten seconds of CPU.

    python site/figures.py                     # every figure, as SVG, into chapters/figures/
    python site/figures.py /tmp/figs --only ch05_gpipe_and_1f1b
    python site/figures.py --list              # the manifest: name, chapter, heading, caption

`write_figures(out)` does the same for the site builder. Each `Figure` says where it belongs:
its chapter file and `after`, the exact Markdown heading line of the section it illustrates;
`markdown(figure)` is the image reference to put under that heading.

One palette for the whole book: compute, communication and idle time in the colours of
`minidist.timeline.KIND_COLORS` (the notebooks' Gantt charts use them too); the memory piles,
ranks, collective algorithms, ZeRO stages, mesh axes and number formats each in one fixed set of
colours below. The SVG files are deterministic (a fixed `svg.hashsalt`, no date in the
metadata): the same code draws the same bytes.
"""
# No `from __future__ import annotations`: the site builder loads this file with
# importlib.util.spec_from_file_location and does not register it in sys.modules, where
# dataclasses would have to look up string annotations.
import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap, to_rgb  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402

from minidist.comm import algorithms as alg  # noqa: E402
from minidist.comm import cost, sim  # noqa: E402
from minidist.core import functional as F  # noqa: E402
from minidist.core import moe  # noqa: E402
from minidist.core.data import make_task  # noqa: E402
from minidist.core.model import GPT, GPTConfig  # noqa: E402
from minidist.core.optim import AdamW  # noqa: E402
from minidist.core.tensor import Tensor, default_dtype, graph_bytes  # noqa: E402
from minidist.parallel import mesh  # noqa: E402
from minidist.parallel import schedules as S  # noqa: E402
from minidist.parallel.balance import balanced_split  # noqa: E402
from minidist.parallel.context_parallel import SequenceSplit, ring_attention_traffic  # noqa: E402
from minidist.parallel.data_parallel import make_buckets  # noqa: E402
from minidist.parallel.pipeline_stage import PipelineStage  # noqa: E402
from minidist.parallel.tensor_layers import divide  # noqa: E402
from minidist.parallel.ulysses import ulysses_traffic  # noqa: E402
from minidist.parallel.zero_partition import make_units  # noqa: E402
from minidist.plan import memory, recompute_cost, search  # noqa: E402
from minidist.plan.hardware import PRESETS as DEVICES  # noqa: E402
from minidist.plan.predict import Cluster, Workload, predict  # noqa: E402
from minidist.plan.step_time import layer_gemms, pp_messages, tp_calls  # noqa: E402
from minidist.precision.formats import FORMATS, round_to  # noqa: E402
from minidist.precision.loss_scale import DynamicLossScaler  # noqa: E402
from minidist.timeline import KIND_COLORS  # noqa: E402
from minidist.training.layout import Layout  # noqa: E402

DEFAULT_OUT = ROOT / "chapters" / "figures"

# ----------------------------------------------------------------------------- style and palette

STYLE = {
    "figure.figsize": (7.0, 3.5),
    "figure.dpi": 100,
    "figure.constrained_layout.use": True,
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 9.5,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e4e4e4",
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
    "legend.frameon": False,
    "svg.fonttype": "path",    # text as outlines: the figure looks the same without the font
    "svg.hashsalt": "minidist",  # fixed ids inside the SVG: the same figure, the same bytes
}

KIND = KIND_COLORS  # forward, backward, comm, optimizer, wait (idle), compute: as every Gantt chart
PILES = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#8172b3", "activations": "#937860"}
PILE_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
              "activations": "activations"}
RANKS = ["#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494", "#b3b3b3"]
ALGORITHMS = {"naive": "#c44e52", "tree": "#ccb974", "recursive_doubling": "#64b5cd",
              "halving_doubling": "#8172b3", "ring": "#55a868", "hierarchical": "#da8bc3"}
ALGORITHM_NAMES = {"naive": "naive", "tree": "tree", "recursive_doubling": "recursive doubling",
                   "halving_doubling": "halving-doubling", "ring": "ring", "hierarchical": "hierarchical"}
STAGES = ["#9e9e9e", "#9ecae1", "#4292c6", "#08306b"]  # ZeRO stage 0 (plain data parallelism) to 3
AXES_COLORS = {"tp": "#c44e52", "dp": "#64b5cd", "pp": "#55a868"}
FORMAT_COLORS = {"fp32": "#4c72b0", "bf16": "#55a868", "fp16": "#dd8452", "fp8_e4m3": "#c44e52",
                 "fp8_e5m2": "#8172b3"}
SUM = "#bfe3c0"   # a cell that holds a reduced value (a sum over ranks)
INK = "#333333"   # reference lines: a device's memory, a formula
DEMO = GPTConfig()  # the demo GPT: vocabulary 256, 64 tokens, 4 blocks of width 128, 4 heads
GPT3 = GPTConfig(**search.PRESETS["gpt3-175b"][0])  # 96 layers of width 12288, 96 heads
MB, GB = 1e6, 1e9


def lighter(color, amount: float = 0.5):
    """`color` mixed with white: the second model chunk, a formula beside its measurement."""
    return tuple(c + (1 - c) * amount for c in to_rgb(color))


SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")
SUBSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def power(base: int, exponent: int) -> str:
    """'2⁻¹³': a power as plain text (no mathtext: quicker to draw, and it reads the same)."""
    return f"{base}{str(exponent).translate(SUPERSCRIPT)}"


def log_ticks(axis, ticks, labels=None) -> None:
    """Fixed, plainly labelled ticks on a log axis, and no minor ones (each tick costs drawing time)."""
    axis.set_ticks(ticks, labels if labels is not None else [f"{t:g}" for t in ticks])
    axis.set_minor_locator(NullLocator())


def size_label(nbytes: float) -> str:
    """1e6 -> '1 MB' (decimal units, as the book counts bytes)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def legend_below(fig, handles, ncols: int | None = None):
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols or len(handles))


def kind_patches(kinds) -> list:
    names = {"forward": "forward", "backward": "backward", "comm": "communication", "wait": "idle",
             "optimizer": "optimizer", "compute": "compute"}
    return [Patch(color=KIND[k], label=names[k]) for k in kinds]


def gantt(ax, per_rank, title: str = "", labels: bool = True, rows: list[str] | None = None, unit: str = "",
          idle_to_end: bool = True):
    """One row per rank (or `rows`), one bar per event (name, kind, start, end): compute full
    height in its kind's colour, communication as a thin bar below it (so overlap shows), idle
    in grey, to the end of the step. A second model chunk ("forward 2.1") is drawn lighter.
    Micro-batch numbers inside."""
    finish = max((end for events in per_rank for _, kind, _, end in events if kind != "comm"), default=0.0)
    bars: dict[tuple, list] = {}  # (y, height, colour) -> [(start, width)]: one collection each, drawn at once
    for row, events in enumerate(per_rank):
        last = max((end for _, kind, _, end in events if kind != "comm"), default=0.0)
        if idle_to_end and last < finish:  # a rank that has finished waits for the step to end
            events = list(events) + [("wait", "wait", last, finish)]
        for name, kind, start, end in events:
            if end <= start:
                continue
            color = KIND.get(kind, "#999999")
            if kind == "comm":
                y, height = row + 0.08, 0.3
            elif kind == "wait":
                y, height = row - 0.12, 0.24
            else:
                y, height = row - 0.38, 0.76
            parts = name.split()
            chunk = parts[-1].split(".")[1] if len(parts) == 2 and "." in parts[-1] else "0"
            if chunk != "0":
                color = lighter(color, 0.45)
            bars.setdefault((y, height, color), []).append((start, end - start))
            if labels and kind in ("forward", "backward") and len(parts) == 2 and end - start >= 0.45:
                ax.text((start + end) / 2, row, parts[1].split(".")[0], ha="center", va="center", fontsize=6.5,
                        color="white" if chunk == "0" else INK)
    for (y, height, color), spans in bars.items():
        ax.broken_barh(spans, (y, height), facecolors=color, edgecolor="white", linewidth=0.6)
    ax.set_yticks(range(len(per_rank)), rows or [f"rank {r}" for r in range(len(per_rank))])
    ax.set_ylim(len(per_rank) - 0.5, -0.5)
    ax.grid(False, axis="y")
    ax.set_title(title, loc="left")
    if unit:
        ax.set_xlabel(unit)


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Figure:
    """One figure of the book: `OUT/name.svg`, to go under the heading line `after` of `chapter`."""
    name: str                  # file stem
    chapter: str               # the chapter's file, e.g. "05_pipeline_parallelism.md"
    after: str                 # the exact Markdown heading line under which it belongs
    caption: str               # one sentence: what to see
    alt: str                   # the picture in words, for a reader who cannot see it
    draw: Callable[[], "matplotlib.figure.Figure"]


FIGURES: list[Figure] = []

CHAPTERS = {1: "01_why_distributed_training.md", 2: "02_core_concepts.md", 3: "03_data_parallelism.md",
            4: "04_model_parallelism.md", 5: "05_pipeline_parallelism.md", 6: "06_tensor_parallelism.md",
            7: "07_communication_primitives.md", 8: "08_zero.md", 9: "09_frameworks.md",
            10: "10_mixed_precision.md", 11: "11_future_trends.md"}


def figure(chapter: int, after: str, caption: str, alt: str):
    """Register the decorated function (it returns a matplotlib figure) as one of the book's figures."""
    def register(draw):
        FIGURES.append(Figure(draw.__name__, CHAPTERS[chapter], after, " ".join(caption.split()),
                              " ".join(alt.split()), draw))
        return draw
    return register


# ============================================================================= chapter 1


def _measured_activations(model, batch: int, seq: int) -> int:
    ids = np.zeros((batch, seq), dtype=np.int64)
    _, loss = model(ids, ids)
    return graph_bytes(loss)


@figure(1, "### Activations, derived for this implementation",
        caption="Activation memory grows linearly with the batch and faster than linearly with the sequence, "
                "where the attention weights' a·b·s² term takes over; the measured points lie on the formula.",
        alt="Two line charts of activation memory in megabytes for the demo GPT. Left: against the batch size "
            "from 1 to 32 sequences of 64 tokens, a straight line through the origin, with four measured dots "
            "on it. Right: against the sequence length from 16 to 512 tokens at batch 1, an upward-bending "
            "curve, with a dashed curve for the attention weights alone that grows quadratically and is "
            "already over a third of the total at 512 tokens, and four measured dots on the total.")
def ch01_activation_growth():
    config, long = DEMO, GPTConfig(block_size=512)
    batches, seqs = np.arange(1, 33), np.arange(16, 513, 16)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.2))
    left.plot(batches, [memory.activation_bytes(config, int(b))["total"] / MB for b in batches],
              color=PILES["activations"], label="formula (memory.activation_bytes)")
    model = GPT(config, seed=0)
    dots = [1, 2, 4, 8]
    left.plot(dots, [_measured_activations(model, b, 64) / MB for b in dots], "o", color=INK, ms=4,
              label="measured (graph_bytes)")
    left.set(xlabel="batch (sequences of 64 tokens)", ylabel="activation memory (MB)", title="linear in the batch")
    left.legend(loc="upper left")
    h, a = config.n_embd, config.n_head
    right.plot(seqs, [memory.activation_bytes(long, 1, int(s))["total"] / MB for s in seqs],
               color=PILES["activations"], label="formula, all")
    attention = [config.n_layer * 4 * (memory.layer_activation_elements(1, int(s), h, a)
                                       - memory.layer_activation_elements(1, int(s), h, 0)) / MB for s in seqs]
    right.plot(seqs, attention, "--", color=PILES["activations"], label="of which attention weights (a·b·s²)")
    model = GPT(long, seed=0)
    dots = [64, 128, 256, 512]
    right.plot(dots, [_measured_activations(model, 1, s) / MB for s in dots], "o", color=INK, ms=4,
               label="measured")
    right.set(xlabel="sequence length (tokens, batch 1)", ylabel="activation memory (MB)",
              title="faster than linear in the sequence")
    right.legend(loc="upper left")
    return fig


@figure(1, "## 2. The demo model, measured",
        caption="The four piles of one training step of the demo GPT, as the formulas predict them and as the "
                "memory ledger measures them: the same bytes, and activations are most of them.",
        alt="Two horizontal stacked bars of equal length, labelled formula and measured, each split into "
            "four coloured segments: parameters, gradients and optimizer states, small at the left, and a long "
            "activations segment that takes about four fifths of the bar. Each segment is labelled with its "
            "size in megabytes.")
def ch01_demo_piles():
    config, batch = DEMO, 16
    model = GPT(config, seed=0)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    x, y = make_task("sort", config.block_size, seed=0).get_batch(0, batch)
    _, loss = model(x, y)
    activations = graph_bytes(loss)
    loss.backward()
    optimizer.step()
    measured = memory.ledger(model, optimizer, activations)
    psi = memory.param_count(config)
    predicted = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi,
                 "activations": memory.activation_bytes(config, batch)["total"]}
    fig, ax = plt.subplots(figsize=(7, 2.6))
    for row, piles in enumerate((predicted, measured)):
        left = 0.0
        for key, color in PILES.items():
            width = piles[key] / MB
            ax.barh(row, width, left=left, color=color, edgecolor="white", height=0.6)
            ax.text(left + width / 2, row, f"{width:.1f}", ha="center", va="center", fontsize=7.5, color="white")
            left += width
        ax.text(left + 0.8, row, f"{left:.1f} MB", va="center")
    ax.set_yticks([0, 1], ["formula", "measured\n(memory.ledger)"])
    ax.set_ylim(1.5, -0.5)
    ax.set_xlim(0, sum(predicted.values()) / MB * 1.13)
    share = measured["activations"] / measured["peak"]
    ax.set(xlabel="MB", title=f"Demo GPT, one step of {batch} × {config.block_size} tokens, float32 AdamW: "
                              f"activations {share:.0%}")
    ax.grid(False, axis="y")
    legend_below(fig, [Patch(color=c, label=PILE_NAMES[k]) for k, c in PILES.items()])
    return fig


LARGE_MODELS = {"1B": (1e9, GPTConfig(n_layer=20, n_embd=2048, n_head=16, block_size=2048)),
                "7.5B": (7.5e9, GPTConfig(n_layer=36, n_embd=4096, n_head=32, block_size=2048)),
                "175B (GPT-3)": (175e9, GPT3)}


@figure(1, "## 3. Scaling up: where one device runs out",
        caption="Training memory of three model sizes, pile by pile, beside one 80 GB device: beyond a few "
                "billion parameters the model states alone overflow it.",
        alt="Three stacked bar charts side by side, one per model (1B, 7.5B and 175B parameters), each with "
            "its own vertical scale in gigabytes and a dashed line at 80 GB. The 1B bar, about 26 GB, stays "
            "below the line; the 7.5B bar, about 154 GB, is twice the line, its optimizer states alone above "
            "it; the 175B bar is about 3.1 TB, some forty times the line. In every bar the optimizer states "
            "are the largest pile.")
def ch01_model_sizes():
    device = DEVICES["a100-80gb"].memory
    fig, axes = plt.subplots(1, 3, figsize=(7, 3.4))
    for ax, (name, (psi, config)) in zip(axes, LARGE_MODELS.items()):
        piles = memory.model_state_bytes(psi)
        piles["activations"] = config.n_layer * memory.megatron_activation_bytes(1, config.block_size,
                                                                                 config.n_embd, config.n_head)
        bottom = 0.0
        for key, color in PILES.items():
            ax.bar(0, piles[key] / GB, bottom=bottom, width=0.55, color=color, edgecolor="white")
            bottom += piles[key] / GB
        ax.axhline(device / GB, color=INK, ls="--", lw=1)
        ax.text(0.33, device / GB, "80 GB", va="bottom", ha="center", fontsize=7.5)
        total = f"{bottom / 1e3:.1f} TB" if bottom > 1e3 else f"{bottom:.0f} GB"
        ax.set(title=f"{name}\ntotal {total}", xticks=[], xlim=(-0.5, 0.55), ylim=(0, 1.12 * max(bottom, device / GB)))
        ax.grid(False, axis="x")
    axes[0].set_ylabel("GB")
    fig.suptitle("Mixed-precision Adam, micro-batch 1, sequence 2048", fontsize=9.5, x=0.02, ha="left")
    legend_below(fig, [Patch(color=c, label=PILE_NAMES[k]) for k, c in PILES.items()])
    return fig


@figure(1, "## 4. Time: 6 × parameters × tokens",
        caption="Days to train GPT-3 (6 · Ψ · D FLOPs) against the number of A100s at 40% of their peak: "
                "one device would take decades, 1024 take about a month.",
        alt="A log-log line chart: training time in days falls along a straight line from tens of thousands "
            "of days on one GPU to a few days on ten thousand GPUs. Horizontal dotted lines mark one day, "
            "one month and one year; a dot at 1024 GPUs sits near the one-month line.")
def ch01_training_time():
    psi, tokens, mfu = 175e9, 300e9, 0.4
    peak = DEVICES["a100-80gb"].flops("bf16")
    flops = 6 * psi * tokens
    gpus = 2.0 ** np.arange(0, 15)
    days = flops / (gpus * mfu * peak) / 86400
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.loglog(gpus, days, "-", color=KIND["compute"], label=f"GPT-3: 6 · 175e9 · 300e9 = {flops:.2e} FLOPs")
    for value, label in ((1, "one day"), (30, "one month"), (365, "one year")):
        ax.axhline(value, color=INK, ls=":", lw=0.8)
        ax.text(gpus[-1], value, label, ha="right", va="bottom", fontsize=7.5)
    at = flops / (1024 * mfu * peak) / 86400
    ax.plot([1024], [at], "o", color=INK)
    ax.annotate(f"1024 GPUs: {at:.0f} days", (1024, at), xytext=(12, 12), textcoords="offset points")
    ax.set(xlabel="A100 GPUs (each 40% of 312 TFLOP/s)", ylabel="days", title="Time to train GPT-3 on 300B tokens")
    log_ticks(ax.xaxis, [1, 4, 16, 64, 256, 1024, 4096, 16384])
    log_ticks(ax.yaxis, [1, 10, 100, 1000, 10000], ["1", "10", "100", "1,000", "10,000"])
    ax.legend(loc="lower left")
    return fig


# ============================================================================= chapter 2


def _cells(ax, values, colors, title: str = ""):
    """A table of ranks (rows) by elements (columns); NaN cells are left empty."""
    n_rows, n_cols = values.shape
    for i in range(n_rows):
        for j in range(n_cols):
            v = values[i, j]
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor="white" if np.isnan(v) else colors[i][j],
                                   edgecolor="#999999", linewidth=0.6))
            if not np.isnan(v):
                ax.text(j + 0.5, i + 0.5, f"{v:g}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)
    ax.set_xticks([])
    ax.set_yticks(np.arange(n_rows) + 0.5, [f"rank {r}" for r in range(n_rows)])
    ax.tick_params(length=0)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title)
    ax.set_aspect("equal")


@figure(2, "## Three collectives and what they cost (a primer)",
        caption="All-reduce, reduce-scatter and all-gather on 4 ranks, run rank by rank in the simulated "
                "world: every rank gets the whole sum, or its one chunk of it, or every rank's chunk.",
        alt="Six small tables of four rows (ranks 0 to 3) by four columns. Top row of tables, before: for "
            "all-reduce and reduce-scatter each rank holds (r+1) times 1, 2, 3, 4, coloured by rank; for "
            "all-gather rank r holds only the value 10r in column r. Bottom row, after: all-reduce gives every "
            "rank 10, 20, 30, 40; reduce-scatter leaves rank r only the sum in column r, so the diagonal reads "
            "10, 20, 30, 40; all-gather gives every rank 0, 10, 20, 30, each column in the colour of the rank it "
            "came from.")
def ch02_three_collectives():
    n = 4
    xs = [(r + 1) * np.array([1.0, 2.0, 3.0, 4.0]) for r in range(n)]
    all_reduced = sim.simulate(alg.all_reduce_ring, [x.copy() for x in xs], np.add)[-1]
    bounds = alg.chunk_bounds(4, n)
    outs = [np.empty(b - a) for a, b in bounds]
    sim.simulate(lambda ctx, x: alg.reduce_scatter_ring(ctx, x, np.add, outs[ctx.rank]), [x.copy() for x in xs])
    scattered = np.full((n, 4), np.nan)
    for r, (a, b) in enumerate(bounds):
        scattered[r, a:b] = outs[r]
    chunks = [np.full(4, np.nan) for _ in range(n)]
    for r, (a, b) in enumerate(bounds):
        chunks[r][a:b] = 10.0 * r
    gathered = sim.simulate(lambda ctx, out: alg.all_gather_ring(ctx, out, bounds), chunks)
    by_rank = [[RANKS[r]] * 4 for r in range(n)]
    by_origin = [[RANKS[j] for j in range(4)] for _ in range(n)]
    summed = [[SUM] * 4 for _ in range(n)]
    fig, axes = plt.subplots(2, 3, figsize=(7, 4.6))
    _cells(axes[0, 0], np.array(xs), by_rank, "all-reduce")
    _cells(axes[0, 1], np.array(xs), by_rank, "reduce-scatter")
    _cells(axes[0, 2], np.array(gathered[0]), by_origin, "all-gather")
    _cells(axes[1, 0], np.array(all_reduced), summed, "every rank: the sum")
    _cells(axes[1, 1], scattered, summed, "rank r: chunk r of the sum")
    _cells(axes[1, 2], np.array(gathered[-1]), by_origin, "every rank: every chunk")
    axes[0, 0].set_ylabel("before", fontsize=9)
    axes[1, 0].set_ylabel("after", fontsize=9)
    for ax in axes[:, 1:].ravel():
        ax.set_yticks([])
    return fig


@figure(2, "## Parameter servers versus all-reduce (参数服务器与 All-Reduce)",
        caption="Bytes each rank sends in one all-reduce, counted in the simulated world: the naive root, "
                "a parameter server, sends (N−1)·S, while every rank of the ring sends less than 2S.",
        alt="A line chart of bytes sent divided by the array size S against the number of ranks from 2 to 8. "
            "The naive all-reduce's root rises in a straight line from 1 to 7; the other naive ranks stay flat "
            "at 1; the ring's busiest rank rises slowly from 1 to 1.75 and lies exactly on a dashed curve "
            "2(N−1)/N that stays below 2.")
def ch02_server_vs_ring():
    count, ranks = 840, np.arange(2, 9)
    size = count * 8
    root, others, ring = [], [], []
    for n in ranks:
        sim.simulate(alg.all_reduce_naive, [np.ones(count) for _ in range(n)], np.add)
        sent = sim.simulate.last_traffic["bytes_sent"]
        root.append(sent[0] / size)
        others.append(max(sent[1:]) / size)
        sim.simulate(alg.all_reduce_ring, [np.ones(count) for _ in range(n)], np.add)
        ring.append(max(sim.simulate.last_traffic["bytes_sent"]) / size)
    fig, ax = plt.subplots(figsize=(7, 3.3))
    ax.plot(ranks, root, "o-", color=ALGORITHMS["naive"], label="naive: the root (a parameter server)")
    ax.plot(ranks, others, "o:", color=ALGORITHMS["naive"], label="naive: every other rank")
    ax.plot(ranks, ring, "s-", color=ALGORITHMS["ring"], label="ring: every rank")
    fine = np.linspace(2, 8, 100)
    ax.plot(fine, 2 * (fine - 1) / fine, "--", color=INK, lw=0.8, label="2(N−1)/N")
    ax.set(xlabel="ranks N", ylabel="bytes sent per rank / S",
           title="One all-reduce of S bytes, simulated rank by rank (comm.sim)")
    ax.legend(loc="upper left")
    return fig


@figure(2, "## Speed-up and scaling efficiency (加速比与扩展效率)",
        caption="Strong-scaling efficiency of data parallelism, E(N) = T_c / (T_c + N·T_ring(N)), for the "
                "demo GPT's gradient: the less compute a step has to hide the all-reduce behind, the sooner "
                "the efficiency falls.",
        alt="A line chart of scaling efficiency in percent against the number of ranks from 1 to 64 on a "
            "logarithmic axis, three falling curves for a serial step of 10 ms, 100 ms and 1 s. The 1 s curve "
            "stays above 70 percent; the 100 ms curve falls to about 20 percent at 64 ranks; the 10 ms curve "
            "falls below 50 percent already at 4 ranks.")
def ch02_scaling_efficiency():
    nbytes = 4 * memory.param_count(DEMO)
    ranks = np.arange(1, 65)
    fig, ax = plt.subplots(figsize=(7, 3.3))
    for compute, color in ((1.0, KIND["compute"]), (0.1, KIND["comm"]), (0.01, ALGORITHMS["naive"])):
        ring = np.array([cost.predict("all_reduce", "ring", int(n), nbytes, **cost.AUTO_COST) for n in ranks])
        ax.plot(ranks, 100 * compute / (compute + ranks * ring), color=color,
                label=f"T_c = {compute * 1e3:g} ms of compute on one rank")
    ax.set_xscale("log", base=2)
    log_ticks(ax.xaxis, [1, 2, 4, 8, 16, 32, 64])
    ax.set(xlabel="ranks N", ylabel="efficiency E(N) (%)", ylim=(0, 103),
           title=f"Demo GPT gradient ({nbytes / MB:.2f} MB), ring all-reduce, α = 20 µs, β = 0.5 ns/B")
    ax.legend(loc="lower left")
    return fig


# ============================================================================= chapter 3

TINY = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


@figure(3, "### Why the update equals the serial one",
        caption="The average of the slice gradients against the whole batch's gradient, small GPT in float64: "
                "equal slices agree to rounding, an unequal split agrees only when weighted by its rows.",
        alt="A bar chart on a logarithmic scale of the largest difference from the whole batch's gradient, "
            "relative to its largest entry, for four ways of combining slice gradients. Two equal slices, four "
            "equal slices and a 12 and 4 row split weighted 12/16 and 4/16 all sit near 1e-16; the same 12 and "
            "4 row split averaged plainly is off by about 0.1, fifteen orders of magnitude higher.")
def ch03_averaged_gradient():
    with default_dtype("float64"):
        model = GPT(TINY, seed=0)
        x, y = make_task("sort", TINY.block_size, seed=0).get_batch(0, 16)

        def gradient(rows):
            model.zero_grad()
            _, loss = model(x[rows], y[rows])
            loss.backward()
            return np.concatenate([p.grad.ravel() for p in model.parameters()])

        whole = gradient(slice(0, 16))
        halves = [gradient(slice(8 * i, 8 * i + 8)) for i in range(2)]
        quarters = [gradient(slice(4 * i, 4 * i + 4)) for i in range(4)]
        big, small = gradient(slice(0, 12)), gradient(slice(12, 16))
    cases = {"2 equal slices\nplain mean": np.mean(halves, axis=0),
             "4 equal slices\nplain mean": np.mean(quarters, axis=0),
             "12 + 4 rows\nplain mean": (big + small) / 2,
             "12 + 4 rows\nweighted 12/16, 4/16": 0.75 * big + 0.25 * small}
    errors = [float(np.max(np.abs(g - whole)) / np.max(np.abs(whole))) for g in cases.values()]
    shown = [max(e, 1e-18) for e in errors]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    colors = [KIND["comm"] if e < 1e-12 else ALGORITHMS["naive"] for e in errors]
    ax.bar(range(len(cases)), shown, color=colors, width=0.55)
    for i, e in enumerate(errors):
        ax.text(i, shown[i] * 2, "0 (exact)" if e == 0 else f"{e:.1e}", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(1e-18, 10)
    log_ticks(ax.yaxis, [10.0 ** k for k in range(-18, 1, 3)], [power(10, k) for k in range(-18, 1, 3)])
    ax.set_xticks(range(len(cases)), list(cases))
    ax.set(ylabel="max |ḡ − g| / max |g|",
           title="Averaged slice gradients vs the whole batch's gradient (global batch 16, float64)")
    ax.grid(False, axis="x")
    return fig


DDP_FLOPS = 30e9       # useful FLOP/s of a training step on this kind of machine (chapter 1: about 25-35)
DDP_ALPHA, DDP_BETA = cost.AUTO_COST["alpha"], 5e-9  # a link of 200 MB/s: slow enough for the overlap to show


def _ddp_step(params, cap_bytes: int | None, ranks: int = 2, tokens: int = 8 * 64):
    """A modelled data-parallel step of one rank (every rank alike): forward 2 and backward 4 FLOPs per
    parameter and token, gradients ready in reverse parameter order, each all-reduce a ring priced by
    `cost.predict` on one link, one at a time. cap_bytes=None: the naive wrapper (one all-reduce per
    parameter after backward); else `make_buckets`' buckets, each started as soon as it is complete.
    Returns the events, the end of backward and the end of communication."""
    numel = sum(p.size for p in params)
    forward = 2 * numel * tokens / DDP_FLOPS
    events = [("forward", "forward", 0.0, forward)]
    clock, ready = forward, {}
    for p in reversed(params):
        clock += 4 * p.size * tokens / DDP_FLOPS
        ready[id(p)] = clock
    events.append(("backward", "backward", forward, clock))
    backward_end = clock
    if cap_bytes is None:
        groups, ready_at = [[p] for p in params], (lambda group: backward_end)
    else:
        groups = [bucket.params for bucket in make_buckets(params, cap_bytes)]
        ready_at = (lambda group: max(ready[id(p)] for p in group))
    link = 0.0
    for group in groups:
        start = max(ready_at(group), link)
        link = start + cost.predict("all_reduce", "ring", ranks, sum(p.data.nbytes for p in group), DDP_ALPHA, DDP_BETA)
        events.append(("all-reduce", "comm", start, link))
    return events, backward_end, max(link, backward_end)


@figure(3, "## 3. Bucketing and overlap (梯度分桶与通信重叠)",
        caption="One data-parallel step of the demo GPT on 2 ranks, modelled: the naive wrapper starts its "
                "all-reduces after backward, the bucketed one during it, leaving only the last bucket exposed.",
        alt="A Gantt chart with two rows, naive and bucketed, on a time axis in milliseconds. Each row has a "
            "blue forward bar and a longer orange backward bar. In the naive row a run of thin green "
            "communication bars starts only when backward ends and continues well past it. In the bucketed row "
            "four green bars start while backward is still running; only a short one sticks out after "
            "backward ends. A bracket marks the exposed communication of each row.")
def ch03_bucket_timeline():
    params = GPT(DEMO, seed=0).parameters()
    cap = 1 << 20
    runs = {"naive": _ddp_step(params, None), f"bucketed ({cap >> 20} MiB)": _ddp_step(params, cap)}
    fig, ax = plt.subplots(figsize=(7, 2.9))
    gantt(ax, [[(n, k, s * 1e3, e * 1e3) for n, k, s, e in events] for events, _, _ in runs.values()],
          rows=list(runs), labels=False, unit="time (ms)")
    for row, (events, backward_end, comm_end) in enumerate(runs.values()):
        exposed = (comm_end - backward_end) * 1e3
        ax.annotate("", (backward_end * 1e3, row + 0.47), (comm_end * 1e3, row + 0.47),
                    arrowprops=dict(arrowstyle="|-|", color=INK, lw=0.8, shrinkA=0, shrinkB=0,
                                    mutation_scale=3))
        ax.text(comm_end * 1e3 + 1, row + 0.45, f"exposed {exposed:.1f} ms", va="center", fontsize=7.5)
    ax.set_xlim(0, max(end for _, _, end in runs.values()) * 1e3 * 1.18)
    ax.set_title(f"Model: {DDP_FLOPS / 1e9:.0f} GFLOP/s, ring all-reduce with α = {DDP_ALPHA * 1e6:.0f} µs "
                 f"and {1 / DDP_BETA / MB:.0f} MB/s, dp = 2, demo GPT", loc="left")
    legend_below(fig, kind_patches(["forward", "backward", "comm"]))
    return fig


@figure(3, "### The bucket size",
        caption="The same model over bucket caps from 16 KiB to 16 MiB: the smaller the cap, the more calls, "
                "each paying the latency α; the larger, the more of the gradients wait in a last bucket that "
                "starts only when backward ends.",
        alt="Two line charts against the bucket cap on a logarithmic axis from 16 KiB to 16 MiB. Left: the "
            "number of buckets, that is of all-reduce calls, falls from about fifty to one. Right: the "
            "communication left exposed after backward, in milliseconds, stays around a millisecond up to caps "
            "of a few hundred KiB and climbs for larger caps to about 17 ms, near the naive wrapper's level, "
            "drawn as a dashed line.")
def ch03_bucket_cap():
    params = GPT(DEMO, seed=0).parameters()
    caps = [1 << k for k in range(14, 25)]
    buckets = [len(make_buckets(params, cap)) for cap in caps]
    exposed = [(end - backward) * 1e3 for _, backward, end in (_ddp_step(params, cap) for cap in caps)]
    _, backward, end = _ddp_step(params, None)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.1))
    kib = [cap / 1024 for cap in caps]
    left.plot(kib, buckets, "o-", color=KIND["comm"])
    left.set(xscale="log", yscale="log", xlabel="bucket cap (KiB)", ylabel="buckets = all-reduce calls",
             title="make_buckets, demo GPT")
    log_ticks(left.yaxis, [1, 2, 5, 10, 20, 50])
    right.plot(kib, exposed, "o-", color=KIND["comm"], label="bucketed")
    right.axhline((end - backward) * 1e3, color=ALGORITHMS["naive"], ls="--", label="naive")
    right.set(xscale="log", xlabel="bucket cap (KiB)", ylabel="exposed communication (ms)",
              title="after the end of backward (model)", ylim=(0, None))
    right.legend(loc="center left")
    for ax in (left, right):
        log_ticks(ax.xaxis, [16, 64, 256, 1024, 4096, 16384], ["16", "64", "256", "1Mi", "4Mi", "16Mi"])
    return fig


@figure(3, "## 6. Memory per rank: what data parallelism does not save",
        caption="Memory per rank of the demo GPT at a global batch of 16: only the activations divide by dp; "
                "parameters, gradients and optimizer states are replicated on every rank.",
        alt="A stacked bar chart with four bars for dp = 1, 2, 4 and 8. Each bar has the same three small "
            "bottom segments, parameters, gradients and optimizer states, about 13 MB together; the brown "
            "activations segment on top halves from bar to bar, from about 61 MB to about 8 MB.")
def ch03_memory_per_rank():
    psi, batch = memory.param_count(DEMO), 16
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ranks = [1, 2, 4, 8]
    for i, dp in enumerate(ranks):
        piles = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi,
                 "activations": memory.activation_bytes(DEMO, batch // dp)["total"]}
        bottom = 0.0
        for key, color in PILES.items():
            ax.bar(i, piles[key] / MB, bottom=bottom, color=color, width=0.55, edgecolor="white")
            bottom += piles[key] / MB
        ax.text(i, bottom + 1, f"{bottom:.1f} MB", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(ranks)), [f"dp = {dp}\n{batch // dp} rows per rank" for dp in ranks])
    ax.set(ylabel="MB per rank", title="Demo GPT, float32 AdamW, global batch 16 (memory formulas)")
    ax.grid(False, axis="x")
    legend_below(fig, [Patch(color=c, label=PILE_NAMES[k]) for k, c in PILES.items()])
    return fig


@figure(3, "### Choosing the split",
        caption="The balancer's split of a 16-row batch when rank 1 is (1 + s) times slower, beside "
                "n₁ = B/(2 + s), and the step it buys against the even split.",
        alt="Two line charts against the slowdown s from 0 to 4. Left: rows given to the slow rank by "
            "balanced_split, a staircase falling from 8 to 3, following a dashed curve 16/(2 + s). Right: step "
            "time in row-times of the fast rank; the even split rises in a straight line from 8 to 40, the "
            "balanced split much more slowly, from 8 to about 14.")
def ch03_straggler_split():
    batch = 16
    slowdowns = np.arange(0, 4.001, 0.125)
    rows = [balanced_split(batch, [1.0, 1.0 + s], [0.0, 0.0])[1] for s in slowdowns]
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.1))
    left.step(slowdowns, rows, where="mid", color=RANKS[1], label="balanced_split")
    left.plot(slowdowns, batch / (2 + slowdowns), "--", color=INK, lw=0.8, label="B/(2 + s)")
    left.set(xlabel="rank 1 is (1 + s) times slower: s", ylabel="rows on rank 1", title="the split (B = 16)")
    left.legend()
    even = (batch / 2) * (1 + slowdowns)
    balanced = [max(batch - n, n * (1 + s)) for n, s in zip(rows, slowdowns)]
    right.plot(slowdowns, even, color=ALGORITHMS["naive"], label="even split, 8 + 8")
    right.plot(slowdowns, balanced, color=KIND["comm"], label="balanced split")
    right.set(xlabel="s", ylabel="step time (row-times of rank 0)", title="the slowest rank sets the pace")
    right.legend()
    return fig


# ============================================================================= chapter 4


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


# ============================================================================= chapter 5


@figure(5, "## 2. Schedules as data",
        caption="GPipe and 1F1B for p = 4 stages and m = 8 micro-batches, simulated with ideal timings: the "
                "same step length and the same bubble, in a different order.",
        alt="Two Gantt charts with four rows each. GPipe: each rank runs forwards 0 to 7 in blue, staggered "
            "one slot per rank, then backwards 0 to 7 in orange, staggered back; grey idle at the start of the "
            "lower ranks and the end of the upper ones. 1F1B: rank r runs p − r − 1 forwards, then alternates "
            "one forward and one backward, then the remaining backwards; it ends at the same time as GPipe.")
def ch05_gpipe_and_1f1b():
    p, m = 4, 8
    fig, axes = plt.subplots(2, 1, figsize=(7, 4.6), sharex=True)
    for ax, name in zip(axes, ("gpipe", "1f1b")):
        events = S.simulate(S.all_ranks(name, p, m))
        label = "GPipe" if name == "gpipe" else "1F1B"
        gantt(ax, events, title=f"{label}: bubble {S.bubble_fraction(events):.3f} = (p − 1)/(m + p − 1)")
    axes[-1].set_xlabel("time (forward = 1, backward = 2; numbers are micro-batches)")
    legend_below(fig, kind_patches(["forward", "backward", "wait"]))
    return fig


@figure(5, "## 3. The bubble",
        caption="The bubble against the number of micro-batches, in minidist's definition (idle share of the "
                "step, left) and Megatron-LM's (idle over compute, right); the simulated schedules lie on the "
                "formula.",
        alt="Two line charts against micro-batches m from 1 to 32 on a logarithmic axis, one curve each for "
            "p = 2, 4 and 8 stages. Left: b = (p − 1)/(m + p − 1) falls from (p − 1)/p at m = 1 towards zero, "
            "with dots from simulated 1F1B schedules exactly on the curves. Right: β = (p − 1)/m on a "
            "logarithmic scale, straight falling lines that start above 1 for p = 4 and 8.")
def ch05_bubble():
    ms = np.arange(1, 33)
    dots = [1, 2, 4, 8, 16, 32]
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.3))
    for p, color in zip((2, 4, 8), (RANKS[0], RANKS[1], RANKS[2])):
        b = np.array([S.bubble_theory(p, int(m)) for m in ms])
        left.plot(ms, b, color=color, label=f"p = {p}")
        simulated = [S.bubble_fraction(S.simulate(S.all_ranks("1f1b", p, m))) for m in dots]
        left.plot(dots, simulated, "o", color=color, ms=4)
        right.plot(ms, b / (1 - b), color=color, label=f"p = {p}")
    left.set(xscale="log", xlabel="micro-batches m", ylabel="b = (p − 1)/(m + p − 1)",
             title="idle share of the step (dots: simulated 1F1B)")
    right.set(xscale="log", yscale="log", xlabel="micro-batches m", ylabel="β = b/(1 − b) = (p − 1)/m",
              title="idle time over compute time")
    log_ticks(right.yaxis, [0.03, 0.1, 0.3, 1, 3, 7])
    for ax in (left, right):
        log_ticks(ax.xaxis, dots)
        ax.legend()
    return fig


def _held(events):
    """Micro-batches whose activations a rank holds over time: from a forward's start to its backward's end."""
    changes: dict[float, int] = {}  # a backward ending as the next forward starts: no dip in between
    for name, kind, start, end in events:
        if kind == "forward":
            changes[start] = changes.get(start, 0) + 1
        elif kind == "backward":
            changes[end] = changes.get(end, 0) - 1
    times, held, count = [0.0], [0], 0
    for t in sorted(changes):
        count += changes[t]
        times.append(t)
        held.append(count)
    return times, held


@figure(5, "## 4. Activation memory: where GPipe and 1F1B differ",
        caption="Micro-batches whose activations each stage holds during the step (p = 4, m = 8): GPipe holds "
                "all 8 on every stage, 1F1B at most p − r on stage r.",
        alt="Four small step charts side by side, one per rank, of micro-batches held against time, each with "
            "a dashed GPipe line and a solid 1F1B line. On every rank the GPipe line climbs to 8 during the "
            "forwards and steps back down to 0 during the backwards. The 1F1B line climbs only to 4 on rank 0, "
            "3 on rank 1, 2 on rank 2 and 1 on rank 3, and stays there through the steady state before stepping "
            "down.")
def ch05_in_flight():
    p, m = 4, 8
    runs = {name: (S.all_ranks(name, p, m), S.simulate(S.all_ranks(name, p, m))) for name in ("gpipe", "1f1b")}
    fig, axes = plt.subplots(1, p, figsize=(7, 2.8), sharey=True, sharex=True)
    for rank, ax in enumerate(axes):
        peaks = []
        for name, style in (("gpipe", "--"), ("1f1b", "-")):
            schedules, events = runs[name]
            times, held = _held(events[rank])
            ax.step(times, held, where="post", ls=style, lw=1.6, color=INK if name == "gpipe" else RANKS[rank])
            peaks.append(S.peak_in_flight(schedules[rank]))
        ax.set_title(f"rank {rank}: {peaks[0]} vs {peaks[1]}", fontsize=8.5)
        ax.set_xlabel("time")
    axes[0].set_ylabel("micro-batches held")
    axes[0].set_ylim(0, m + 0.8)
    legend_below(fig, [Line2D([], [], color=INK, ls="--", label="GPipe"),
                       Line2D([], [], color=RANKS[0], label="1F1B (forward = 1, backward = 2)")])
    return fig


@figure(5, "## 5. Why the warm-up is p − rank − 1",
        caption="1F1B with one warm-up forward fewer, the right number, and one more (p = 4, m = 8): fewer "
                "leaves stages waiting for their first gradient, more only holds more activations.",
        alt="Three Gantt charts of four ranks. With warm-up p − r − 2 the ranks show long grey idle gaps in "
            "the middle of the step and it ends far later. With p − r − 1 the steady state alternates forward "
            "and backward with idle time only at the start and end. With p − r the chart ends at the same time "
            "as the middle one, each rank having run one more forward before its first backward.")
def ch05_warmup():
    p, m = 4, 8
    fig, axes = plt.subplots(3, 1, figsize=(7, 6.0), sharex=True)
    warmups = ((-1, "p − r − 2 (one fewer)"), (0, "p − r − 1"), (1, "p − r (one more)"))
    for ax, (delta, label) in zip(axes, warmups):
        schedules = [list(S.one_f_one_b(r, p, m, warmup=max(0, p - r - 1 + delta))) for r in range(p)]
        events = S.simulate(schedules)
        held = ", ".join(str(S.peak_in_flight(s)) for s in schedules)
        gantt(ax, events, title=f"warm-up {label}: bubble {S.bubble_fraction(events):.3f}, micro-batches held {held}")
    axes[-1].set_xlabel("time (forward = 1, backward = 2)")
    legend_below(fig, kind_patches(["forward", "backward", "wait"]))
    return fig


@figure(5, "## 7. Interleaved 1F1B: virtual stages (虚拟流水线阶段)",
        caption="1F1B against interleaved 1F1B with v = 2 chunks per rank (p = 4, m = 8): each rank does the "
                "same work in half-size slots, and the idle stretches at the start and the end are halved.",
        alt="Two Gantt charts of four ranks on one time axis. The 1F1B chart has stage-sized blue and orange "
            "bars with grey idle wedges at the start and end. The interleaved chart has bars half as long, the "
            "second chunk's bars in lighter shades, weaving forwards and backwards of both chunks; its idle "
            "wedges are half as wide and the whole step ends earlier.")
def ch05_interleaved():
    p, m, v = 4, 8, 2
    runs = {"1F1B": S.simulate(S.all_ranks("1f1b", p, m)),
            f"interleaved, v = {v}": S.simulate(S.all_ranks("interleaved", p, m, v), forward=1 / v, backward=2 / v)}
    fig, axes = plt.subplots(2, 1, figsize=(7, 4.6), sharex=True)
    for ax, (label, events) in zip(axes, runs.items()):
        gantt(ax, events, title=f"{label}: bubble {S.bubble_fraction(events):.3f} = "
                                f"(p − 1)/(v·m + p − 1)")
    axes[-1].set_xlabel("time (a whole stage's forward = 1, backward = 2; a chunk's take 1/v)")
    legend_below(fig, kind_patches(["forward", "backward", "wait"])
                 + [Patch(color=lighter(KIND["forward"], 0.45), label="chunk 1 (lighter)")])
    return fig


@figure(5, "## 7. Interleaved 1F1B: virtual stages (虚拟流水线阶段)",
        caption="The interleaved bubble (p − 1)/(v·m + p − 1) for p = 4: v chunks per rank act like v times as "
                "many micro-batches, and the simulated schedules give exactly the formula.",
        alt="A line chart of the bubble against micro-batches m = 4 to 32 for p = 4 stages, three falling "
            "curves for v = 1, 2 and 3 chunks per rank, each lower than the one before, with dots from simulated "
            "schedules exactly on them.")
def ch05_interleaved_bubble():
    p = 4
    ms = np.arange(p, 33, p)
    fig, ax = plt.subplots(figsize=(7, 3.1))
    for v, color in zip((1, 2, 3), (RANKS[0], RANKS[1], RANKS[2])):
        name = "1f1b" if v == 1 else "interleaved"
        ax.plot(ms, [S.bubble_theory(p, int(m), v) for m in ms], color=color,
                label="1F1B (v = 1)" if v == 1 else f"interleaved, v = {v}")
        simulated = [S.bubble_fraction(S.simulate(S.all_ranks(name, p, int(m), v), forward=1 / v, backward=2 / v))
                     for m in ms]
        ax.plot(ms, simulated, "o", color=color, ms=4)
    ax.set(xlabel="micro-batches m (a multiple of p)", ylabel="bubble (idle share of the step)",
           title=f"p = {p}: formula (lines) and simulated schedules (dots)", ylim=(0, None))
    ax.set_xticks(ms)
    ax.legend()
    return fig


# ============================================================================= chapter 6


@figure(6, "## 1. Two ways to cut a matrix product",
        caption="The Megatron MLP on t = 2 ranks at the demo's width: W₁ is cut by output features and W₂ by "
                "input features, so each rank's slice of H feeds its slice of W₂ directly and only the partial "
                "outputs need adding up.",
        alt="A diagram of matrices drawn to scale from left to right: the input X, replicated, in grey; W₁ "
            "transposed, C by 4C, split into two vertical halves coloured for rank 0 and rank 1; the hidden "
            "activation H, also split into two vertical halves by rank, after GELU; W₂ transposed, 4C by C, "
            "split into two horizontal halves by rank; and two partial outputs Y₀ and Y₁, one per rank, joined "
            "by an all-reduce into the output Y.")
def ch06_column_row_split():
    t, c = 2, DEMO.n_embd
    hidden = 4 * c
    share = divide(hidden, t, "MLP features")
    unit = 1 / 64  # drawing units per feature
    tokens = 128 * unit
    fig, ax = plt.subplots(figsize=(7, 3.0))
    ax.set_axis_off()
    mid = hidden * unit / 2

    def box(x, w, h, color, label=None, below=None):
        ax.add_patch(Rectangle((x, mid - h / 2), w, h, facecolor=color, edgecolor=INK, linewidth=0.8))
        if label:
            ax.text(x + w / 2, mid, label, ha="center", va="center", fontsize=8)
        if below:
            ax.text(x + w / 2, mid - h / 2 - 0.25, below, ha="center", va="top", fontsize=7.5)

    def sign(x, text):
        ax.text(x, mid, text, ha="center", va="center", fontsize=11)

    x = 0.0
    box(x, c * unit, tokens, "#e0e0e0", "X", f"X\n(B·T × {c})\nreplicated")
    x += c * unit + 0.5
    sign(x, "·")
    x += 0.5
    for r in range(t):  # W1ᵀ: columns r·share .. (r+1)·share
        ax.add_patch(Rectangle((x + r * share * unit, mid - c * unit / 2), share * unit, c * unit,
                               facecolor=RANKS[r], edgecolor=INK, linewidth=0.8))
        ax.text(x + (r + 0.5) * share * unit, mid, f"W₁,{str(r).translate(SUBSCRIPT)}ᵀ", ha="center", va="center",
                fontsize=8)
    ax.text(x + hidden * unit / 2, mid - c * unit / 2 - 0.25, f"W₁ᵀ ({c} × {hidden}):\ncolumn-parallel",
            ha="center", va="top", fontsize=7.5)
    x += hidden * unit + 0.9
    sign(x, "→")
    ax.text(x, mid + 0.4, "GELU", ha="center", va="bottom", fontsize=7.5)
    x += 0.9
    for r in range(t):  # H: the same columns, on rank r
        ax.add_patch(Rectangle((x + r * share * unit, mid - tokens / 2), share * unit, tokens,
                               facecolor=RANKS[r], edgecolor=INK, linewidth=0.8))
        ax.text(x + (r + 0.5) * share * unit, mid, f"H{str(r).translate(SUBSCRIPT)}", ha="center", va="center",
                fontsize=8)
    ax.text(x + hidden * unit / 2, mid - tokens / 2 - 0.25, f"H (B·T × {hidden}):\nrank r holds {share} features",
            ha="center", va="top", fontsize=7.5)
    x += hidden * unit + 0.5
    sign(x, "·")
    x += 0.5
    for r in range(t):  # W2ᵀ: rows r·share .. (r+1)·share
        ax.add_patch(Rectangle((x, mid + hidden * unit / 2 - (r + 1) * share * unit), c * unit, share * unit,
                               facecolor=RANKS[r], edgecolor=INK, linewidth=0.8))
        ax.text(x + c * unit / 2, mid + hidden * unit / 2 - (r + 0.5) * share * unit,
                f"W₂,{str(r).translate(SUBSCRIPT)}ᵀ",
                ha="center", va="center", fontsize=8)
    ax.text(x + c * unit / 2, mid - hidden * unit / 2 - 0.25, f"W₂ᵀ ({hidden} × {c}):\nrow-parallel",
            ha="center", va="top", fontsize=7.5)
    x += c * unit + 0.5
    sign(x, "=")
    x += 0.5
    for r in range(t):
        y = mid + (0.5 - r) * (tokens + 0.5) - tokens / 2
        ax.add_patch(Rectangle((x, y), c * unit, tokens, facecolor=RANKS[r], edgecolor=INK, linewidth=0.8))
        ax.text(x + c * unit / 2, y + tokens / 2, f"Y{str(r).translate(SUBSCRIPT)}", ha="center", va="center",
                fontsize=8)
    ax.text(x + c * unit / 2, mid - tokens - 0.5, "partial sums", ha="center", va="top", fontsize=7.5)
    x += c * unit + 0.3
    ax.add_patch(FancyArrowPatch((x, mid), (x + 2.0, mid), arrowstyle="-|>", mutation_scale=10, color=INK))
    ax.text(x + 1.0, mid - 0.2, "g:\nall-reduce", ha="center", va="top", fontsize=7.5)
    x += 2.2
    box(x, c * unit, tokens, SUM, "Y", "Y = Y₀ + Y₁\n+ bias")
    x += c * unit
    ax.set_xlim(-0.2, x + 0.2)
    ax.set_ylim(mid - hidden * unit / 2 - 1.3, mid + hidden * unit / 2 + 0.2)
    ax.set_aspect("equal")
    ax.set_title(f"Y = GELU(X W₁ᵀ) W₂ᵀ on t = {t} ranks (demo width C = {c})", loc="left")
    legend_below(fig, [Patch(color=RANKS[r], label=f"held by rank {r}") for r in range(t)]
                 + [Patch(color="#e0e0e0", label="replicated"), Patch(color=SUM, label="summed over ranks")])
    return fig


@figure(6, "## 2. f and g: why they are conjugate",
        caption="The demo GPT's first MLP cut over 2 ranks, run through minidist's autograd: forward, the "
                "ranks' partial outputs add up to the serial output (g); backward, their partial input "
                "gradients add up to the serial gradient (f).",
        alt="Two rows of four heat maps of six tokens by the first 24 features. Top row, forward: rank 0's "
            "partial output and rank 1's partial output look different from each other; their sum plus the "
            "bias and the serial output look identical. Bottom row, backward: rank 0's and rank 1's gradients "
            "with respect to the input differ; their sum and the serial input gradient look identical. The "
            "largest difference from the serial result is printed under each row's last map, at the level of "
            "rounding or zero.")
def ch06_f_and_g():
    t, tokens, shown = 2, 6, 24
    with default_dtype("float64"):
        mlp = GPT(DEMO, seed=0).h[0].mlp
        rng = np.random.default_rng(0)
        X, G = rng.normal(size=(tokens, DEMO.n_embd)), rng.normal(size=(tokens, DEMO.n_embd))
        x = Tensor(X.copy(), requires_grad=True)
        y = mlp(x)
        (y * Tensor(G)).sum().backward()
        serial_y, serial_dx = y.data, x.grad
        w1, b1 = mlp.c_fc.weight.data, mlp.c_fc.bias.data
        w2, b2 = mlp.c_proj.weight.data, mlp.c_proj.bias.data
        share = divide(w1.shape[0], t, "MLP features")
        partial_y, partial_dx = [], []
        for r in range(t):
            cols = slice(r * share, (r + 1) * share)
            xr = Tensor(X.copy(), requires_grad=True)  # f forward: every rank gets the same x
            h = F.gelu(F.linear(xr, Tensor(np.ascontiguousarray(w1[cols])), Tensor(b1[cols].copy())))
            yr = F.linear(h, Tensor(np.ascontiguousarray(w2[:, cols])))  # partial sum; the bias after the sum
            (yr * Tensor(G)).sum().backward()  # g backward: every rank receives the same dL/dY
            partial_y.append(yr.data)
            partial_dx.append(xr.grad)
    total_y, total_dx = sum(partial_y) + b2, sum(partial_dx)
    rows = [("forward: Y", partial_y, total_y, serial_y, "Y₀ + Y₁ + bias (g)"),
            ("backward: dL/dX", partial_dx, total_dx, serial_dx, "dX₀ + dX₁ (f)")]
    fig, axes = plt.subplots(2, 4, figsize=(7, 3.3))
    for row, (label, parts, total, serial, summed) in zip(axes, rows):
        scale = np.max(np.abs(serial[:, :shown]))
        names = ("Y₀", "Y₁") if label.startswith("forward") else ("dX₀", "dX₁")
        panels = [(parts[0], f"rank 0: {names[0]}"), (parts[1], f"rank 1: {names[1]}"), (total, summed),
                  (serial, "serial")]
        for ax, (values, title) in zip(row, panels):
            ax.imshow(values[:, :shown], cmap="RdBu_r", vmin=-scale, vmax=scale, aspect="auto")
            ax.set_title(title, fontsize=8.5)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
        diff = np.max(np.abs(total - serial)) / np.max(np.abs(serial))
        row[0].set_ylabel(label, fontsize=8.5)
        row[3].set_xlabel(f"largest difference {diff:.1g}", fontsize=7.5)
    fig.suptitle(f"One MLP of the demo GPT on t = {t} ranks, float64 ({tokens} tokens, first {shown} features)",
                 fontsize=9.5, x=0.02, ha="left")
    return fig


@figure(6, "## 6. Traffic, measured",
        caption="Bytes each rank sends per step, demo GPT: tensor parallelism moves activations, which grow "
                "with the batch; data parallelism moves the gradients once, whatever the batch.",
        alt="Two charts. Left, grouped bars for t = 1, 2 and 4 ranks: tensor parallelism sends about 9.5 MB "
            "at t = 2 and 14 MB at t = 4 per rank, data parallelism's gradient all-reduce about 3.3 and 5 MB. "
            "Right, lines against the batch from 1 to 64 sequences at two ranks: tensor parallelism's bytes "
            "rise in a straight line, data parallelism's stay flat, and the tensor-parallel line crosses above "
            "it at a batch of about 6.")
def ch06_traffic():
    grads = 4 * memory.param_count(DEMO)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.2))
    degrees = [1, 2, 4]
    tp = [cost.tensor_parallel_traffic_per_step(DEMO, 16, t, one_machine=True)["bytes_sent"] / MB for t in degrees]
    dp = [cost.terms("all_reduce", "ring", t, grads)[1] / MB for t in degrees]
    x = np.arange(len(degrees))
    left.bar(x - 0.19, tp, 0.38, color=AXES_COLORS["tp"], label="tensor parallel (activations)")
    left.bar(x + 0.19, dp, 0.38, color=AXES_COLORS["dp"], label="data parallel (gradients)")
    left.set_xticks(x, [f"t = {t}" for t in degrees])
    left.set(ylabel="MB per rank per step", title="batch 16, by the number of ranks")
    left.grid(False, axis="x")
    left.legend(loc="upper left")
    batches = np.arange(1, 65)
    right.plot(batches, [cost.tensor_parallel_traffic_per_step(DEMO, int(b), 2, one_machine=True)["bytes_sent"] / MB
                         for b in batches], color=AXES_COLORS["tp"], label="tensor parallel, t = 2")
    right.axhline(cost.terms("all_reduce", "ring", 2, grads)[1] / MB, color=AXES_COLORS["dp"],
                  label="data parallel, dp = 2")
    right.set(xlabel="batch (sequences of 64 tokens)", ylabel="MB per rank per step", title="2 ranks, by the batch")
    right.legend(loc="upper left")
    fig.suptitle("Demo GPT, float32 (cost.tensor_parallel_traffic_per_step, ring all-reduce)", fontsize=9.5,
                 x=0.02, ha="left")
    return fig


@figure(6, "## 8. Sequence parallelism (序列并行)",
        caption="Activations per rank in the region between g and f, demo GPT: tensor parallelism keeps it "
                "whole on every rank, sequence parallelism keeps 1/t of it plus the gathered inputs of the "
                "column-parallel layers.",
        alt="A grouped bar chart for t = 1, 2 and 4. Each group has a tensor-parallel bar of the same height, "
            "about 23 MB, and a sequence-parallel bar made of two stacked parts: the region divided by t, and "
            "a small gathered-inputs part on top. The sequence-parallel bar is lower by the saving written above "
            "it, about 7 MB at t = 2 and 13 MB at t = 4.")
def ch06_sequence_parallel():
    batch, degrees = 16, [1, 2, 4]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, t in enumerate(degrees):
        sp = memory.sequence_parallel_activation_bytes(DEMO, batch, t)
        region, kept, gathered = sp["region"] / MB, sp["region"] / t / MB, sp["gathered"] / MB
        ax.bar(i - 0.19, region, 0.38, color=AXES_COLORS["tp"])
        ax.bar(i + 0.19, kept, 0.38, color=lighter(AXES_COLORS["tp"], 0.4))
        ax.bar(i + 0.19, gathered, 0.38, bottom=kept, color=PILES["activations"])
        if t > 1:
            ax.text(i + 0.19, kept + gathered + 0.4, f"saves {sp['saved'] / MB:.1f} MB", ha="center", fontsize=7.5)
    ax.set_xticks(range(len(degrees)), [f"t = {t}" for t in degrees])
    ax.set(ylabel="MB per rank", title="Demo GPT, batch 16, float32 (memory.sequence_parallel_activation_bytes)",
           ylim=(0, memory.sequence_parallel_activation_bytes(DEMO, batch, 1)["region"] / MB * 1.12))
    ax.grid(False, axis="x")
    legend_below(fig, [Patch(color=AXES_COLORS["tp"], label="tensor parallel: the region, whole"),
                       Patch(color=lighter(AXES_COLORS["tp"], 0.4), label="sequence parallel: region / t"),
                       Patch(color=PILES["activations"], label="+ gathered inputs")], ncols=3)
    return fig


# ============================================================================= chapter 7


@figure(7, "## All-reduce, five ways",
        caption="The ring all-reduce on 4 ranks, step by step in the simulated world, each rank starting with "
                "2^r: a cell's binary value lists the ranks it contains, and after step 3 rank r owns the full "
                "chunk r, after step 6 everyone owns everything.",
        alt="Seven small four-by-four tables, rows ranks 0 to 3 and columns chunks 0 to 3, each cell showing "
            "a 4-bit binary number and shaded by how many ranks it contains. The top row of tables, the "
            "reduce-scatter, shows the start and steps 1 to 3: at the start every cell of rank r holds the one "
            "bit of rank r; step by step cells gain bits along diagonals until each rank's own chunk reads 1111. "
            "The bottom row, the all-gather, shows steps 4 to 6: the complete 1111 values spread until every "
            "cell is 1111 and darkest.")
def ch07_ring_steps():
    n = 4
    snapshots = sim.simulate(alg.all_reduce_ring, [np.full(n, 2 ** r, dtype=np.int64) for r in range(n)], np.add)
    cmap = ListedColormap(["#edf8e9", "#bae4b3", "#74c476", "#238b45"])
    rows = [(range(0, n), "reduce-scatter: each chunk collects one rank per step"),
            (range(n, 2 * n - 1), "all-gather: the complete chunks go round")]
    fig, axes = plt.subplots(2, 1, figsize=(7, 4.4))
    gap = n + 1.2
    for ax, (steps, label) in zip(axes, rows):
        ax.set_axis_off()
        for i, k in enumerate(steps):
            for r, array in enumerate(snapshots[k]):
                for c, value in enumerate(array):
                    bits = bin(int(value)).count("1")
                    ax.add_patch(Rectangle((i * gap + c, r), 1, 1, facecolor=cmap(bits - 1), edgecolor="white", lw=1.2))
                    ax.text(i * gap + c + 0.5, r + 0.5, f"{int(value):04b}", ha="center", va="center", fontsize=7,
                            color="white" if bits == 4 else INK)
            ax.text(i * gap + n / 2, -0.25, "start" if k == 0 else f"after step {k}", ha="center", va="bottom",
                    fontsize=8.5)
            for c in range(n):
                ax.text(i * gap + c + 0.5, n + 0.08, str(c), ha="center", va="top", fontsize=6.5, color="#666666")
        for r in range(n):
            ax.text(-0.15, r + 0.5, f"rank {r}", ha="right", va="center", fontsize=7.5)
        ax.text(-0.15, n + 0.08, "chunk", ha="right", va="top", fontsize=6.5, color="#666666")
        ax.text(-1.6, -0.9, label, ha="left", va="bottom", fontsize=9)
        ax.set_xlim(-1.6, n * gap)
        ax.set_ylim(n + 0.8, -1.1)
        ax.set_aspect("equal")
    legend_below(fig, [Patch(color=cmap(b), label=f"{b + 1} rank{'s' if b else ''} summed") for b in range(4)])
    return fig


COLLECTIVE_ALGORITHMS = {"naive": alg.all_reduce_naive, "tree": alg.all_reduce_tree,
                         "recursive_doubling": alg.all_reduce_recursive_doubling,
                         "halving_doubling": alg.all_reduce_halving_doubling, "ring": alg.all_reduce_ring}


@figure(7, "### Why the ring sends 2(N-1)/N · S per rank, and why that is optimal",
        caption="Bytes sent by the busiest rank in one all-reduce of S bytes, counted in the simulated world "
                "for 2 to 8 ranks: only the ring (and halving-doubling, when N is a power of two) reaches the "
                "lower bound 2(N−1)/N.",
        alt="A line chart of the busiest rank's bytes sent divided by S against the number of ranks from 2 to "
            "8, one line per algorithm. Naive climbs straight from 1 to 7. Tree and recursive doubling coincide, "
            "stepping up with log2 of N from 1 to 3. Halving-doubling touches the dashed lower bound at 2, 4 and 8 "
            "ranks and rises above it in between. The ring lies on the dashed bound 2(N−1)/N everywhere.")
def ch07_bytes_per_rank():
    count, ranks = 840, np.arange(2, 9)
    size = count * 8
    fig, ax = plt.subplots(figsize=(7, 3.4))
    styles = {"tree": dict(lw=4, alpha=0.6), "recursive_doubling": dict(ls="--")}  # the two coincide
    for name, function in COLLECTIVE_ALGORITHMS.items():
        busiest = []
        for n in ranks:
            sim.simulate(function, [np.ones(count) for _ in range(n)], np.add)
            busiest.append(max(sim.simulate.last_traffic["bytes_sent"]) / size)
        ax.plot(ranks, busiest, marker="o", color=ALGORITHMS[name], label=ALGORITHM_NAMES[name], ms=4,
                **styles.get(name, {}))
    fine = np.linspace(2, 8, 100)
    ax.plot(fine, 2 * (fine - 1) / fine, "--", color=INK, lw=0.9, label="lower bound 2(N−1)/N")
    ax.set(xlabel="ranks N", ylabel="busiest rank's bytes sent / S",
           title="One all-reduce of S bytes, simulated rank by rank (comm.sim)")
    ax.legend(loc="upper left", ncols=2)
    return fig


@figure(7, "## The α-β cost model",
        caption="Every all-reduce algorithm's predicted time relative to the fastest, over array sizes from a "
                "byte to a gigabyte: fewest steps wins small arrays, fewest bytes wins large ones.",
        alt="Two line charts for 4 and 32 ranks of predicted time divided by the fastest algorithm's, against "
            "the array size from 1 byte to 1 GB on a logarithmic axis. For small arrays recursive doubling is "
            "at 1 and the ring and naive are several times slower; for large arrays halving-doubling and the "
            "ring reach 1 while recursive doubling, the tree and naive are from 1.5 to about 30 times slower. A "
            "dotted vertical line marks where halving-doubling overtakes recursive doubling.")
def ch07_alpha_beta():
    sizes = np.logspace(0, 9, 200)
    fig, axes = plt.subplots(1, 2, figsize=(7, 3.4), sharey=True)
    for ax, n in zip(axes, (4, 32)):
        times = {name: np.array([cost.predict("all_reduce", name, n, s, **cost.AUTO_COST) for s in sizes])
                 for name in COLLECTIVE_ALGORITHMS}
        best = np.min(np.stack(list(times.values())), axis=0)
        for name, t in times.items():
            ax.plot(sizes, t / best, color=ALGORITHMS[name], label=ALGORITHM_NAMES[name])
        at = cost.crossover("all_reduce", "halving_doubling", "recursive_doubling", n, **cost.AUTO_COST)
        ax.axvline(at, color=INK, ls=":", lw=0.8)
        ax.text(at * 1.3, 40, f"{at / 1e3:.0f} KB", fontsize=7.5)
        ax.set(xscale="log", yscale="log", xlabel="array size S", title=f"N = {n} ranks", ylim=(0.9, 100))
        log_ticks(ax.xaxis, [1, 1e3, 1e6, 1e9], ["1 B", "1 KB", "1 MB", "1 GB"])
        log_ticks(ax.yaxis, [1, 2, 5, 10, 20, 50, 100])
    axes[0].set_ylabel("time / fastest algorithm's")
    fig.suptitle("Predicted by cost.predict with cost.AUTO_COST: α = 20 µs, β = 0.5 ns/B, γ = 0.1 ns/B",
                 fontsize=9.5, x=0.02, ha="left")
    legend_below(fig, [Line2D([], [], color=ALGORITHMS[k], label=ALGORITHM_NAMES[k]) for k in COLLECTIVE_ALGORITHMS])
    return fig


@figure(7, "### Its cost on two levels",
        caption="The flat ring against the hierarchical all-reduce on machines of 8 A100s (NVLink inside, the "
                "network between): the hierarchy pays the network's latency 2(L−1) times instead of 2(N−1), "
                "which decides small and medium arrays; for large ones the two meet.",
        alt="Two log-log line charts of predicted time. Left, against the array size from 1 KB to 10 GB on 4 "
            "machines of 8 GPUs: the hierarchical all-reduce is several times faster up to about a megabyte, "
            "and the two lines merge above about 100 MB. Right, against the number of machines from 2 to 64 for "
            "a 1 MB array: the flat ring's time grows steadily with the number of GPUs, the hierarchical one "
            "much more slowly.")
def ch07_two_level():
    device = DEVICES["a100-80gb"]
    per_node = device.gpus_per_node
    links = dict(alpha_inside=device.intra_latency, beta_inside=1 / device.intra_bandwidth,
                 alpha_between=device.inter_latency, beta_between=1 / device.inter_bandwidth)
    names = {"ring": "flat ring", "hierarchical": "hierarchical"}
    sizes = np.logspace(3, 10, 120)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.3))
    for name, label in names.items():
        left.plot(sizes, [cost.predict_two_level(name, per_node, 4, s, **links) for s in sizes],
                  color=ALGORITHMS[name], label=label)
    left.set(xscale="log", yscale="log", xlabel="array size S", ylabel="predicted time",
             title=f"4 machines × {per_node} GPUs, by the size")
    log_ticks(left.xaxis, [1e3, 1e5, 1e7, 1e9], [size_label(x) for x in (1e3, 1e5, 1e7, 1e9)])
    seconds = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1]
    labels = ["10 µs", "0.1 ms", "1 ms", "10 ms", "0.1 s", "1 s"]
    log_ticks(left.yaxis, seconds, labels)
    left.legend()
    machines = 2 ** np.arange(1, 7)
    for name, label in names.items():
        right.plot(machines, [cost.predict_two_level(name, per_node, int(L), 1e6, **links) for L in machines], "o-",
                   ms=4, color=ALGORITHMS[name], label=label)
    right.set(xscale="log", yscale="log", xlabel=f"machines L ({per_node} GPUs each)", ylabel="predicted time",
              title="1 MB, by the number of machines")
    log_ticks(right.xaxis, machines)
    log_ticks(right.yaxis, seconds[:4], labels[:4])
    right.legend()
    fig.suptitle(f"{device.name}: {device.intra_bandwidth / GB:.0f} GB/s inside a machine, "
                 f"{device.inter_bandwidth / GB:.0f} GB/s between (cost.predict_two_level)", fontsize=9.5,
                 x=0.02, ha="left")
    return fig


# ============================================================================= chapter 8


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


# ============================================================================= chapter 9


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


# ============================================================================= chapter 10


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


# ============================================================================= chapter 11


@figure(11, "## 1. What backward keeps",
        caption="Activations of all 96 layers of GPT-3 175B at micro-batch 1, Megatron-LM's count, against "
                "the sequence length: the attention weights' quadratic term dominates, selective recomputation "
                "removes exactly it, full recomputation keeps only each layer's input.",
        alt="A log-log line chart of gigabytes against sequence length from 512 to 32768 tokens, with a dashed "
            "line at 80 GB. No recomputation rises steeply, quadratically for long sequences, passing 80 GB "
            "before 1024 tokens and reaching 275 GB at 2048, marked with a dot. Selective recomputation rises "
            "linearly and stays about three times lower at 2048. Full recomputation rises linearly from about "
            "1 GB, far below.")
def ch11_activation_ledger():
    L, h, a = GPT3.n_layer, GPT3.n_embd, GPT3.n_head
    seqs = 2 ** np.arange(9, 16)
    none = np.array([L * memory.megatron_activation_bytes(1, int(s), h, a) for s in seqs])
    core = np.array([L * 5 * a * int(s) ** 2 for s in seqs])  # the softmax, its mask and output: 5as²b bytes
    full = np.array([L * 2 * int(s) * h for s in seqs])        # each layer's 16-bit input
    fig, ax = plt.subplots(figsize=(7, 3.3))
    ax.loglog(seqs, none / GB, "o-", ms=3, color=PILES["activations"], label="no recomputation: sbh(34 + 5as/h)")
    ax.loglog(seqs, (none - core) / GB, "o-", ms=3, color=KIND["backward"], label="selective: 34 sbh")
    ax.loglog(seqs, full / GB, "o-", ms=3, color=KIND["forward"], label="full: 2 sbh (one input per layer)")
    ax.axhline(DEVICES["a100-80gb"].memory / GB, color=INK, ls="--", lw=0.8)
    ax.text(seqs[0], 80 * 1.15, "80 GB", fontsize=7.5)
    at = L * memory.megatron_activation_bytes(1, 2048, h, a) / GB
    ax.plot([2048], [at], "o", color=INK)
    ax.annotate(f"{at:.0f} GB at 2048", (2048, at), xytext=(10, -4), textcoords="offset points", fontsize=8)
    log_ticks(ax.xaxis, seqs)
    log_ticks(ax.yaxis, [1, 10, 100, 1000, 10000], ["1", "10", "100", "1,000", "10,000"])
    ax.set(xlabel="sequence length s", ylabel="GB, all 96 layers",
           title="GPT-3 175B, micro-batch 1, fp16 (memory.megatron_activation_bytes)")
    ax.legend(loc="upper left")
    return fig


def _step_flops(config, batch: int) -> tuple[float, float]:
    """(forward FLOPs of the blocks, of which the attention cores), from the planner's GEMM list."""
    gemms = layer_gemms(batch, config.block_size, config.n_embd, config.n_head, 1)
    layer = sum(2 * count * m * n * k for count, m, n, k in gemms)
    core = sum(2 * count * m * n * k for count, m, n, k in gemms[1:3])  # scores and weighted values
    return config.n_layer * layer, config.n_layer * core


@figure(11, "## 2. Full recomputation: how many segments",
        caption="Full recomputation's memory against its number of segments k (left), and memory against "
                "extra compute for every setting of the demo GPT (right): one block per segment keeps the "
                "least, for about a third more compute.",
        alt="Two charts. Left, for an 8-layer GPT, megabytes against segments k from 1 to 8: kept after forward "
            "rises slowly from 0.7 to 0.9 MB; the peak falls from above the no-recomputation line at k = 1 to "
            "its lowest at k = 8, with a plateau for k from 4 to 7. Right, for the demo GPT, a scatter of peak "
            "activation megabytes against extra compute in percent: no recomputation at 0 percent and the "
            "highest memory, selective a few percent and slightly lower, full with 1, 2 and 4 segments at about "
            "32 percent with decreasing memory.")
def ch11_recompute_tradeoff():
    curve = GPTConfig(vocab_size=256, block_size=32, n_layer=8, n_head=4, n_embd=32)
    ks = np.arange(1, 9)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.3))
    full = [recompute_cost.predicted_activation_bytes(curve, 8, "full", int(k)) for k in ks]
    left.plot(ks, [f["peak"] / MB for f in full], "o-", ms=4, color=PILES["activations"],
              label="peak: kept + one rebuilt segment")
    left.plot(ks, [f["kept"] / MB for f in full], "s-", ms=4, color=KIND["forward"], label="kept after forward")
    left.axhline(recompute_cost.predicted_activation_bytes(curve, 8)["peak"] / MB, color=INK, ls="--", lw=0.8,
                 label="no recomputation")
    left.set(xlabel="segments k", ylabel="MB", title="8 blocks of width 32, batch 8", ylim=(0, None))
    left.legend(loc="center right", fontsize=7)
    batch = 16
    blocks, cores = _step_flops(DEMO, batch)
    head = 2 * batch * DEMO.block_size * DEMO.n_embd * DEMO.vocab_size
    step = 3 * (blocks + head)  # forward, and a backward of twice its FLOPs
    settings = [("none", None, 0.0), ("selective", None, cores), ("full, k = 1", 1, blocks),
                ("full, k = 2", 2, blocks), ("full, k = 4", 4, blocks)]
    for label, k, extra in settings:
        mode = label.split(",")[0]
        peak = recompute_cost.predicted_activation_bytes(DEMO, batch, mode, k)["peak"] / MB
        color = {"none": PILES["activations"], "selective": KIND["backward"], "full": KIND["forward"]}[mode]
        right.plot(100 * extra / step, peak, "o", color=color, ms=6)
        right.annotate(label, (100 * extra / step, peak), xytext=(6, -11 if mode == "selective" else 3),
                       textcoords="offset points", fontsize=7.5)
    right.set(xlabel="extra compute (% of the step's FLOPs)", ylabel="peak activations (MB)",
              title="demo GPT, batch 16", xlim=(-3, 45), ylim=(0, None))
    return fig


@figure(11, "## 5. Context parallelism, and the causal mask's uneven work",
        caption="Which rank computes which query rows of causal attention, T = 64 on 4 ranks: contiguous "
                "pieces leave rank 3 with nearly seven times rank 0's scores, the zigzag split gives every rank "
                "the same.",
        alt="Two triangular pictures of the causal mask, 64 query rows by 64 key columns, with the visible lower "
            "triangle coloured by the rank that holds each query row, and a bar chart. Contiguous: four "
            "horizontal bands from top to bottom for ranks 0 to 3, the lowest band much wider in area. Zigzag: "
            "eight bands in the order 0, 1, 2, 3, 3, 2, 1, 0, so every rank has one narrow top band and one wide "
            "bottom band. Bars of unmasked scores per rank: contiguous 136, 392, 648 and 904; zigzag 520 each.")
def ch11_causal_split():
    T, n = 64, 4
    splits = {kind: SequenceSplit(T, n, kind) for kind in ("contiguous", "zigzag")}
    fig, axes = plt.subplots(1, 3, figsize=(7, 2.9), width_ratios=[1, 1, 1.15])
    cmap = ListedColormap(RANKS[:n])
    visible = np.tril(np.ones((T, T), dtype=bool))
    for ax, (kind, split) in zip(axes, splits.items()):
        owner = np.empty(T)
        for r in range(n):
            owner[split.positions(r)] = r
        image = np.where(visible, owner[:, None], np.nan)
        ax.imshow(image, cmap=cmap, vmin=-0.5, vmax=n - 0.5, interpolation="nearest")
        ax.set(title=kind, xlabel="key position", ylabel="query position")
        ax.grid(False)
    x = np.arange(n)
    for offset, (kind, split) in zip((-0.19, 0.19), splits.items()):
        scores = [split.unmasked_scores(r) for r in range(n)]
        axes[2].bar(x + offset, scores, 0.38, color=RANKS[:n], edgecolor=INK,
                    hatch="" if kind == "contiguous" else "///", linewidth=0.5)
    axes[2].axhline(T * (T + 1) / 2 / n, color=INK, ls="--", lw=0.8)
    axes[2].set_xticks(x, [f"rank {r}" for r in range(n)])
    axes[2].set(ylabel="unmasked scores", title="per sequence and head")
    axes[2].grid(False, axis="x")
    legend_below(fig, [Patch(facecolor="white", edgecolor=INK, label="contiguous"),
                       Patch(facecolor="white", edgecolor=INK, hatch="///", label="zigzag"),
                       Line2D([], [], color=INK, ls="--", label="fair share T(T+1)/2N")])
    return fig


@figure(11, "## 8. Which algorithm, and how many ranks",
        caption="Bytes each rank sends per attention layer for one 4096-token sequence with 16 heads of 64 in "
                "bf16: ring attention's grow towards 6·B·H·T·D, Ulysses' fall as ranks are added, until N "
                "reaches the number of heads.",
        alt="A line chart of megabytes per rank against context-parallel ranks N from 2 to 64 on a logarithmic "
            "axis. Ring attention rises from about 25 MB at N = 2 and levels off near 50 MB. Ulysses falls from "
            "about 17 MB at N = 2 to about 4 MB at N = 16, where its line stops because N cannot exceed the 16 "
            "heads.")
def ch11_ring_vs_ulysses():
    batch, heads, length, head_dim, itemsize = 1, 16, 4096, 64, 2
    ring_ranks = 2 ** np.arange(1, 7)
    ulysses_ranks = ring_ranks[ring_ranks <= heads]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(ring_ranks, [ring_attention_traffic(batch, heads, length, head_dim, int(n), itemsize)["bytes"] / MB
                         for n in ring_ranks], "o-", color=ALGORITHMS["ring"], label="ring attention")
    ax.plot(ulysses_ranks, [ulysses_traffic(batch, heads, length, head_dim, int(n), itemsize)["bytes"] / MB
                            for n in ulysses_ranks], "s-", color=ALGORITHMS["halving_doubling"],
            label="DeepSpeed-Ulysses (N ≤ H)")
    ax.axhline(6 * batch * heads * length * head_dim * itemsize / MB, color=INK, ls=":", lw=0.8,
               label="6·B·H·T·D elements")
    ax.set_xscale("log", base=2)
    log_ticks(ax.xaxis, ring_ranks)
    ax.set(xlabel="context-parallel ranks N", ylabel="MB per rank and attention",
           title="T = 4096, 16 heads of 64, bf16, forward + backward (ring_attention_traffic, ulysses_traffic)",
           ylim=(0, 60))
    ax.legend(loc="center right")
    return fig


MOE_CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, num_experts=8)


def _dropped(probs: np.ndarray, k: int, capacity_factor: float) -> int:
    """Choices the first-come, first-served rule drops at this capacity factor (the layer's own routing code)."""
    experts = moe.top_k_experts(probs, k)
    counts = moe.choice_counts(experts, probs.shape[1])[None]  # one slice: (1, k, E)
    capacity = moe.expert_capacity(probs.shape[0], probs.shape[1], k, capacity_factor)
    kept = np.clip(capacity - moe.queue_starts(counts), 0, counts)
    return int(counts.sum() - kept.sum())


@figure(11, "## 9. Mixture of experts",
        caption="Routing of an untrained 8-expert MoE GPT, first layer, 256 tokens: how many tokens choose "
                "each expert against its capacity (left), and how many choices are dropped as the capacity "
                "factor grows (right).",
        alt="Two charts. Left, bars of tokens per expert for experts 0 to 7 with top-1 routing, uneven between "
            "about 19 and 41, with dashed horizontal lines at the capacity for factors 1.0 (32 tokens) and 1.25 "
            "(40 tokens); the bars above a line are the dropped tokens. Right, dropped choices against the "
            "capacity factor from 0.5 to 3 for top-1 and top-2 routing: both fall steeply, top-1 from 128 to 0 "
            "by a factor of 1.5, top-2 from 256 to 0 by 2.0.")
def ch11_moe_capacity():
    batch = 16
    x, y = make_task("sort", MOE_CONFIG["block_size"], seed=0).get_batch(0, batch)
    probs = {}
    with default_dtype("float64"):
        for k in (1, 2):
            model = moe.MoEGPT(moe.MoEConfig(**MOE_CONFIG, top_k=k), seed=0)
            model(x, y)
            probs[k] = model.h[0].mlp.routing.probs
    experts = MOE_CONFIG["num_experts"]
    tokens = probs[1].shape[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.3))
    counts = moe.choice_counts(moe.top_k_experts(probs[1], 1), experts)[0]
    left.bar(range(experts), counts, color=RANKS[2], width=0.6)
    for factor, style in ((1.0, "--"), (1.25, ":")):
        capacity = moe.expert_capacity(tokens, experts, 1, factor)
        left.axhline(capacity, color=INK, ls=style, lw=0.9, label=f"capacity at C = {factor}: {capacity}")
    left.set(xlabel="expert", ylabel="tokens (first choices)", title=f"top-1, {tokens} tokens",
             ylim=(0, max(counts) * 1.3))
    left.set_xticks(range(experts))
    left.grid(False, axis="x")
    left.legend(loc="upper left", fontsize=7)
    factors = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
    for k, color in ((1, RANKS[2]), (2, RANKS[1])):
        right.plot(factors, [_dropped(probs[k], k, c) for c in factors], "o-", color=color,
                   label=f"top-{k} (of {k * tokens} choices)")
    right.set(xlabel="capacity factor C", ylabel="dropped choices",
              title="⌈k·N/E·C⌉ per expert, first come first served")
    right.legend()
    return fig


# ----------------------------------------------------------------------------- writing


def markdown(fig: Figure, folder: str = "figures") -> str:
    """The image reference to put under `fig.after` in its chapter: the picture, then its caption."""
    return f"![{fig.alt}]({folder}/{fig.name}.svg)\n\n*{fig.caption}*\n"


def write_figure(fig: Figure, out: Path) -> Path:
    """Draw one figure and write it as OUT/name.svg (deterministic bytes)."""
    with plt.rc_context(STYLE):
        drawing = fig.draw()
        try:
            path = Path(out) / f"{fig.name}.svg"
            drawing.savefig(path, format="svg", metadata={"Date": None})
        finally:
            plt.close(drawing)
    return path


def write_figures(out: Path = DEFAULT_OUT, names=None, progress: bool = True) -> list[Figure]:
    """Write every figure (or those named) into `out` as SVG; returns the `Figure`s written, in book order."""
    unknown = set(names or ()) - {f.name for f in FIGURES}
    if unknown:
        raise ValueError(f"no figure named {', '.join(sorted(unknown))}; `python site/figures.py --list` lists them")
    chosen = [f for f in FIGURES if names is None or f.name in names]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i, fig in enumerate(chosen, 1):
        t = time.perf_counter()
        write_figure(fig, out)
        if progress:
            print(f"[figures] {i:2d}/{len(chosen)} {fig.name:32s} {time.perf_counter() - t:5.2f} s", file=sys.stderr,
                  flush=True)
    if progress:
        print(f"[figures] {len(chosen)} figures in {time.perf_counter() - start:.1f} s -> {out}", file=sys.stderr,
              flush=True)
    return chosen


def manifest() -> str:
    """The figures as a Markdown table: name, chapter, heading, caption."""
    lines = ["| name | chapter | after | caption |", "|---|---|---|---|"]
    lines += [f"| {f.name} | {f.chapter} | {f.after} | {f.caption} |" for f in FIGURES]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Draw the book's figures from minidist's code, as SVG.")
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT, help="folder (default: chapters/figures)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these figures")
    parser.add_argument("--list", action="store_true", help="print the manifest as a Markdown table and exit")
    args = parser.parse_args(argv)
    if args.list:
        print(manifest())
        return 0
    try:
        write_figures(args.out, args.only)
    except ValueError as error:
        print(f"figures: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
