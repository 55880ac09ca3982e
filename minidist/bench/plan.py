"""Benchmark: the layout planner's predictions against minidist's own runs (chapter 9).

    python -m minidist.bench plan [--ranks 4] [--steps 8] [--repeats 3] [--batch-size 16]
                                  [--n-layer 4 --n-embd 128 --n-head 4 --block-size 64] [--timeout 60] [--json PATH]

Not under mpirun: the benchmark starts the jobs itself. For every valid layout of the demo GPT
on `--ranks` ranks (`plan.candidate_layouts`: dp x tp x pp, ZeRO stage, micro-batches, schedule)
it runs

    mpiexec -n 4 python -m minidist.demo --dp A --tp B --pp C [--zero S] [--microbatches M ...]
            --steps N --json PATH

(`Layout.demo_flags`: flags of degree 1 are left out; with pp = 1, m > 1 is --accumulation M) and prints, per
layout, the predicted and the measured step time, and per rank the predicted memory ledger
beside the measured one: params, grads and optimizer must be equal to the byte, activations
are shown as the ratio measured / predicted; for composed layouts also the bytes each group
sends per step (the demo's `traffic_by_group`) against the planner's. A layout the demo refuses
is listed with the demo's one-line reason. Last, Spearman's rank correlation between the planner's ranking and
the measured step times.

The prediction is calibrated by yardsticks measured in the same run (`_plan_calibration.py`):
NumPy matmuls of the model's shapes give the GEMM curve; three serial steps (one process; the global batch, one sequence, the
batch in 8 micro-batches) give the fixed costs of a layer pass and of a step that no split
shrinks (Python's) and the bandwidth minidist's element-wise work reaches; minidist's all-reduce
timed on `--ranks` ranks gives alpha and beta (`comm.cost.fit_alpha_beta` on the ring's
2(n-1)(alpha + S/n beta)); a pipeline message's delay as its receiver notices it, at each size
the layouts send, gives the message's own alpha and beta, and the same for what taking one in
costs its receiver; each strategy's own bookkeeping is timed on one rank, where messages are
free (`Cluster.strategy_overhead`). The model assumes no overlap here: minidist's collectives run
on the training thread. With more ranks than cores (4 ranks on a 2-core machine) the ranks are
not independent devices: the ranks that compute share the cores, and a rank that waits (in a
pipeline's bubble, for a message, in a collective's latency) lends its core to them (`Cluster.cores`,
`plan.shared_cores`), and sleeps: after the drain, the step's last collectives wait
for such ranks to wake (a pipeline of one stage per rank, timed from its drain to its step's end,
less what the model counts there, gives `Cluster.pipeline_sync`). The machine may be shared, so
every time is the least disturbed of several: a run's time is its fastest step after the first,
each layout runs in `--repeats` passes and keeps its fastest, and the yardsticks are measured
before the layouts and after each pass, each keeping its least disturbed measurement
(`least_disturbed`): the yardsticks span as many moments of the machine as the layouts' passes.
A pipeline's bubble is the exception: it is the median of its passes' bubbles (`typical_bubble`),
since the fastest pass is the one whose stages happened to run most evenly.

    python -m minidist.bench plan --match "tp2"     # only the layouts whose name contains "tp2"
    python -m minidist.bench plan --median-of a.json b.json c.json   # recorded runs, each layout's median
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

from minidist import cli
from minidist.bench._plan_calibration import (ALL_REDUCE_SIZES, ENGINE_MICROBATCHES, calibrate,  # noqa: F401
                                             demo_workload, fit_cluster, least_disturbed, measure_yardsticks,
                                             print_yardsticks)
from minidist.bench._plan_runs import load_run, median_of_runs, print_median, spearman, within
from minidist.comm.launch import find_mpiexec
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.parallel.mesh import coordinates
from minidist.plan.predict import Workload, rank_ledger
from minidist.plan.search import candidate_layouts, plan
from minidist.training.layout import Layout

PILES = ("params", "grads", "optimizer")


def demo_flags(layout: dict) -> list[str]:
    """The demo's flags for one planner layout (`Layout.demo_flags`: degrees of 1 left out)."""
    return Layout(**layout).demo_flags()


