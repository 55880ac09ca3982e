"""Where each rank's step time went, read from a trace (chapter 5), as Holistic Trace Analysis'
temporal breakdown reads a PyTorch trace.

One idea: every instant of a step is charged to exactly one thing, so the parts add up to the
step. Inside each rank's step spans, an instant goes to the first of these that is happening:

    idle/bubble    a wait the engine names: a pipeline stage waiting for its neighbour
    exposed comm   a blocking collective, or a wait for a message
    optimizer      the optimizer step (clipping, AdamW)
    compute        a forward or backward (of a micro-batch, of a layer)
    exposed comm   communication in flight (an asynchronous collective, a message) and nothing else
    idle/bubble    nothing recorded at all (Python between spans, the data, a wait nobody named)

Communication in flight while the rank computes is *overlapped* (chapter 3's point): it costs
nothing, and is reported apart. Times are per step (the mean over the steps counted) in ms and
in % of the step.
"""
from __future__ import annotations

import bisect

from minidist.trace.chrome import read

COMPUTE = {"forward", "backward", "layer", "compute"}
PARTS = ("compute", "exposed_comm", "idle", "optimizer")


def category(event: dict) -> str | None:
    """The class of a complete event, in the order of precedence above (None: not counted)."""
    kind = event.get("cat")
    if kind == "wait":
        return "bubble"
    if kind == "comm wait" or (kind == "comm" and not event.get("args", {}).get("async", False)):
        return "blocking"
    if kind == "optimizer":
        return "optimizer"
    if kind in COMPUTE:
        return "compute"
    if kind in ("comm", "p2p"):
        return "in_flight"
    return None


ORDER = ("bubble", "blocking", "optimizer", "compute", "in_flight")  # precedence, highest first


def breakdown(spans: list[tuple[float, float, str]], start: float, end: float) -> dict[str, float]:
    """Charge every instant of [start, end] to the highest class of the `spans` (start, end,
    class) covering it. Returns the time of each class, and "none" (no span at all) and
    "overlapped" (communication in flight under compute or the optimizer). A sweep: the spans'
    ends in time order, with how many spans of each class are open between them."""
    changes = []
    for a, b, kind in spans:
        a, b = max(a, start), min(b, end)
        if b > a:
            changes += [(a, 1, kind), (b, -1, kind)]
    changes.sort(key=lambda change: change[0])
    open_now = dict.fromkeys(ORDER, 0)
    totals = dict.fromkeys((*ORDER, "none", "overlapped"), 0.0)
    previous = start
    for at, delta, kind in [*changes, (end, 0, None)]:
        if at > previous:
            top = next((c for c in ORDER if open_now[c]), "none")
            totals[top] += at - previous
            if open_now["in_flight"] and top in ("compute", "optimizer"):
                totals["overlapped"] += at - previous
            previous = at
        if kind is not None:
            open_now[kind] += delta
    return totals


def summarize(trace, skip: int = 0, trainer: str | None = None) -> dict:
    """Per rank, the mean step's breakdown: {"ranks": [{"rank", "steps", "step_ms", "compute_ms",
    "compute_pct", "exposed_comm_ms", ..., "idle_ms", "optimizer_ms", "bubble_ms" (the part of idle
    the engine named), "overlapped_comm_ms"}], "skip", "trainer"}. `skip` leaves out each rank's
    first steps; `trainer` counts only the steps of that trainer (e.g. "pp-1f1b" of the tour)."""
    events = [e for e in read(trace)["traceEvents"] if e.get("ph") == "X"]
    ranks = []
    for pid in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == pid]
        steps = sorted((e for e in mine if e.get("cat") == "step"
                        and trainer in (None, e.get("args", {}).get("trainer"))), key=lambda e: e["ts"])[skip:]
        if not steps:
            continue
        spans = sorted((e["ts"], e["ts"] + e["dur"], category(e)) for e in mine if category(e))
        starts, longest = [s[0] for s in spans], max((s[1] - s[0] for s in spans), default=0.0)
        total = dict.fromkeys((*ORDER, "none", "overlapped", "step"), 0.0)
        for step in steps:
            begin, finish = step["ts"], step["ts"] + step["dur"]
            near = spans[bisect.bisect_left(starts, begin - longest):bisect.bisect_right(starts, finish)]
            parts = breakdown(near, begin, finish)
            for name, value in parts.items():
                total[name] += value
            total["step"] += step["dur"]
        n = len(steps)
        ms = {"step": total["step"], "compute": total["compute"], "optimizer": total["optimizer"],
              "exposed_comm": total["blocking"] + total["in_flight"], "idle": total["bubble"] + total["none"],
              "bubble": total["bubble"], "overlapped_comm": total["overlapped"]}
        row = {"rank": pid, "steps": n}
        for name, micros in ms.items():
            row[f"{name}_ms"] = round(micros / n / 1e3, 6)
            if name != "step":
                row[f"{name}_pct"] = round(100 * micros / total["step"], 4) if total["step"] else 0.0
        ranks.append(row)
    return {"ranks": ranks, "skip": skip, "trainer": trainer}


def format_table(summary: dict) -> str:
    lines = [f"per rank, the mean step (steps counted: {', '.join(str(r['steps']) for r in summary['ranks'])}"
             + (f", the first {summary['skip']} left out" if summary["skip"] else "")
             + (f"; trainer {summary['trainer']}" if summary.get("trainer") else "") + "):",
             f"{'rank':>4} {'step ms':>9}  " + "  ".join(f"{title:>17}" for title in
                                                         ("compute", "exposed comm", "idle/bubble", "optimizer"))
             + f"  {'overlapped comm':>16}"]
    for r in summary["ranks"]:
        cells = "  ".join(f"{r[f'{part}_ms']:9.3f} {r[f'{part}_pct']:6.1f}%" for part in PARTS)
        lines.append(f"{r['rank']:>4} {r['step_ms']:9.3f}  {cells}  {r['overlapped_comm_ms']:9.3f} ms")
    return "\n".join(lines)
