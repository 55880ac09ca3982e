"""Every rank's recording as one Chrome Trace Event Format file (chapter 5).

One idea: the format PyTorch's profiler exports, and that https://ui.perfetto.dev and
chrome://tracing open, is a JSON object whose "traceEvents" is a list of small dicts:

    {"ph": "X", "name": "forward 0", "cat": "forward", "pid": 1, "tid": 100, "ts": 1234.5, "dur": 56.7, "args": {...}}
                                          a complete event: a span, ts and dur in microseconds
    {"ph": "s" / "f", "id": 7, ...}       the two ends of an arrow (a message: sender, receiver)
    {"ph": "C", "name": "memory", "args": {"params": ..., "grads": ...}}     a counter
    {"ph": "M", "name": "process_name", "args": {"name": "rank 1"}}          metadata

A process (`pid`) per rank; its threads (`tid`) are tracks: the rank's main thread ("compute":
steps, forwards, backwards, layers, the optimizer, waits), its collectives and its messages.
Spans on one track must nest (a viewer draws a stack of them); calls in flight at once do not
(two buckets' all-reduces overlap), so a track takes as many lanes, extra threads, as it needs.
Times: each rank's clock plus its offset to rank 0's (clock.py), from the job's first event.
"""
from __future__ import annotations

import json
import os
import tempfile

TRACKS = {"compute": 1, "collectives": 2, "point-to-point": 3}  # tid = 100 x track + lane
TRACK_OF = {"comm": "collectives", "p2p": "point-to-point"}  # every other kind is the main thread's


def to_chrome(ranks: list[dict], metadata: dict | None = None) -> dict:
    """The trace of a job from every rank's `Recorder.export()` (with its "clock")."""
    origin = min((e[2] + r["clock"]["offset"] for r in ranks for e in r["events"]), default=0.0)
    events, flow_ids = [], {}
    for r in ranks:
        pid, shift = r["rank"], r["clock"]["offset"] - origin
        events += [_meta("process_name", pid, 0, {"name": f"rank {pid}"}),
                   _meta("process_sort_index", pid, 0, {"sort_index": pid})]
        spans = [(i, name, kind, _ns(start + shift), _ns(end + shift))
                 for i, (name, kind, start, end) in enumerate(r["events"])]
        tid_of, names = {}, {}
        for track, number in TRACKS.items():
            mine = [s for s in spans if TRACK_OF.get(s[2], "compute") == track]
            for lane, members in enumerate(_lanes(mine)):
                tid = 100 * number + lane
                names[tid] = track if lane == 0 else f"{track} ({lane + 1})"
                tid_of.update((s[0], tid) for s in members)
        for tid, name in sorted(names.items()):
            events += [_meta("thread_name", pid, tid, {"name": name}),
                       _meta("thread_sort_index", pid, tid, {"sort_index": tid})]
        for i, name, kind, start, end in spans:
            event = {"name": name, "cat": kind, "ph": "X", "ts": _us(start), "dur": _us(end - start), "pid": pid,
                     "tid": tid_of[i]}
            if i in r["args"]:
                event["args"] = r["args"][i]
            events.append(event)
        for phase, index, key in r["flows"]:
            _, _, _, start, end = spans[index]
            # an arrow's end must fall inside its span: the sender's first nanosecond (the message may
            # arrive before the send call returns), the receiver's last
            at = min(start + 1, end) if phase == "s" else max(start, end - 1)
            flow = {"name": "message", "cat": "p2p", "ph": phase, "id": flow_ids.setdefault(key, len(flow_ids) + 1),
                    "ts": _us(at), "pid": pid, "tid": tid_of[index]}
            if phase == "f":
                flow["bp"] = "e"  # bound to the enclosing span (the receive), not the next one
            events.append(flow)
        for name, time, values in r["counters"]:
            events.append({"name": name, "ph": "C", "ts": _us(_ns(time + shift)), "pid": pid, "tid": 0, "args": values})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"minidist": {**(metadata or {}), "clocks": {r["rank"]: r["clock"] for r in ranks}}}}


def _lanes(spans: list[tuple]) -> list[list[tuple]]:
    """Share spans (i, name, kind, start, end) among as few lanes as keep each lane nested: a span
    goes on the first lane where it starts after the lane's open spans end or fits inside the
    innermost one."""
    lanes, stacks = [], []
    for span in sorted(spans, key=lambda s: (s[3], -s[4])):
        for members, stack in zip(lanes, stacks):
            while stack and stack[-1] <= span[3]:
                stack.pop()
            if not stack or span[4] <= stack[-1]:
                break
        else:
            members, stack = [], []
            lanes.append(members)
            stacks.append(stack)
        members.append(span)
        stack.append(span[4])
    return lanes


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)  # integers from here on: nesting is decided exactly


def _us(ns: int) -> float:
    return ns / 1e3


def write(path: str, trace: dict) -> None:
    """Write `trace` as JSON to `path` atomically: a temporary file beside it, then a rename, so
    a reader never sees half a file (and an interrupted run leaves the old one)."""
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=".trace-", suffix=".json")
    mask = os.umask(0)
    os.umask(mask)
    try:
        os.chmod(temporary, 0o666 & ~mask)  # as open() would have made it, not mkstemp's owner-only
        with os.fdopen(handle, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def read(path_or_trace) -> dict:
    """A trace from its file (or the trace itself)."""
    if isinstance(path_or_trace, dict):
        return path_or_trace
    with open(path_or_trace) as f:
        return json.load(f)
