"""Benchmark: the layout planner's predictions against minidist's own runs (chapter 9).

    python -m minidist.bench plan [--ranks 4] [--steps 6] [--batch-size 16] [--n-layer 4 --n-embd 128
                                  --n-head 4 --block-size 64] [--timeout 60] [--json PATH]

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

The prediction is calibrated by yardsticks measured in the same run: NumPy matmuls of the model's
shapes give the GEMM curve; three serial steps (one process; the global batch, one sequence, the
batch in 4 micro-batches) give the fixed costs of a layer pass and of a step that no split
shrinks (Python's) and the bandwidth minidist's element-wise work reaches; minidist's all-reduce
timed on `--ranks` ranks gives alpha and beta (`comm.cost.fit_alpha_beta` on the ring's
2(n-1)(alpha + S/n beta)). The model assumes no overlap here: minidist's collectives run on the
training thread. With more ranks than cores (4 ranks on a 2-core machine) the ranks are not
independent devices: a step takes at least every rank's busy time spread over the cores, and a rank
idle in a pipeline's bubble lends its core to another (`Cluster.cores`,
`predict.shared_cores_seconds`). Each run's time is its fastest step after the first (the machine
may be shared: the fastest step is the least disturbed).

    python -m minidist.bench plan --match "tp2"     # only the layouts whose name contains "tp2"
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from minidist import cli
from minidist.comm import cost
from minidist.comm.launch import find_mpiexec, run
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.plan.search import candidate_layouts, plan
from minidist.training.layout import Layout
from minidist.plan.hardware import fit_gemm_line, measure_this_machine, time_matmul
from minidist.plan.predict import Cluster, GemmCurve, Workload, predict, rank_ledger
from minidist.plan.step_time import layer_gemms
from minidist.parallel.mesh import coordinates

PILES = ("params", "grads", "optimizer")


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties share their mean rank)."""
    def ranks(values):
        values = np.asarray(values, dtype=float)
        order = np.argsort(values, kind="stable")
        r = np.empty(len(values))
        r[order] = np.arange(1, len(values) + 1)
        for v in np.unique(values):  # ties: the mean of the ranks they span
            r[values == v] = r[values == v].mean()
        return r

    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman needs two sequences of the same length >= 2, got {len(x)} and {len(y)}")
    a, b = ranks(x), ranks(y)
    a, b = a - a.mean(), b - b.mean()
    denominator = np.sqrt((a @ a) * (b @ b))
    return float(a @ b / denominator) if denominator else float("nan")


def demo_workload(config: GPTConfig, batch: int) -> Workload:
    """The demo's run as the planner sees it: float32, minidist's activations, no overlap (the
    collectives run on the training thread), and the gradients' own memory passes counted."""
    return Workload(config, batch, config.block_size, "fp32", "minidist", overlap=False, gradient_passes=True)


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


def time_all_reduce(sizes, reps: int = 20) -> list[float]:
    """Rank program: seconds per minidist all_reduce of each size (float32, the slowest rank's)."""
    from mpi4py import MPI

    from minidist.comm import all_reduce, get_world
    comm = get_world().comm
    seconds = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        all_reduce(x)  # warm-up
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(reps):
            all_reduce(x)
        mine = np.array([(time.perf_counter() - start) / reps])
        comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        seconds.append(float(mine[0]))
    return seconds


