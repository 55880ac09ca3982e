"""`python -m minidist.bench dp`: data-parallel throughput at dp = 1, 2, 4: naive, bucketed, balanced.

Chapter 3. Trains the demo GPT (vocab 256, block 64, n_embd 128, 4 layers, 4 heads, float32,
global batch 16) on the sort task and prints, for every layout, tokens/s and the ratio to the
serial run measured in the same job, plus the bytes each rank sent per step (from the traffic
counters) beside the ring formula 2(N-1)/N x gradient bytes, and where the communication's time
went: the all-reduce work done inside backward, in the gradient hooks (`hooks ms`), and what was
left exposed after it (`exposed ms`).

    python -m minidist.bench dp                    # dp 1, 2, 4; naive, bucketed, balanced, ceiling
    python -m minidist.bench dp --repeats 5 --json dp.json
    python -m minidist.bench dp --dp 2 --torch     # PyTorch's serial step and DDP (gloo) too
    python -m minidist.bench dp --dp 2 --slow 1:3  # rank 1 a straggler: 3 ms more per row
    python -m minidist.bench dp --dp 2 --repeats 1 --trace dp.json   # that job's trace (minidist/trace/)

How it runs: launch it as ONE ordinary process (not under mpirun). For each N it starts a job
of N real MPI ranks with `minidist.comm.launch.run` (mpiexec from the virtualenv). Inside the
job every variant gets its own trainer, and the variants take turns step by step:

    serial (rank 0 trains on all B rows; the other ranks wait asleep, near 0% CPU)
    naive, bucketed (DataParallelTrainer on B/N rows per rank)
    bucketed-copying (only when asked for: bucketed, with its buckets copied through the shared
        window instead of living in shared memory, minidist/comm/registered.py)
    balanced (BalancedDataParallelTrainer: bucketed, with the rows re-split every step by each
        rank's speed, minidist/parallel/balance.py)
    ceiling (N independent serial trainers on B/N rows each, never talking)

so a slow moment of this shared, noisy machine hits every variant alike (after serial, the
others' order rotates by one each step: none always pays for following it). A step's time is the
slowest rank's; a variant's time is the median over the timed steps (after --warmup), and
its speedup is serial's median / its median, both from the same job. `--repeats` jobs per N
give the range. The ceiling is what perfect data parallelism could reach on this machine (all
the compute of dp=N, none of the communication): dp / ceiling is the efficiency of the
gradient averaging, and ceiling / serial shows what the cores themselves allow with an even
split. The balanced row can pass the ceiling: it moves rows off whichever core is slow at the
moment (the `splits` key counts the splits it used). With `--torch` (PyTorch installed; never a
dependency) the same jobs also time PyTorch's serial step and its DistributedDataParallel over
gloo, so PyTorch's data-parallel speedup over its own serial step is measured beside ours.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np

from minidist import cli
from minidist.comm.launch import run
from minidist.bench import write_records

CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 16
DP_MODES = ("naive", "bucketed", "balanced")  # the modes that average gradients (not serial, ceiling)
# bucketed, its buckets copied through the shared window instead of living in it (chapter 7, registered.py)
COPYING = "bucketed-copying"
AVERAGING = DP_MODES + (COPYING,)


def rank_program(modes: list[str], steps: int, warmup: int, batch: int, bucket_kb: int = 1024,
                 dtype: str = "float32", wait: dict | None = None, slow: tuple | None = None,
                 trace_path: str | None = None) -> dict:
    """Every variant in `modes` on this job's ranks, taking turns step by step.
    Returns {mode: {times: [s per step], bytes_sent, messages (per step), ...}} for this rank.
    `wait` (e.g. {"busy": 0.002} or {"polite": False}) sets `dist.set_wait_policy` on every rank,
    to measure how the waiting policy of minidist/comm/waiting.py affects the step. `slow` = (rank,
    seconds per row) makes that rank's every trainer slower (`minidist.lab.stragglers`). With
    `trace_path`, the job's trace (every mode's steps, in turns) is written there by rank 0."""
    from minidist import comm as dist
    from minidist import trace
    from minidist.core.data import make_task
    from minidist.comm import traffic
    from minidist.core.model import GPTConfig
    from minidist.lab.stragglers import make_straggler
    from minidist.parallel.balance import BalancedDataParallelTrainer
    from minidist.parallel.data_parallel import DataParallelTrainer
    from minidist.runtime import tune_malloc
    from minidist.core.tensor import default_dtype
    from minidist.training.train import OptimSettings, SerialTrainer

    tune_malloc()
    if wait:
        dist.set_wait_policy(**wait)
    world = dist.get_world()
    if trace_path:
        trace.begin(world, {"command": "python -m minidist.bench dp", "world_size": world.size, "modes": modes})
    settings = OptimSettings(lr=3e-3, steps=warmup + steps, warmup=2, min_lr=3e-4)
    with default_dtype(dtype):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        config = GPTConfig(**CONFIG)
        trainers = {}
        for mode in modes:
            if mode == "serial":
                trainers[mode] = SerialTrainer(config, settings, task, batch, seed=0) if world.rank == 0 else None
            elif mode == "ceiling":
                trainers[mode] = SerialTrainer(config, settings, task, batch // world.size, seed=world.rank)
            elif mode.startswith("torch"):  # the yardstick: PyTorch's own serial step and DDP (gloo)
                from minidist.bench._torch_gpt import TorchTrainer, init_gloo
                if mode == "torch-ddp":
                    init_gloo(world.comm)
                    trainers[mode] = TorchTrainer(config, batch // world.size, dtype, ddp=True)
                else:
                    trainers[mode] = TorchTrainer(config, batch, dtype) if world.rank == 0 else None
            else:
                kind = BalancedDataParallelTrainer if mode == "balanced" else DataParallelTrainer
                trainers[mode] = kind(config, settings, task, batch, seed=0, group=world, overlap=(mode != "naive"),
                                      bucket_cap_bytes=bucket_kb * 1024, registered_buckets=(mode != COPYING))
        if slow and world.rank == slow[0]:
            for trainer in trainers.values():
                if trainer is not None:
                    make_straggler(trainer, slow[1])
        out = {m: {"times": [], "bytes_sent": 0, "messages": 0, "comm_s": 0.0, "hook_s": 0.0, "splits": {}}
               for m in modes}
        idle_policy = dict(spin=0.001)  # sleep soon: the serial run's core is not disturbed
        idle = False
        for s in range(warmup + steps):
            for mode, trainer in in_turn(trainers, s):
                # everyone starts the step together (not timed, not counted); a rank that had no work
                # last turn waits here for the serial run, asleep soon
                with dist.waiting_as(**(idle_policy if idle else {})):
                    dist.barrier()
                idle = trainer is None
                before = traffic.snapshot()["total"]
                split = "/".join(map(str, trainer.rows)) if getattr(trainer, "balancer", None) else None
                start = time.perf_counter()
                hooked = getattr(getattr(trainer, "ddp", None), "hook_seconds", None) is not None
                if hooked:  # the bucketed wrapper's gradient hooks: the all-reduce work done inside backward
                    trainer.ddp.hook_seconds = 0.0
                if trainer is not None:
                    if hasattr(trainer, "timeline"):
                        trainer.timeline.clear()
                    with trace.step(s, trainer):  # --trace: a span, then the memory ledger (a no-op without)
                        trainer.step(s)
                        seconds = time.perf_counter() - start
                else:
                    seconds = time.perf_counter() - start
                if s < warmup:
                    continue
                after = traffic.snapshot()["total"]
                rec = out[mode]
                rec["times"].append(seconds)
                rec["bytes_sent"] += (after["bytes_sent"] - before["bytes_sent"]) / steps
                rec["messages"] += (after["messages"] - before["messages"]) / steps
                if hooked:
                    rec["hook_s"] += trainer.ddp.hook_seconds / steps
                if split:
                    rec["splits"][split] = rec["splits"].get(split, 0) + 1
                if hasattr(trainer, "timeline"):  # communication after backward ended: not hidden
                    ev = trainer.timeline.events
                    backward_end = max(e[3] for e in ev if e[1] == "backward")
                    opt_start = min(e[2] for e in ev if e[1] == "optimizer")
                    rec["comm_s"] += (opt_start - backward_end) / steps
        model = next(t.model for m, t in trainers.items() if t is not None and not m.startswith("torch"))
        grad_bytes = sum(p.data.nbytes for p in model.parameters())
        for rec in out.values():
            rec["grad_bytes"] = grad_bytes
        trace.end(trace_path, world)
        return out


def in_turn(trainers: dict, step: int) -> list:
    """The (mode, trainer) pairs in this step's order: serial first, the others rotated by one
    each step. Whichever variant runs right after serial finds the caches full of serial's data
    and the other ranks just woken: rotating spreads that cost over every variant evenly."""
    first = [(m, t) for m, t in trainers.items() if m == "serial"]
    rest = [(m, t) for m, t in trainers.items() if m != "serial"]
    shift = step % len(rest) if rest else 0
    return first + rest[shift:] + rest[:shift]


def measure(n: int, modes: list[str], args, wait=None, trace_path: str | None = None) -> dict:
    """One job of n ranks; per mode: the median step (slowest rank per step) and counts."""
    ranks = run(rank_program, n, modes, args.steps, args.warmup, args.batch, args.bucket_kb, args.dtype, wait,
                args.slow, trace_path, timeout=600)
    out = {}
    for mode in modes:
        per_step = np.max(np.array([r[mode]["times"] for r in ranks]), axis=0)
        out[mode] = {"seconds": float(np.median(per_step)), "best": float(np.min(per_step)),
                     "bytes_sent": max(r[mode]["bytes_sent"] for r in ranks),
                     "messages": max(r[mode]["messages"] for r in ranks),
                     "exposed_comm_s": max(r[mode]["comm_s"] for r in ranks),
                     "hook_s": max(r[mode]["hook_s"] for r in ranks),
                     "grad_bytes": ranks[0][mode]["grad_bytes"], "splits": ranks[0][mode]["splits"]}
    return out


def slow_rank(text: str) -> tuple[int, float]:
    """--slow RANK:MS -> (rank, seconds of extra work per row)."""
    rank, _, ms = text.partition(":")
    try:
        rank, seconds = int(rank), float(ms) / 1e3
    except ValueError:
        rank, seconds = -1, -1.0
    if rank < 0 or not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"--slow takes RANK:MS, e.g. 1:3 (a rank >= 0, milliseconds >= 0), "
                                         f"got {text!r}")
    return rank, seconds


def job_modes(n: int, args) -> list[str]:
    if n == 1:
        return ["serial", "bucketed"]  # dp=1 never communicates: naive and bucketed are the same run
    torch_modes = ["torch-serial", "torch-ddp"] if args.torch else []
    return ["serial"] + args.modes + (["ceiling"] if args.ceiling else []) + torch_modes


def main(argv=None) -> int:
    positive = cli.integer(1)
    parser = cli.OneLineParser(prog="python -m minidist.bench dp", description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=cli.listof(positive), default=[1, 2, 4], help="data-parallel degrees, comma-separated")
    parser.add_argument("--modes", type=cli.listof(cli.one_of(AVERAGING)), default=list(DP_MODES),
                        help="any of " + ", ".join(AVERAGING) + " (default: the first three)")
    parser.add_argument("--steps", type=positive, default=8, help="timed steps per job")
    parser.add_argument("--warmup", type=cli.integer(0), default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=positive, default=3, help="jobs per dp (median and range over them)")
    parser.add_argument("--batch", type=positive, default=BATCH, help="global batch (sequences)")
    parser.add_argument("--bucket-kb", type=positive, default=1024, help="gradient bucket cap (KiB)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                        help="skip the N independent serial runs at B/N (no communication)")
    parser.add_argument("--slow", metavar="RANK:MS", type=slow_rank, help="make one rank slower: MS milliseconds of extra busy "
                        "work per row of its batch in every forward (a straggler that stays slow)")
    parser.add_argument("--torch", action="store_true", help="also time PyTorch in the same jobs: its serial step "
                        "(torch-serial) and its DistributedDataParallel over gloo (torch-ddp, x its own serial)")
    parser.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the records as a JSON list")
    parser.add_argument("--trace", metavar="PATH", type=cli.output_file,
                        help="write the trace of one job, the largest --dp's first, here (Chrome Trace Event Format)")
    args = parser.parse_args(argv)
    if args.slow:
        if min(args.dp) <= args.slow[0]:
            parser.error(f"--slow {args.slow[0]}:...: rank {args.slow[0]} does not exist at dp={min(args.dp)}")
    if args.torch:
        try:
            import torch  # noqa: F401  (never a dependency of minidist)
        except ImportError:
            parser.error("--torch needs PyTorch: pip install torch")
    for n in args.dp:
        if args.batch % n:
            parser.error(f"--batch {args.batch} is not divisible by --dp {n}")

    print(f"data-parallel throughput: GPT {CONFIG}, {args.dtype}, global batch {args.batch}, "
          f"{args.steps} timed steps after {args.warmup}, {args.repeats} jobs per dp, "
          f"bucket cap {args.bucket_kb} KiB"
          + (f"; rank {args.slow[0]} slowed by {args.slow[1] * 1e3:g} ms of busy work per row" if args.slow else ""))
    jobs: dict[int, list] = {n: [] for n in args.dp}
    started = time.perf_counter()
    for round_ in range(args.repeats):
        for n in args.dp:
            traced = args.trace if (round_, n) == (0, max(args.dp)) else None  # one job's trace: the largest's first
            jobs[n].append(measure(n, job_modes(n, args), args, trace_path=traced))
        print(f"  round {round_ + 1}/{args.repeats} done ({time.perf_counter() - started:.0f} s)", flush=True)

    records = [record(1, "serial", [job["serial"] for n in args.dp for job in jobs[n]], None, args)]
    for n in args.dp:
        for mode in job_modes(n, args)[1:]:
            yardstick = "torch-serial" if mode == "torch-ddp" else "serial"  # PyTorch DDP against PyTorch
            records.append(record(n, mode, [job[mode] for job in jobs[n]], [job[yardstick] for job in jobs[n]], args))
            records[-1]["yardstick"] = yardstick
            if mode in AVERAGING and "ceiling" in jobs[n][0]:
                # the efficiency of the gradient averaging alone: what this machine's cores allowed
                # (the ceiling) over what dp reached, job by job
                ratios = [job["ceiling"]["seconds"] / job[mode]["seconds"] for job in jobs[n]]
                records[-1]["of_ceiling"] = float(np.median(ratios))
                records[-1]["of_ceiling_range"] = [min(ratios), max(ratios)]
    print_table(records)
    write_records(args.json, records)
    return 0


def record(n: int, mode: str, runs: list[dict], serial_runs: list[dict] | None, args) -> dict:
    """One row: medians and ranges over the jobs; speedups against each job's own serial run."""
    tokens = args.batch * CONFIG["block_size"]
    seconds = [r["seconds"] for r in runs]
    speedups = [s["seconds"] / r["seconds"] for s, r in zip(serial_runs, runs)] if serial_runs else [1.0]
    grad_bytes = runs[0]["grad_bytes"]
    communicates = mode in AVERAGING and n > 1
    return {
        "benchmark": "dp", "dp": n, "mode": mode, "dtype": args.dtype, "global_batch": args.batch,
        "seconds": float(np.median(seconds)), "seconds_range": [min(seconds), max(seconds)],
        "tokens_per_s": tokens / float(np.median(seconds)),
        "tokens_per_s_range": [tokens / max(seconds), tokens / min(seconds)],
        "speedup_vs_serial": float(np.median(speedups)), "speedup_range": [min(speedups), max(speedups)],
        "bytes_sent_per_rank_per_step": float(np.median([r["bytes_sent"] for r in runs])),
        "ring_formula_bytes": 2 * (n - 1) / n * grad_bytes if communicates else 0.0,
        "messages_per_rank_per_step": float(np.median([r["messages"] for r in runs])),
        "exposed_comm_seconds": float(np.median([r["exposed_comm_s"] for r in runs])),
        # inside backward, in the gradient hooks: launching and progressing the buckets' all-reduces
        # (their copies and sums run on the cores that compute: chapter 3, section 8)
        "hook_seconds": float(np.median([r["hook_s"] for r in runs])),
        "gradient_bytes": grad_bytes, "bucket_kb": args.bucket_kb if mode in ("bucketed", "balanced", COPYING) else None,
        "jobs": len(runs), "steps": args.steps,
        "slow": {"rank": args.slow[0], "ms_per_row": args.slow[1] * 1e3} if args.slow else None,
        # balanced: rows per rank, and how many steps used each, most used first
        "splits": dict(sum((Counter(r["splits"]) for r in runs), Counter()).most_common()),
    }


