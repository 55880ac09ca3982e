"""Per-rank timelines of what each rank did when, drawn as Gantt charts (chapters 3-5).

One idea: a claim such as "communication overlaps with backward" or "the pipeline bubble is
(p-1)/(m+p-1)" is shown by recording, on every rank, the start and end of each piece of work
and drawing them on one time axis. All ranks of a job on one machine read the same monotonic
clock (`time.perf_counter` is CLOCK_MONOTONIC on Linux), so their events line up directly.
"""
from __future__ import annotations

import contextlib
import time

KIND_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "comm": "#55a868", "optimizer": "#8172b3",
               "wait": "#c0c0c0", "compute": "#4c72b0"}


class Timeline:
    """Events (name, kind, start, end) of one rank, in seconds of the shared clock."""

    def __init__(self):
        self.events: list[tuple[str, str, float, float]] = []

    def add(self, name: str, kind: str, start: float, end: float) -> None:
        self.events.append((name, kind, start, end))

    @contextlib.contextmanager
    def span(self, name: str, kind: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, kind, start, time.perf_counter())

    def clear(self) -> None:
        self.events.clear()

    def busy_seconds(self, kinds=("forward", "backward", "compute", "optimizer")) -> float:
        return sum(end - start for _, kind, start, end in self.events if kind in kinds)


def normalise(per_rank: list[list[tuple]]) -> list[list[tuple]]:
    """Shift every rank's events so the earliest event of the job starts at 0."""
    starts = [e[2] for events in per_rank for e in events]
    origin = min(starts) if starts else 0.0
    return [[(n, k, s - origin, e - origin) for n, k, s, e in events] for events in per_rank]


def plot_gantt(per_rank: list[list[tuple]], ax=None, title: str = "", labels: bool = False):
    """Draw one row per rank, one bar per event, coloured by kind (matplotlib)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    per_rank = normalise(per_rank)
    ax = ax or plt.gca()
    seen = set()
    for rank, events in enumerate(per_rank):
        for name, kind, start, end in events:
            # communication is drawn as a thinner bar below compute, so overlap stays visible
            y, height = (rank + 0.05, 0.3) if kind == "comm" else (rank - 0.35, 0.6)
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (y, height),
                           facecolors=KIND_COLORS.get(kind, "#999999"), edgecolor="white", linewidth=0.3)
            seen.add(kind)
            if labels and end - start > 0:
                ax.text((start + end) / 2 * 1e3, rank, name, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(per_rank)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=KIND_COLORS.get(k, "#999999"), label=k) for k in sorted(seen)],
              loc="upper right", fontsize=7)
    return ax
