"""`--trace PATH`: one Chrome Trace Event Format file for the whole job, and its summary (chapter 5).

The multi-rank tests run the demo under real mpiexec with --trace and --json, and hold the trace
to the format (what Perfetto and chrome://tracing read), to the traffic counters of the same run
(every collective's and message's bytes), and to the demo's own step times. The summary is
checked to the microsecond on a trace made by hand.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from minidist.comm.launch import find_mpiexec
from minidist.timeline import gantt_events
from minidist.trace import chrome
from minidist.trace.summary import summarize
from test_demo import SMALL, demo

REQUIRED = {"name", "ph", "ts", "pid", "tid"}
COMPUTE = {"forward", "backward", "layer", "optimizer", "wait", "comm wait"}


def traced_run(tmp_path, flags, nprocs=2, launcher=()):
    """The demo under mpiexec with --trace and --json: (trace, report)."""
    trace, report = tmp_path / "trace.json", tmp_path / "run.json"
    args = ["--steps", "3", *SMALL, *flags, "--trace", str(trace), "--json", str(report)]
    if launcher:
        cmd = [find_mpiexec(), *launcher, "-n", str(nprocs), sys.executable, "-m", "minidist.demo", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    else:
        proc = demo(*args, nprocs=nprocs)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert not list(tmp_path.glob(".trace-*")), "the temporary file was renamed, not left behind"
    return json.loads(trace.read_text()), json.loads(report.read_text())


def check_format(trace: dict, nprocs: int) -> None:
    """The Chrome Trace Event Format as viewers read it."""
    events = trace["traceEvents"]
    for e in events:
        assert REQUIRED <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
    phases = Counter(e["ph"] for e in events)
    assert phases["B"] == phases["E"]  # none written; if ever, matched
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(nprocs)}
    threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in events if e["ph"] in "Xsf"} <= threads
    # every arrow has one start (on the sender) and one end (on the receiver, bound to its span)
    starts = Counter(e["id"] for e in events if e["ph"] == "s")
    ends = Counter(e["id"] for e in events if e["ph"] == "f")
    assert starts == ends and set(starts.values()) <= {1}
    assert all(e["bp"] == "e" for e in events if e["ph"] == "f")
    spans = [e for e in events if e["ph"] == "X"]
    for flow in (e for e in events if e["ph"] in "sf"):  # each end lies inside a message span of its track
        assert any(s["pid"] == flow["pid"] and s["tid"] == flow["tid"] and s["cat"] == "p2p"
                   and s["ts"] <= flow["ts"] <= s["ts"] + s["dur"] for s in spans), flow
    sender = {e["id"]: e for e in events if e["ph"] == "s"}
    # a message arrives after it was sent, on clocks as good as their alignment: exact on one machine,
    # within half the ping-pong's round trip across machines (minidist/trace/clock.py)
    error = max([1e6 * c["round_trip"] / 2 for c in trace["otherData"]["minidist"]["clocks"].values()
                 if not c["same_machine"]], default=0.0)
    for end in (e for e in events if e["ph"] == "f"):
        assert end["pid"] != sender[end["id"]]["pid"] and end["ts"] >= sender[end["id"]]["ts"] - error
    # the spans of one track nest (a viewer stacks them)
    for track in {(s["pid"], s["tid"]) for s in spans}:
        stack = []
        for s in sorted((s for s in spans if (s["pid"], s["tid"]) == track), key=lambda s: (s["ts"], -s["dur"])):
            while stack and stack[-1] <= s["ts"] + 1e-3:
                stack.pop()
            assert not stack or s["ts"] + s["dur"] <= stack[-1] + 1e-3, (track, s)
            stack.append(s["ts"] + s["dur"])


def check_bytes(trace: dict, report: dict) -> None:
    """Each rank's collectives (calls, bytes sent and received) and messages add up, kind by kind,
    to the traffic counters of the same run."""
    for counted in report["comm"]:
        traced = defaultdict(lambda: [0, 0, 0])
        for e in trace["traceEvents"]:
            if e["ph"] != "X" or e["pid"] != counted["rank"] or e["cat"] not in ("comm", "p2p"):
                continue
            row, args = traced[e["args"]["kind"]], e["args"]
            if e["cat"] == "comm":
                row[0], row[1], row[2] = row[0] + args["bytes"], row[1] + args["bytes_received"], row[2] + 1
                assert args["algorithm"] and counted["rank"] in args["group"]
            else:
                row[0 if e["name"].startswith("send") else 1] += args["bytes"]
        want = {kind: [c["bytes_sent"], c["bytes_received"], c["calls"]] for kind, c in counted["by_kind"].items()
                if kind != "check"}  # the consistency check runs on MPI's own Allgather: no trace span
        assert dict(traced) == want


def check_steps(trace: dict, report: dict, nprocs: int) -> None:
    """Step spans: the demo's own step times (rank 0's), and they bracket the work."""
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in range(nprocs):
        steps = sorted((e for e in events if e["pid"] == rank and e["cat"] == "step"), key=lambda e: e["ts"])
        assert [s["args"]["step"] for s in steps] == [0, 1, 2]
        if rank == 0:
            for span, seconds in zip(steps, report["step_seconds"]):
                assert span["dur"] / 1e6 == pytest.approx(seconds, rel=0.02, abs=5e-4)
        work = [e for e in events if e["pid"] == rank and e["cat"] in COMPUTE - {"comm wait"}]
        assert work and all(any(s["ts"] <= w["ts"] and w["ts"] + w["dur"] <= s["ts"] + s["dur"] for s in steps)
                            for w in work)
        for s in steps:  # inside each step: micro-batch forwards and backwards, layers, one optimizer step
            inside = Counter(e["cat"] for e in events if e["pid"] == rank and s["ts"] <= e["ts"] <= s["ts"] + s["dur"])
            assert inside["forward"] >= 1 and inside["backward"] >= 1 and inside["layer"] >= 2
            assert inside["optimizer"] == 1
    memory = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "memory"]
    assert len(memory) == 3 * nprocs
    for e in memory:  # the ledger's four piles, as the report has them
        assert set(e["args"]) == {"params", "grads", "optimizer", "activations"}
        assert e["args"]["params"] == report["memory"][e["pid"]]["params"]


def check_summary(trace: dict, nprocs: int) -> None:
    """The parts of every rank's step add up to the step; the work recorded covers most of it."""
    rows = summarize(trace)["ranks"]
    assert [r["rank"] for r in rows] == list(range(nprocs))
    for r in rows:
        parts = r["compute_ms"] + r["exposed_comm_ms"] + r["idle_ms"] + r["optimizer_ms"]
        assert parts == pytest.approx(r["step_ms"], rel=1e-6)
        assert r["compute_ms"] > 0 and r["optimizer_ms"] > 0
        assert r["idle_ms"] - r["bubble_ms"] < 0.5 * r["step_ms"]  # time no span explains: Python between spans


