"""What every figure of the book shares: the style, one palette, small drawing helpers, and the
registry (`Figure`, the `@figure` decorator, `FIGURES` in book order)."""
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from matplotlib.colors import to_rgb
from matplotlib.patches import Patch
from matplotlib.ticker import NullLocator

from minidist.core.model import GPTConfig
from minidist.plan import search
from minidist.timeline import KIND_COLORS

ROOT = Path(__file__).resolve().parents[2]
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
    draw: Callable[[], "matplotlib.figure.Figure"]  # noqa: F821 (only named)


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