def print_table(records) -> None:
    print(f"\n{'layout':16s} {'step ms':>8s} {'tokens/s':>9s} {'(range)':>13s} {'x serial':>8s} {'(range)':>11s} "
          f"{'exposed ms':>10s} {'hooks ms':>8s} {'sent/rank/step':>14s} {'2(N-1)/N x grad':>15s} {'msgs':>5s}")
    for r in records:
        name = "serial" if r["mode"] == "serial" else f"dp={r['dp']} {r['mode']}"
        lo, hi = r["tokens_per_s_range"]
        slo, shi = r["speedup_range"]
        print(f"{name:16s} {r['seconds'] * 1e3:8.1f} {r['tokens_per_s']:9.0f} {lo:6.0f}-{hi:<6.0f} "
              f"{r['speedup_vs_serial']:8.2f} {slo:5.2f}-{shi:<5.2f} {r['exposed_comm_seconds'] * 1e3:10.1f} "
              f"{r['hook_seconds'] * 1e3:8.1f} "
              f"{r['bytes_sent_per_rank_per_step'] / 1e6:11.3f} MB {r['ring_formula_bytes'] / 1e6:12.3f} MB "
              f"{r['messages_per_rank_per_step']:5.0f}"
              + (f"   {r['of_ceiling']:.0%} of ceiling" if "of_ceiling" in r else "")
              + (f"   splits {_top_splits(r['splits'])}" if r["splits"] else ""))
    print("x serial: median over jobs of (that job's serial step / this step); range: min-max over jobs.\n"
          "exposed: from the end of backward to the optimizer (communication not hidden behind backward).\n"
          "hooks: inside backward, in the gradient hooks that start and advance the buckets' all-reduces\n"
          "(their copies and sums run on the same cores as backward: hidden from the clock, not free).\n"
          "ceiling: N independent serial trainers on B/N rows each, no communication: the best dp=N can do here;\n"
          "% of ceiling: median over jobs of (that job's ceiling step / this step).\n"
          "balanced: rows per rank re-split every step by speed; splits: the rows per rank it used, and how often.\n"
          "torch-serial x serial: PyTorch's step against minidist's; torch-ddp: x torch-serial, from the same jobs\n"
          "(its traffic goes through gloo, which minidist's counters do not see).")


def _top_splits(splits: dict, shown: int = 3) -> str:
    total = sum(splits.values())
    return ", ".join(f"{k} {v / total:.0%}" for k, v in list(splits.items())[:shown])


if __name__ == "__main__":
    import sys

    sys.exit(main())