def test_data_parallel_trace_is_one_valid_file_with_the_counters_bytes(tmp_path):
    trace, report = traced_run(tmp_path, ["--dp", "2"])
    check_format(trace, 2)
    check_bytes(trace, report)
    check_steps(trace, report, 2)
    check_summary(trace, 2)
    collectives = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "comm"]
    assert {e["name"] for e in collectives} >= {"all_reduce", "broadcast"}  # buckets, statistics; the set-up
    assert any(e["args"]["async"] for e in collectives)  # the buckets' all-reduces overlap backward
    clocks = trace["otherData"]["minidist"]["clocks"]
    for rank in ("0", "1"):  # one machine: one clock; the ping-pong's estimate is within half a round trip
        assert clocks[rank]["same_machine"] and clocks[rank]["offset"] == 0.0
        assert abs(clocks[rank]["measured"]) <= clocks[rank]["round_trip"] / 2


@pytest.mark.full
def test_pipeline_trace_draws_every_message_as_an_arrow_across_two_nodes(tmp_path):
    """Two made-up hosts (MPICH's fork launcher): rank 1's clock is set against rank 0's."""
    trace, report = traced_run(tmp_path, ["--pp", "2", "--microbatches", "2"],
                               launcher=("-launcher", "fork", "-hosts", "a,b", "-ppn", "1"))
    check_format(trace, 2)
    check_bytes(trace, report)
    check_steps(trace, report, 2)
    check_summary(trace, 2)
    events = trace["traceEvents"]
    # per step: 2 activations forward, 2 gradients back, one tied-weight exchange each way
    assert Counter(e["ph"] for e in events)["s"] == 3 * (2 + 2 + 2)
    assert any(e["ph"] == "X" and e["cat"] == "wait" for e in events)  # the bubble, named by the engine
    clocks = trace["otherData"]["minidist"]["clocks"]
    assert not clocks["1"]["same_machine"] and clocks["1"]["offset"] == clocks["1"]["measured"]
    assert abs(clocks["1"]["measured"]) <= clocks["1"]["round_trip"] / 2  # one real clock underneath
    chart = gantt_events(trace, step=2)  # the notebooks' Gantt chart, from the same recording
    assert [sorted({kind for _, kind, _, _ in rank}) for rank in chart] == [
        ["backward", "comm", "forward", "optimizer", "wait"]] * 2