def time_pipeline_message(nbytes: int, reps: int = 20, busy: float = 0.005) -> list[float]:
    """Rank program (2 ranks at least): seconds from rank 1's send to rank 0 noticing it, as a
    pipeline's receiver notices an activation: rank 0 has been waiting a while (`busy` s of rank 1's
    compute), so minidist's polite wait is asleep in its back-off. One machine: one clock."""
    from minidist.comm import get_world
    from minidist.comm.p2p import irecv, isend
    from minidist.comm.waiting import wait
    world = get_world()
    comm, x = world.comm, np.ones(nbytes // 4, np.float32)
    delays = []
    for i in range(reps):
        comm.Barrier()
        if world.rank == 1:
            end = time.perf_counter() + busy
            while time.perf_counter() < end:  # compute, as the previous stage does
                pass
            sent = np.array([time.perf_counter()])
            wait(isend(x, 0, i, world))
            comm.Send(sent, dest=0, tag=10_000 + i)
        elif world.rank == 0:
            wait(irecv(x, 1, i, world))
            noticed = time.perf_counter()
            sent = np.empty(1)
            comm.Recv(sent, source=1, tag=10_000 + i)
            delays.append(noticed - sent[0])
    return delays


def time_pipeline_engine(config: GPTConfig, batch: int, microbatches: int, steps: int = 4) -> float:
    """Rank program: the median time minidist's pipeline engine spends after a forward or backward
    (posting sends, polling, bookkeeping: the gap to the rank's next event, `PipelineTrainer`'s
    explain_bubble), in a pipeline of one stage per rank."""
    from minidist.comm import get_world
    from minidist.core.tensor import default_dtype
    from minidist.parallel.pipeline import PipelineTrainer
    from minidist.training.train import OptimSettings
    with default_dtype("float32"):
        trainer = PipelineTrainer(config, OptimSettings(lr=1e-3, steps=steps), make_task("sort", config.block_size),
                                  batch, group=get_world(), microbatches=microbatches, schedule="1f1b",
                                  explain_bubble=True)
        seconds = []
        for step in range(steps):
            trainer.step(step)
            seconds.append(trainer.engine_seconds)
    return float(np.median(seconds[1:]))


def time_steps_side_by_side(config: GPTConfig, batch: int, steps: int = 30) -> float:
    """Rank program: the median seconds of a serial training step of `batch` sequences, every rank
    stepping its own model at once with no communication: what sharing the cores costs."""
    from minidist.bench.step import minidist_step
    from minidist.comm import get_world
    from minidist.parallel.stage_balance import median_seconds
    step = minidist_step(config, batch, "float32")[0]
    get_world().comm.Barrier()  # start together, so that the steps overlap
    return median_seconds(step, steps)


def effective_cores(config: GPTConfig, batch: int, ranks: int, timeout: float) -> float:
    """How many cores `ranks` ranks get when they share fewer: ranks x (a step alone) / (the same step
    with every rank stepping at once). Two ranks on one core would give 1 if switching between
    them were free; the caches they share and the switches make it less."""
    share = max(1, batch // ranks)
    alone = run(time_steps_side_by_side, 1, config, share, timeout=timeout)[0]
    together = float(np.median(run(time_steps_side_by_side, ranks, config, share, timeout=timeout)))
    return ranks * alone / together


def fastest_step(report: dict) -> float:
    """The fastest step after the first: the least disturbed by whatever else runs on the machine."""
    return float(min(report["step_seconds"][1:] or report["step_seconds"]))


def time_gemms(shapes, dtype=np.float32, seconds: float = 0.02) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of a NumPy matmul of each (M, N, K), one BLAS thread (a rank's share), the
    fastest of repeats lasting about `seconds` (`hardware.time_matmul`)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        return [time_matmul(m, n, k, dtype, seconds) for m, n, k in shapes]


def fit_gemm_curve(points, peak: float) -> GemmCurve:
    """The GEMM curve t = (W + W½)/(e·peak) through measured (W, t) (`hardware.fit_gemm_line`)."""
    return GemmCurve(*fit_gemm_line(points, peak))


def layer_shapes(config: GPTConfig, batch: int, ranks: int) -> list[tuple[int, int, int]]:
    """The GEMMs the demo's layouts run: one layer's, for micro-batches of 1..batch rows and tp 1..ranks."""
    shapes = set()
    for b in sorted({1, 2, 4, batch}):
        for t in (d for d in range(1, ranks + 1) if config.n_head % d == 0):
            for count, m, n, k in layer_gemms(b, config.block_size, config.n_embd, config.n_head, t):
                shapes.add((m * (count if count > 1 else 1), n, k))  # a batched GEMM as one of the same FLOPs
    return sorted(shapes)


def calibrate(config: GPTConfig, args) -> tuple[Cluster, dict]:
    """The cluster this machine is to the planner, from yardsticks measured in this run.

    This CPU as a device (`hardware.measure_this_machine`: its best matmul FLOP/s and its memory
    bandwidth); the GEMM curve fitted to NumPy matmuls of the shapes the model runs (`fit_gemm_curve`);
    then three serial steps fix the three costs a matmul timing cannot see (`fit_serial_costs`): the
    fixed cost of a layer pass that no split shrinks (Python's per-operation cost,
    `Cluster.layer_overhead`), the fixed cost of a step (`Cluster.step_overhead`) and the bandwidth
    minidist's element-wise work reaches. With more ranks than cores the cluster says how many
    cores they effectively get (`effective_cores`, `Cluster.cores`: a step takes at least the ranks'
    busy time over the cores). minidist's all-reduce timed on `--ranks` ranks gives alpha and beta;
    a pipeline message's delay is timed as the receiver notices it, and the pipeline engine's own
    time after each forward and backward in a short pipeline run (`Cluster.engine_overhead`)."""
    model_flags = ["--n-layer", str(config.n_layer), "--n-embd", str(config.n_embd), "--n-head", str(config.n_head),
                   "--block-size", str(config.block_size),
                   "--steps", str(max(args.steps, 10))]  # the least disturbed of nine
    k = ACCUMULATED if args.batch_size % ACCUMULATED == 0 else 1
    serial = {}
    for name, flags in (("batch", ["--batch-size", str(args.batch_size)]), ("one", ["--batch-size", "1"]),
                        ("accumulated", ["--batch-size", str(args.batch_size), "--accumulation", str(k)])):
        report, why = run_demo(1, [*model_flags, *flags], args.timeout)
        if report is None:
            raise RuntimeError(f"the serial yardstick failed: {why}")
        serial[name] = fastest_step(report)
    device = measure_this_machine()
    peak = device.flops("fp32")
    points = time_gemms(layer_shapes(config, args.batch_size, args.ranks))
    curve = fit_gemm_curve(points, peak)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def serial_prediction(batch: int, microbatches: int, overhead: float, per_step: float, bandwidth: float) -> float:
        one = Cluster(1, 1, float("inf"), 1e30, 0.0, 1e30, 0.0, peak, overhead, memory_bandwidth=bandwidth, gemm=curve,
                      step_overhead=per_step)
        return predict(demo_workload(config, batch), Layout(microbatches=microbatches), one)["step_seconds"]

    overhead, per_step, bandwidth = fit_serial_costs(serial_prediction, config.n_layer, args.batch_size, k, serial,
                                                     device.memory_bandwidth)
    sizes = [1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22]
    seconds = run(time_all_reduce, args.ranks, sizes, timeout=args.timeout)[0]
    n = args.ranks
    alpha, beta = cost.fit_alpha_beta([s / n for s in sizes], [t / (2 * (n - 1)) for t in seconds])
    link = 1 / max(beta, 1e-15)
    activation = args.batch_size * config.block_size * config.n_embd * 4  # the largest a pipeline sends
    p2p = float(np.median(run(time_pipeline_message, n, activation, timeout=args.timeout)[0]))
    shared = min(cores, effective_cores(config, args.batch_size, n, args.timeout)) if cores < n else None
    stages = min(n, config.n_layer)
    engine = run(time_pipeline_engine, stages, config, args.batch_size, math.gcd(args.batch_size, 8),
                 timeout=args.timeout)[0]
    cluster = Cluster(n, n, float("inf"), link, alpha, link, alpha, peak, overhead, memory_bandwidth=bandwidth,
                      step_overhead=per_step, gemm=curve, p2p_latency=p2p, engine_overhead=engine, cores=shared)
    facts = {"serial_step_seconds": serial["batch"], "serial_one_sequence_seconds": serial["one"],
             "serial_accumulated_seconds": serial["accumulated"], "serial_accumulated_microbatches": k,
             "serial_step_predicted": serial_prediction(args.batch_size, 1, overhead, per_step, bandwidth),
             "device_flops": peak * curve.peak_fraction, "peak_flops": peak,
             "gemm_peak_fraction": curve.peak_fraction, "gemm_half_flops": curve.half_flops,
             "gemm_points": [{"flops": f, "seconds": s} for f, s in points],
             "memory_bandwidth": bandwidth, "memory_bandwidth_measured": device.memory_bandwidth,
             "layer_overhead": overhead, "step_overhead": per_step, "cores": cores, "ranks": n,
             "effective_cores": shared, "alpha": alpha, "beta": beta,
             "pipeline_message_seconds": p2p, "pipeline_engine_seconds": engine,
             "all_reduce_seconds": {str(k): v for k, v in zip(sizes, seconds)}}
    return cluster, facts


ACCUMULATED = 4  # micro-batches of the third serial yardstick


def fit_serial_costs(predict_serial, n_layer: int, batch: int, k: int, measured: dict,
                     bandwidth: float) -> tuple[float, float, float]:
    """(layer overhead, step overhead, element-wise bandwidth) that make the serial predictions
    equal to three measured steps: `measured["batch"]` (the batch at once), `measured["one"]` (one
    sequence) and `measured["accumulated"]` (the batch in k micro-batches).

    The batch and one sequence pay the same fixed costs, so their difference is work alone: it
    fixes the bandwidth of element-wise work (bisected between 1/20 and 20 times the streamed
    `bandwidth`: small arrays stay in cache). The k micro-batches pay k - 1 more layer passes per
    layer, which fixes the overhead of a pass; what the batch's step has beyond its work and its
    passes is the step's own overhead (the optimizer's Python, per parameter tensor)."""
    def work(b: int, m: int, bw: float) -> float:
        return predict_serial(b, m, 0.0, 0.0, bw)

    low, high = bandwidth / 20, bandwidth * 20
    for _ in range(40):
        middle = (low * high) ** 0.5
        if work(batch, 1, middle) - work(1, 1, middle) > measured["batch"] - measured["one"]:
            low = middle   # too slow: more bandwidth
        else:
            high = middle
    bw = (low * high) ** 0.5
    if k > 1:
        extra_passes = (k - 1) * n_layer
        more_work = work(batch, k, bw) - work(batch, 1, bw)
        overhead = (measured["accumulated"] - measured["batch"] - more_work) / extra_passes
    else:
        overhead = (measured["one"] - work(1, 1, bw)) / n_layer
    overhead = max(0.0, overhead)
    per_step = max(0.0, measured["batch"] - predict_serial(batch, 1, overhead, 0.0, bw))
    return overhead, per_step, bw


def compare(row: dict, report: dict, workload: Workload) -> dict:
    """One layout's record: predicted vs measured step time and per-rank memory."""
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
    return {"layout": row["name"], "flags": demo_flags(row["layout"]), "predicted_step_seconds": row["step_seconds"],
            "measured_step_seconds": measured,
            "predicted": {k: row[k] for k in ("compute", "bubble", "tp", "pp", "dp", "gradients")},
            "bubble": {"predicted": row["bubble_fraction"], "measured": pipeline.get("bubble_measured"),
                       "theory": pipeline.get("bubble_theory")} if layout.pp > 1 else None,
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


def main(argv=None) -> int:
    positive = cli.integer(1)
    parser = cli.OneLineParser(prog="python -m minidist.bench plan", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=cli.integer(2), default=4)
    parser.add_argument("--steps", type=cli.integer(2), default=6,
                        help="steps per layout; the fastest after the first is kept")
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
    args = parser.parse_args(argv)
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
        cluster, facts = calibrate(config, args)
    except RuntimeError as error:
        parser.error(str(error))
    workload = demo_workload(config, args.batch_size)
    shared = (f"{args.ranks} ranks share {facts['cores']} cores, as {facts['effective_cores']:.2f}"
              if facts["effective_cores"] else "a core per rank")
    print(f"yardsticks: per core ({shared}) GEMMs at "
          f"{facts['gemm_peak_fraction']:.2f} x {facts['peak_flops'] / 1e9:.1f} GFLOP/s, half of that at "
          f"{facts['gemm_half_flops'] / 1e6:.2f} MFLOP (fitted to {len(facts['gemm_points'])} NumPy matmuls of the "
          f"model's shapes), element-wise work at {facts['memory_bandwidth'] / 1e9:.1f} GB/s (streamed: "
          f"{facts['memory_bandwidth_measured'] / 1e9:.1f}), {facts['layer_overhead'] * 1e3:.2f} ms "
          f"per layer pass and {facts['step_overhead'] * 1e3:.1f} ms per step; "
          f"serial step {facts['serial_step_seconds'] * 1e3:.1f} ms measured, "
          f"{facts['serial_step_predicted'] * 1e3:.1f} ms predicted; all-reduce alpha {facts['alpha'] * 1e6:.1f} us, "
          f"beta {facts['beta'] * 1e9:.3f} ns/byte; a pipeline message noticed {facts['pipeline_message_seconds'] * 1e3:.2f} "
          f"ms after its send, the pipeline engine's {facts['pipeline_engine_seconds'] * 1e3:.2f} ms after each "
          "forward or backward")
    if args.calibrate:
        if args.json:
            with open(args.json, "w") as f:
                json.dump([{"kind": "calibration", **facts}], f, indent=1)
        return 0
    rows = plan(workload, cluster)
    print(f"{len(rows)} valid layouts")
    model_flags = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
                   "--block-size", str(args.block_size), "--batch-size", str(args.batch_size),
                   "--steps", str(args.steps)]
    records, skipped = [], []
    chosen = [r for r in rows if args.match in r["name"]]
    # in a shuffled order: a machine that slows or speeds up during the run then adds noise to the
    # measurements, not a trend along the predicted order (the rows come sorted by prediction)
    for row in np.random.default_rng(0).permutation(np.array(chosen, dtype=object)):
        report, why = run_demo(args.ranks, [*demo_flags(row["layout"]), *model_flags], args.timeout)
        if report is None:
            skipped.append({"layout": row["name"], "flags": demo_flags(row["layout"]), "why": why})
            print(f"  {row['name']}: not run ({why})", file=sys.stderr, flush=True)
            continue
        records.append(compare(row, report, workload))
        print(f"  {row['name']}: {records[-1]['measured_step_seconds'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    records.sort(key=lambda r: r["predicted_step_seconds"])
    print_records(records, skipped)
    rho = spearman([r["predicted_step_seconds"] for r in records], [r["measured_step_seconds"] for r in records]) \
        if len(records) >= 2 else float("nan")
    equal = sum(all(m["states_equal"] for m in r["memory"]) for r in records)
    within = sum(abs(r["measured_step_seconds"] / r["predicted_step_seconds"] - 1) <= 0.25 for r in records)
    print(f"{len(records)} layouts run ({len(skipped)} refused by the demo); params/grads/optimizer equal to the byte "
          f"on {equal} of {len(records)}; step time within 25 % of the prediction on {within} of {len(records)}; "
          f"Spearman rank correlation of predicted and measured step times: {rho:.3f}")
    for r in records:
        if r["bubble"] and r["bubble"]["measured"] is not None:
            b = r["bubble"]
            print(f"  bubble {r['layout']}: measured {b['measured']:.3f}, predicted {b['predicted']:.3f} "
                  f"(simulated with each stage's cost), formula {b['theory']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"kind": "calibration", **facts},
                       *({"kind": "layout", **r} for r in records), *({"kind": "refused", **s} for s in skipped),
                       {"kind": "summary", "spearman": rho, "layouts_run": len(records),
                        "within_25_percent": within}], f, indent=1)
    return 0