def run_demo(ranks: int, flags: list[str], timeout: float) -> tuple[dict | None, str]:
    """Run the demo (under mpiexec when ranks > 1); (its JSON report, "") or (None, why not)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        command = [sys.executable, "-m", "minidist.demo", *flags, "--json", path, "--log-every", "-1"]
        if ranks > 1:
            command = [find_mpiexec(), "-n", str(ranks), *command]
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        # a session of its own, so that a job past its time is ended whole: mpiexec and its ranks
        job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
        try:
            _, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
            return None, f"timed out after {timeout:g} s"
        if job.returncode or not os.path.exists(path):
            lines = [line for line in stderr.splitlines() if "error" in line.lower()] or stderr.splitlines()
            return None, (lines[-1].strip() if lines else f"exit status {job.returncode}")
        with open(path) as f:
            return json.load(f), ""


def fastest_step(report: dict) -> float:
    """The fastest step after the first: the least disturbed by whatever else runs on the machine."""
    return float(min(report["step_seconds"][1:] or report["step_seconds"]))


def pass_bubble(report: dict) -> float | None:
    """The bubble one run measured (the median over its steps after the first; None without a pipeline)."""
    return (report.get("pipeline") or {}).get("bubble_measured")


def typical_bubble(per_pass: list) -> float | None:
    """A layout's measured bubble: the median over its passes, not the fastest pass's. The fastest
    pass is kept for the step time because a disturbance only adds time; but a run's bubble rises
    and falls with how evenly its stages happened to run (which core, which cache), both ways, and
    the fastest pass is the one whose stages ran most evenly: its bubble is the lowest, not the
    typical one (chapter 5)."""
    values = [b for b in per_pass if b is not None]
    return float(np.median(values)) if values else None


def compare(row: dict, report: dict, workload: Workload, bubbles: list | None = None) -> dict:
    """One layout's record: predicted vs measured step time and per-rank memory; `bubbles`, the
    bubble of each pass (default: the one of `report`)."""
    layout = Layout(**row["layout"])
    measured = fastest_step(report)
    ranks = []
    for rank, got in enumerate(report["memory"]):
        stage = coordinates(rank, dp_size=layout.dp, tp_size=layout.tp)[0]
        want = rank_ledger(workload, layout, rank)
        ranks.append({"rank": rank, "stage": stage, "predicted": {k: want[k] for k in (*PILES, "activations")},
                      "measured": {k: got.get(k) for k in (*PILES, "activations")},
                      "states_equal": all(got.get(k) == want[k] for k in PILES),
                      "activation_ratio": got.get("activations", 0) / want["activations"]})
    # bytes per step in each group (composed layouts only): the busiest rank's, measured and predicted
    groups = report.get("traffic_by_group") or []
    traffic = {axis: {"predicted": row["bytes_sent"][axis], "measured": max(g.get(axis, 0) for g in groups)}
               for axis in ("tp", "pp", "embedding", "dp")
               if row["bytes_sent"][axis] and any(axis in g for g in groups)}
    pipeline = report.get("pipeline") or {}
    bubbles = [pass_bubble(report)] if bubbles is None else bubbles
    return {"layout": row["name"], "flags": demo_flags(row["layout"]), "predicted_step_seconds": row["step_seconds"],
            "measured_step_seconds": measured,
            "predicted": {k: row[k] for k in ("compute", "bubble", "tp", "pp", "dp", "gradients", "machinery",
                                              "sharing")},
            "bubble": {"predicted": row["bubble_fraction"], "measured": typical_bubble(bubbles),
                       "theory": pipeline.get("bubble_theory"), "measured_each_pass": bubbles,
                       "measured_fastest_pass": pipeline.get("bubble_measured")} if layout.pp > 1 else None,
            "memory": ranks, "traffic": traffic}


def print_records(records: list[dict], skipped: list[dict]) -> None:
    print(f"{'layout':<34} {'predicted ms':>12} {'measured ms':>11} {'ratio':>6}  states  "
          f"activations measured/predicted per rank   bytes per step measured/predicted")
    for r in records:
        states = "equal" if all(m["states_equal"] for m in r["memory"]) else "DIFFER"
        ratios = " ".join(f"{m['activation_ratio']:.3f}" for m in r["memory"])
        sent = " ".join(f"{axis} {t['measured'] / t['predicted']:.3f}" for axis, t in r["traffic"].items())
        print(f"{r['layout']:<34} {r['predicted_step_seconds'] * 1e3:12.1f} {r['measured_step_seconds'] * 1e3:11.1f} "
              f"{r['measured_step_seconds'] / r['predicted_step_seconds']:6.2f}  {states:<6}  {ratios:<40} {sent}")
        for m in r["memory"]:
            if not m["states_equal"]:
                print(f"    rank {m['rank']}: predicted {m['predicted']}  measured {m['measured']}")
    for s in skipped:
        print(f"{s['layout']:<34} not run: {s['why']}")


def median_report(parser, paths: list[str], json_path: str | None) -> int:
    """`--median-of`: the median over recorded runs (`_plan_runs`), printed and optionally written."""
    try:
        summary = median_of_runs([load_run(path) for path in paths])
    except ValueError as error:
        parser.error(f"--median-of: {error}")
    print_median(summary)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([{"kind": "median_layout", **row} for row in summary["layouts"]]
                      + [{"kind": "median_summary", **{k: v for k, v in summary.items() if k != "layouts"}}], f, indent=1)
    return 0


def main(argv=None) -> int:
    positive = cli.integer(1)
    parser = cli.OneLineParser(prog="python -m minidist.bench plan", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=cli.integer(2), default=4)
    parser.add_argument("--steps", type=cli.integer(2), default=8,
                        help="steps per layout; the fastest after the first is kept")
    parser.add_argument("--repeats", type=positive, default=3,
                        help="passes over the layouts; each layout's least disturbed pass is kept")
    parser.add_argument("--batch-size", type=positive, default=16)
    parser.add_argument("--n-layer", type=positive, default=4)
    parser.add_argument("--n-embd", type=positive, default=128)
    parser.add_argument("--n-head", type=positive, default=4)
    parser.add_argument("--block-size", type=positive, default=64)
    parser.add_argument("--match", default="", help="run only the layouts whose name contains this text")
    parser.add_argument("--timeout", type=cli.number(1), default=60.0, help="seconds per demo run")
    parser.add_argument("--json", type=cli.output_file, help="write the records to this file")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the yardsticks (the GEMM curve, bandwidth, overhead, all-reduce), print them, stop")
    parser.add_argument("--median-of", nargs="+", metavar="JSON",
                        help="measure nothing: read runs that --json recorded and print each layout's median")
    args = parser.parse_args(argv)
    if args.median_of:
        return median_report(parser, args.median_of, args.json)
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    try:  # the demo's task must fit the sequence: checked here, before any job starts
        make_task("sort", args.block_size)
    except ValueError as error:
        parser.error(f"--block-size {args.block_size}: {error}")
    config = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd)
    valid = candidate_layouts(config, args.ranks, args.batch_size)
    facts = f"--batch-size {args.batch_size}, --n-head {args.n_head}, --n-layer {args.n_layer}"
    if not valid:
        parser.error(f"--ranks {args.ranks}: no valid layout of the demo GPT on {args.ranks} ranks ({facts})")
    if not any(args.match in str(lay) for lay in valid):
        parser.error(f"--match {args.match!r}: none of the {len(valid)} valid layouts of {args.ranks} ranks matches")
    try:
        yardsticks = [measure_yardsticks(config, args)]
        cluster, facts = fit_cluster(config, args, yardsticks[0])
    except RuntimeError as error:
        parser.error(str(error))
    workload = demo_workload(config, args.batch_size)
    print_yardsticks(facts, args.ranks)
    if args.calibrate:
        if args.json:
            with open(args.json, "w") as f:
                json.dump([{"kind": "calibration", **facts}], f, indent=1)
        return 0
    rows = plan(workload, cluster, top=len(valid))  # every schedule simulated: a search's estimates are not checked here
    print(f"{len(rows)} valid layouts")
    model_flags = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
                   "--block-size", str(args.block_size), "--batch-size", str(args.batch_size),
                   "--steps", str(args.steps)]
    reports, skipped, bubbles = {}, {}, {}
    chosen = [r for r in rows if args.match in r["name"]]
    # in a shuffled order: a machine that slows or speeds up during the run then adds noise to the
    # measurements, not a trend along the predicted order (the rows come sorted by prediction); and
    # in --repeats passes, each layout's run the least disturbed of its passes: a disturbance of the
    # shared machine that outlasts one run (a second or so) rarely outlasts a whole pass. Each pass
    # (and each run) shuffles afresh, so that whatever a slot in the order carries falls on other
    # layouts next time, not on the same one every time
    shuffle = np.random.default_rng()
    for attempt in range(args.repeats):
        for row in shuffle.permutation(np.array(chosen, dtype=object)):
            if row["name"] in skipped:
                continue
            report, why = run_demo(args.ranks, [*demo_flags(row["layout"]), *model_flags], args.timeout)
            if report is None:
                skipped[row["name"]] = {"layout": row["name"], "flags": demo_flags(row["layout"]), "why": why}
                print(f"  {row['name']}: not run ({why})", file=sys.stderr, flush=True)
                continue
            bubbles.setdefault(row["name"], []).append(pass_bubble(report))
            if row["name"] not in reports or fastest_step(report) < fastest_step(reports[row["name"]]):
                reports[row["name"]] = report
            print(f"  {row['name']}: {fastest_step(report) * 1e3:.1f} ms", file=sys.stderr, flush=True)
        # the yardsticks again after every pass: each keeps its least disturbed of as many moments as the
        # layouts' passes span, as each layout keeps its least disturbed pass
        try:
            yardsticks.append(measure_yardsticks(config, args))
        except RuntimeError as error:
            print(f"bench plan: the yardsticks after pass {attempt + 1} failed ({error})", file=sys.stderr)
    skipped = list(skipped.values())
    # the predictions are made from each yardstick's least disturbed measurement
    cluster, facts = fit_cluster(config, args, least_disturbed(*yardsticks))
    print_yardsticks(facts, args.ranks, f"each the least disturbed of {len(yardsticks)} measurements, "
                                        "before the layouts and after each pass")
    predicted = {row["name"]: row for row in plan(workload, cluster, top=len(valid))}
    assert all(row["simulated"] for row in predicted.values())
    records = [compare(predicted[name], report, workload, bubbles[name]) for name, report in reports.items()]
    records.sort(key=lambda r: r["predicted_step_seconds"])
    print_records(records, skipped)
    rho = spearman([r["predicted_step_seconds"] for r in records], [r["measured_step_seconds"] for r in records]) \
        if len(records) >= 2 else float("nan")
    equal = sum(all(m["states_equal"] for m in r["memory"]) for r in records)
    hits = sum(within(r["measured_step_seconds"], r["predicted_step_seconds"]) for r in records)
    print(f"{len(records)} layouts run ({len(skipped)} refused by the demo); params/grads/optimizer equal to the byte "
          f"on {equal} of {len(records)}; step time within 25 % of the prediction on {hits} of {len(records)}; "
          f"Spearman rank correlation of predicted and measured step times: {rho:.3f}")
    for r in records:
        if r["bubble"] and r["bubble"]["measured"] is not None:
            b = r["bubble"]
            each = ", ".join(f"{x:.3f}" for x in b["measured_each_pass"] if x is not None)
            print(f"  bubble {r['layout']}: measured {b['measured']:.3f} (median of the passes: {each}), "
                  f"predicted {b['predicted']:.3f} (simulated with each stage's cost), formula {b['theory']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"kind": "calibration", **facts},
                       *({"kind": "layout", **r} for r in records), *({"kind": "refused", **s} for s in skipped),
                       {"kind": "summary", "spearman": rho, "layouts_run": len(records),
                        "within_25_percent": hits, "yardstick_measurements": len(yardsticks)}], f, indent=1)
    return 0