@pytest.mark.full
def test_tensor_parallel_trace_shows_the_blocking_all_reduces_inside_the_layers(tmp_path):
    trace, report = traced_run(tmp_path, ["--tp", "2"])
    check_format(trace, 2)
    check_bytes(trace, report)
    check_steps(trace, report, 2)
    check_summary(trace, 2)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    blocks = [e for e in spans if e["name"] == "forward h.0"]
    inside = [c for c in spans if c["cat"] == "comm" and not c["args"]["async"]
              and any(b["ts"] <= c["ts"] and c["ts"] + c["dur"] <= b["ts"] + b["dur"] for b in blocks)]
    assert len(inside) >= 3 * 2  # attention's and the MLP's all-reduce in every block's forward


def handmade_trace() -> dict:
    """Two ranks, known numbers (microseconds). Rank 0, one step of 100:
    forward 0-30, an async all-reduce 20-60 (10 under the forward, 30 exposed), backward 60-80
    with a blocking all-reduce 70-75 inside it, the optimizer 85-95, nothing at 80-85 and 95-100.
    Rank 1, two steps of 50: a pipeline wait 0-20 (around a message wait 5-20), forward 20-40,
    optimizer 40-45, nothing 45-50; then forward 50-90 with a message in flight 60-95, optimizer 95-100."""
    def x(pid, cat, ts, dur, name="x", **args):
        return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": 100, "args": args}

    return {"traceEvents": [
        x(0, "step", 0, 100, step=0), x(0, "forward", 0, 30), x(0, "layer", 5, 10),
        x(0, "comm", 20, 40, **{"async": True}),
        x(0, "backward", 60, 20), x(0, "comm", 70, 5, **{"async": False}), x(0, "optimizer", 85, 10),
        x(1, "step", 0, 50, step=0), x(1, "wait", 0, 20), x(1, "comm wait", 5, 15), x(1, "forward", 20, 20),
        x(1, "optimizer", 40, 5),
        x(1, "step", 50, 50, step=1), x(1, "forward", 50, 40), x(1, "p2p", 60, 35), x(1, "optimizer", 95, 5),
        {"name": "memory", "ph": "C", "ts": 100, "pid": 0, "tid": 0, "args": {"params": 1}},
    ]}


