"""`python -m minidist.bench dp`: data-parallel throughput at dp = 1, 2, 4, naive vs bucketed.

Chapter 3. Trains the demo GPT (vocab 256, block 64, n_embd 128, 4 layers, 4 heads, float32,
global batch 16) on the sort task and prints, for every layout, tokens/s and the ratio to the
serial run measured in the same invocation, plus the bytes each rank sent per step (from the
traffic counters) beside the ring formula 2(N-1)/N x gradient bytes.

    python -m minidist.bench dp                    # serial, dp 1/2/4, naive and bucketed
    python -m minidist.bench dp --repeats 5 --json dp.json
    python -m minidist.bench dp --ceiling          # add: N independent serial runs at B/N

How it runs: launch it as ONE ordinary process. Every measurement is a fresh job of N real MPI
ranks started by `minidist.dist.launch.run` (mpiexec from the virtualenv), so the serial run,
dp=2 and dp=4 all pay the same process and MPI set-up, none of which is timed. Inside a job
every rank times each step after `--warmup` steps; a step's time is the slowest rank's, and
the job reports the median. Rounds alternate serial, dp=2, dp=4, ... `--repeats` times, so slow
phases of a shared, noisy machine hit every layout alike; the table shows the median over
rounds and the range (min-max).

The `--ceiling` rows answer "how fast could dp=N be on this machine at best?": N separate
serial processes, each on B/N rows, started together and never talking. Their throughput (all
N together) is what perfect data parallelism would reach here, so dp / ceiling is the
efficiency of the communication and everything that is not compute.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from minidist.dist.launch import run

CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 16


def rank_program(mode: str, steps: int, warmup: int, batch: int, bucket_kb: int = 1024,
                 dtype: str = "float32", wait: dict | None = None) -> dict:
    """One measurement on this job's ranks. mode: serial, naive, bucketed or ceiling
    (each rank trains its own serial model on batch/N rows and never communicates)."""
    from minidist import dist
    from minidist.data import make_task
    from minidist.dist import traffic
    from minidist.model import GPTConfig
    from minidist.parallel.data import DataParallelTrainer
    from minidist.runtime import tune_malloc
    from minidist.tensor import default_dtype
    from minidist.train import OptimSettings, SerialTrainer

    tune_malloc()
    if wait:
        dist.set_wait_policy(**wait)
    world = dist.get_world()
    settings = OptimSettings(lr=3e-3, steps=warmup + steps, warmup=2, min_lr=3e-4)
    with default_dtype(dtype):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        config = GPTConfig(**CONFIG)
        if mode == "serial":
            trainer = SerialTrainer(config, settings, task, batch, seed=0)
        elif mode == "ceiling":
            trainer = SerialTrainer(config, settings, task, batch // world.size, seed=world.rank)
        else:
            trainer = DataParallelTrainer(config, settings, task, batch, seed=0, group=world,
                                          overlap=(mode == "bucketed"), bucket_cap_bytes=bucket_kb * 1024)
        for s in range(warmup):
            trainer.step(s)
        dist.barrier()
        traffic.reset()
        times = []
        for s in range(warmup, warmup + steps):
            start = time.perf_counter()
            trainer.step(s)
            times.append(time.perf_counter() - start)
        counts = traffic.snapshot()["total"]
        timeline = getattr(trainer, "timeline", None)
        busy = timeline.busy_seconds() / (warmup + steps) if timeline else None
        comm = (sum(e[3] - e[2] for e in timeline.events if e[1] == "comm") / (warmup + steps)
                if timeline else None)
        return {"times": times, "bytes_sent": counts["bytes_sent"] / steps, "messages": counts["messages"] / steps,
                "grad_bytes": sum(p.data.nbytes for p in trainer.model.parameters()),
                "compute_s": busy, "comm_s": comm}


def measure(mode: str, n: int, args, wait=None) -> dict:
    """One job of n ranks; returns the step time (median of per-step slowest rank) and counts."""
    ranks = run(rank_program, n, mode, args.steps, args.warmup, args.batch, args.bucket_kb, args.dtype, wait,
                timeout=300)
    per_step = np.max(np.array([r["times"] for r in ranks]), axis=0)
    return {"seconds": float(np.median(per_step)), "best": float(np.min(per_step)), "bytes_sent": max(r["bytes_sent"] for r in ranks),
            "messages": max(r["messages"] for r in ranks), "grad_bytes": ranks[0]["grad_bytes"],
            "compute_s": ranks[0]["compute_s"], "comm_s": ranks[0]["comm_s"]}


def layouts(args) -> list[tuple[str, int]]:
    out = [("serial", 1)]
    for n in args.dp:
        for mode in args.modes:
            if n == 1 and mode == "naive":
                continue  # dp=1 never communicates: naive and bucketed are the same run
            out.append((mode, n))
        if args.ceiling and n > 1:
            out.append(("ceiling", n))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minidist.bench dp", description=__doc__.split("\n")[0])
    parser.add_argument("--dp", default="1,2,4", help="data-parallel degrees, comma-separated")
    parser.add_argument("--modes", default="naive,bucketed", help="naive and/or bucketed")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all layouts (median and range)")
    parser.add_argument("--batch", type=int, default=BATCH, help="global batch (sequences)")
    parser.add_argument("--bucket-kb", type=int, default=1024, help="gradient bucket cap (KiB)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--ceiling", action="store_true", help="add N independent serial runs at B/N (no comm)")
    parser.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    args = parser.parse_args(argv)
    args.dp = [int(x) for x in args.dp.split(",")]
    args.modes = args.modes.split(",")
    for n in args.dp:
        if args.batch % n:
            parser.error(f"global batch {args.batch} is not divisible by dp={n}")

    plan = layouts(args)
    print(f"data-parallel throughput: GPT {CONFIG}, {args.dtype}, global batch {args.batch}, "
          f"{args.steps} timed steps after {args.warmup}, {args.repeats} rounds, bucket cap {args.bucket_kb} KiB")
    samples: dict[tuple, list] = {key: [] for key in plan}
    started = time.perf_counter()
    for round_ in range(args.repeats):
        for mode, n in plan:
            samples[(mode, n)].append(measure(mode, n, args))
        print(f"  round {round_ + 1}/{args.repeats} done ({time.perf_counter() - started:.0f} s)", flush=True)

    tokens = args.batch * CONFIG["block_size"]
    serial = [s["seconds"] for s in samples[("serial", 1)]]
    records = []
    for mode, n in plan:
        runs = samples[(mode, n)]
        seconds = [s["seconds"] for s in runs]
        # the speedup of round i uses round i's serial run (measured moments apart)
        speedups = [a / b for a, b in zip(serial, seconds)]
        grad_bytes = runs[0]["grad_bytes"]
        records.append({
            "benchmark": "dp", "dp": n, "mode": mode, "dtype": args.dtype, "global_batch": args.batch,
            "seconds": float(np.median(seconds)), "seconds_range": [min(seconds), max(seconds)],
            "tokens_per_s": tokens / float(np.median(seconds)),
            "tokens_per_s_range": [tokens / max(seconds), tokens / min(seconds)],
            "speedup_vs_serial": float(np.median(speedups)), "speedup_range": [min(speedups), max(speedups)],
            "bytes_sent_per_rank_per_step": float(np.median([s["bytes_sent"] for s in runs])),
            "ring_formula_bytes": 2 * (n - 1) / n * grad_bytes if mode in ("naive", "bucketed") else 0.0,
            "messages_per_rank_per_step": float(np.median([s["messages"] for s in runs])),
            "gradient_bytes": grad_bytes, "bucket_kb": args.bucket_kb if mode == "bucketed" else None,
            "comm_seconds_rank0": float(np.median([s["comm_s"] for s in runs])) if runs[0]["comm_s"] is not None else None,
            "repeats": len(runs),
            # least disturbed by other processes: the fastest step of any round, against serial's
            "best_seconds": min(s["best"] for s in runs),
            "speedup_best_vs_best": min(s["best"] for s in samples[("serial", 1)]) / min(s["best"] for s in runs),
        })
    print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0


def print_table(records) -> None:
    print(f"\n{'layout':16s} {'step ms':>8s} {'tokens/s':>9s} {'(range)':>13s} {'x serial':>8s} {'(range)':>11s} "
          f"{'best':>5s} {'sent/rank/step':>14s} {'2(N-1)/N x grad':>15s} {'msgs':>6s}")
    for r in records:
        name = "serial" if r["mode"] == "serial" else f"dp={r['dp']} {r['mode']}"
        lo, hi = r["tokens_per_s_range"]
        slo, shi = r["speedup_range"]
        print(f"{name:16s} {r['seconds'] * 1e3:8.1f} {r['tokens_per_s']:9.0f} {lo:6.0f}-{hi:<6.0f} "
              f"{r['speedup_vs_serial']:8.2f} {slo:5.2f}-{shi:<5.2f} {r['speedup_best_vs_best']:5.2f} "
              f"{r['bytes_sent_per_rank_per_step'] / 1e6:11.3f} MB {r['ring_formula_bytes'] / 1e6:12.3f} MB "
              f"{r['messages_per_rank_per_step']:6.0f}")
    print("x serial: median over rounds of (round's serial step / this step), range min-max; best: fastest "
          "step of all rounds vs serial's fastest (least disturbed by other processes)")
    print("ceiling = N independent serial processes at batch B/N, no communication: the best dp=N can do here")


if __name__ == "__main__":
    import sys

    sys.exit(main())
