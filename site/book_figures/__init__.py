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

One module per chapter (ch01.py ... ch11.py), the shared style and registry in common.py."""
import argparse
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import matplotlib.pyplot as plt  # noqa: E402

from book_figures import ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11  # noqa: E402,F401 (they register)
from book_figures.common import DEFAULT_OUT, FIGURES, STYLE, Figure  # noqa: E402


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