def test_summary_charges_every_instant_once_on_a_handmade_trace():
    rows = {r["rank"]: r for r in summarize(handmade_trace())["ranks"]}
    zero, one = rows[0], rows[1]
    # rank 0: compute 30 + 15 (backward less its blocking all-reduce); exposed comm 30 + 5; idle 10
    assert (zero["steps"], zero["step_ms"]) == (1, 0.1)
    parts = ("compute_ms", "exposed_comm_ms", "idle_ms", "optimizer_ms")
    assert tuple(zero[p] for p in parts) == (0.045, 0.035, 0.01, 0.01)
    assert (zero["compute_pct"], zero["exposed_comm_pct"], zero["idle_pct"], zero["optimizer_pct"]) == (45, 35, 10, 10)
    assert (zero["bubble_ms"], zero["overlapped_comm_ms"]) == (0, 0.01)
    # rank 1, per step (two): compute (20 + 40) / 2, exposed comm 5 / 2 (the message after the
    # forward), idle (20 + 5) / 2 of which bubble 20 / 2 (the engine's wait outranks the message
    # wait), optimizer (5 + 5) / 2, overlapped comm 30 / 2 (the message under the forward)
    assert (one["steps"], one["step_ms"]) == (2, 0.05)
    assert tuple(one[p] for p in parts) == (0.03, 0.0025, 0.0125, 0.005)
    assert (one["bubble_ms"], one["overlapped_comm_ms"]) == (0.01, 0.015)
    assert (one["compute_pct"], one["exposed_comm_pct"], one["idle_pct"], one["optimizer_pct"]) == (60, 5, 25, 10)
    skipped = {r["rank"]: r for r in summarize(handmade_trace(), skip=1)["ranks"]}
    assert set(skipped) == {1} and skipped[1]["compute_ms"] == 0.04 and skipped[1]["exposed_comm_ms"] == 0.005


def test_summary_command_prints_the_table_and_json(tmp_path, capsys):
    from minidist.trace.__main__ import main

    path = tmp_path / "hand.json"
    chrome.write(str(path), handmade_trace())
    assert main(["summary", str(path)]) == 0
    table = capsys.readouterr().out
    assert "compute" in table and "exposed comm" in table and "  45.0%" in table
    assert main(["summary", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["exposed_comm_pct"] == 35
    with pytest.raises(SystemExit) as stopped:  # a file that is not there: one line, status 2
        main(["summary", str(tmp_path / "none.json")])
    assert stopped.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_spans_in_flight_at_once_get_lanes_of_their_own_and_arrows_pair_by_message():
    """chrome.to_chrome on two hand-made recordings: overlapping collectives take two lanes,
    the clock offset moves rank 1's events, and the n-th message of a channel meets the n-th."""
    key = (((0, 1), None, False), 0, 1, 5)
    ranks = [
        {"rank": 0, "clock": {"offset": 0.0}, "counters": [], "args": {0: {"kind": "all_reduce.ring"}},
         "events": [("all_reduce", "comm", 1.0, 3.0), ("all_reduce", "comm", 2.0, 4.0), ("send to 1", "p2p", 1.0, 1.5),
                    ("send to 1", "p2p", 2.0, 2.5)],
         "flows": [("s", 2, (*key, 0)), ("s", 3, (*key, 1))]},
        {"rank": 1, "clock": {"offset": 10.0}, "counters": [("memory", 0.5, {"params": 4})], "args": {},
         "events": [("recv from 0", "p2p", -8.0, -7.0), ("recv from 0", "p2p", -6.0, -5.0)],
         "flows": [("f", 0, (*key, 0)), ("f", 1, (*key, 1))]},
    ]
    trace = chrome.to_chrome(ranks, {"command": "test"})
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["ts"], e["dur"], e["tid"]) for e in spans if e["pid"] == 0 and e["cat"] == "comm"] == [
        (0.0, 2e6, 200), (1e6, 2e6, 201)]  # the second call overlaps the first without nesting in it
    assert [e["ts"] for e in spans if e["pid"] == 1] == [1e6, 3e6]  # -8 s + 10 s offset, from the first event at 1 s
    flows = {(e["ph"], e["id"]): e for e in trace["traceEvents"] if e["ph"] in "sf"}
    assert set(flows) == {("s", 1), ("s", 2), ("f", 1), ("f", 2)}
    assert flows["f", 1]["ts"] == 2e6 - 1e-3 and flows["s", 1]["ts"] == 1e-3  # the receive's end, the send's start
    assert trace["otherData"]["minidist"]["command"] == "test"
    counter = next(e for e in trace["traceEvents"] if e["ph"] == "C")
    assert (counter["pid"], counter["ts"], counter["args"]) == (1, 9.5e6, {"params": 4})
