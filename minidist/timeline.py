"""Per-rank timelines of what each rank did when, drawn as Gantt charts (chapters 3-5).

One idea: a claim such as "communication overlaps with backward" or "the pipeline bubble is
(p-1)/(m+p-1)" is shown by recording, on every rank, the start and end of each piece of work
and drawing them on one time axis. All ranks of a job on one machine read the same monotonic
clock (`time.perf_counter` is CLOCK_MONOTONIC on Linux, as `time.monotonic` is), so their events
line up directly.

The same recording feeds the trace of a whole job (`--trace PATH`, minidist/trace/, chapter 5):
while a job's `Recorder` is installed in `RECORDER`, every Timeline's events reach it too, and
the engine, the collectives and the messages add theirs. `gantt_events` turns a trace back into
the per-rank events `plot_gantt` draws; `plot_trace` draws a trace file at once. A Recorder is a
Timeline: `plot_gantt([r.events for r in recorders])` draws the recording itself.
"""
from __future__ import annotations

import contextlib
import json
import time

KIND_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "comm": "#55a868", "optimizer": "#8172b3",
               "wait": "#c0c0c0", "compute": "#4c72b0"}


now = time.perf_counter  # the clock of every event: CLOCK_MONOTONIC, shared by the processes of a machine

RECORDER = None  # the job's trace.recorder.Recorder while a trace records (None: nothing records)
_NOTHING = contextlib.nullcontext()


def span(name: str, kind: str):
    """A span of the job's trace, where no Timeline is at hand (the optimizer step of every
    trainer, chapter 5); a no-op when nothing records. Skipped inside a span of the same kind."""
    return _NOTHING if RECORDER is None else RECORDER.span(name, kind, generic=True)


class Timeline:
    """Events (name, kind, start, end) of one rank, in seconds of the shared clock."""

    def __init__(self):
        self.events: list[tuple[str, str, float, float]] = []

    def add(self, name: str, kind: str, start: float, end: float) -> None:
        self.events.append((name, kind, start, end))
        # a trace takes the strategy's spans too; its communication it records where it happens
        if RECORDER is not None and kind != "comm":
            RECORDER.add(name, kind, start, end)

    @contextlib.contextmanager
    def span(self, name: str, kind: str):
        recorder = RECORDER
        if recorder is not None:
            recorder.open.append(kind)  # so that the engine's generic span of this kind is not repeated inside
        start = time.perf_counter()
        try:
            yield
        finally:
            if recorder is not None:
                recorder.open.pop()
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


def gantt_events(trace, step: int | None = None) -> list[list[tuple]]:
    """A trace (a file written by `--trace`, or its dict: minidist/trace/) as the per-rank events
    `plot_gantt` draws: (name, kind, start, end) in seconds, one list per rank. The chart's kinds
    only (forward, backward, optimizer, wait, and "comm" for every collective and message);
    with `step`, only what lies within each rank's span of that step."""
    if not isinstance(trace, dict):
        with open(trace) as f:
            trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    shown = {"forward": "forward", "backward": "backward", "optimizer": "optimizer", "wait": "wait",
             "comm": "comm", "p2p": "comm"}
    per_rank = []
    for pid in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == pid]
        window = (-float("inf"), float("inf"))
        if step is not None:
            span = next(e for e in mine if e.get("cat") == "step" and e.get("args", {}).get("step") == step)
            window = (span["ts"], span["ts"] + span["dur"])
        inside = [e for e in mine if e.get("cat") in shown and window[0] <= e["ts"] and e["ts"] + e["dur"] <= window[1]]
        per_rank.append(sorted(((e["name"], shown[e["cat"]], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                                for e in inside), key=lambda e: e[2]))
    return per_rank


def plot_trace(trace, step: int | None = None, ax=None, title: str = "", labels: bool = False):
    """`plot_gantt` of a trace file (or its dict): one row per rank, one step or the whole job."""
    return plot_gantt(gantt_events(trace, step), ax=ax, title=title, labels=labels)
