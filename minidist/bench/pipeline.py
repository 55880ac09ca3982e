"""Benchmark: the pipeline bubble measured against (p - 1) / (m + p - 1) (chapters 4 and 5).

    mpirun -n 2 python -m minidist.bench pipeline [--microbatches 1,2,4,8] [--schedules gpipe,1f1b]
                                                  [--virtual-stages 2] [--steps 4] [--json PATH] [--trace PATH]
                                                  [--balance-stages blocks|time] [--vocab-size V] [--n-layer L]

(`--schedules 1f1b,interleaved --microbatches 2,4,8` compares interleaved 1F1B with plain 1F1B;
the interleaved schedule skips an m that is not a multiple of p.)

For each schedule and micro-batch count m it trains the demo's GPT for a few steps on the
ranks of the job (one pipeline stage per rank) and prints the bubble measured from the real
timeline (median over steps after the first) beside the theory, the step time, the pipeline
messages and bytes each rank sent per step (traffic counters), and the peak activations each
rank held (in micro-batches and MB). The bubble is
1 - (sum of forward and backward time on all ranks) / (p x span of the step's compute).

Why measured exceeds theory: the theory assumes free messages and equal stages. Here each
message costs time, the last stage also runs the LM head and the loss, and the per-call
Python overhead of a small micro-batch does not shrink with it. The column "simulated" runs the
same schedule (`schedules.simulate`) with each stage's forward and backward times measured in
that very step, messages free: the part of the excess that unequal stages explain; what is left
between it and "measured" is the messages and the engine's own time. On a 2-core machine with 4
ranks, two ranks share a core: their compute stretches, so use p = 2 for a clean figure.

`--balance-stages time` cuts the blocks by measured cost (`parallel/stage_balance.py`, as
torchgpipe's balance_by_time) instead of by count; a larger `--vocab-size` makes the head, on
the last stage, heavy enough for the cut to move (e.g. `--vocab-size 4096`: 2 + 2 blocks become
3 + 1).

`measure(...)` is the rank program; notebooks call it through `minidist.comm.launch.run`. With
--trace PATH the whole job (every schedule and m, step by step) is one trace file (minidist/trace/,
`python -m minidist.trace summary PATH`); its steps' times then include the recording's cost.
"""
from __future__ import annotations

import json
import time

import numpy as np

from minidist import cli
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.training.train import OptimSettings

DEFAULT_CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def measure(schedules=("gpipe", "1f1b"), microbatches=(1, 2, 4, 8), steps: int = 4, batch_size: int = 16,
            config: dict | None = None, dtype: str = "float32", virtual_stages: int = 2,
            trace_path: str | None = None, balance_stages: str = "blocks") -> list[dict]:
    """Rank program: one record per (schedule, m), with this rank's events of the last step and
    its pipeline traffic per step ("messages", "bytes_sent": this rank's, not the sum); with
    `trace_path`, the job's trace written there (rank 0). `balance_stages` "time" cuts the
    blocks by measured cost (the same cut for every m: measured once, on one micro-batch of m = 8)."""
    from minidist import trace
    from minidist.comm import get_world, traffic
    from minidist.parallel.pipeline import PipelineTrainer
    from minidist.parallel.stage_balance import balanced_blocks
    from minidist.core.tensor import default_dtype

    config = GPTConfig(**(config or DEFAULT_CONFIG))
    records = []
    if trace_path:
        trace.begin(get_world(), {"command": "python -m minidist.bench pipeline", "world_size": get_world().size})
    with default_dtype(dtype):
        task = make_task("sort", config.block_size, seed=0)
        blocks = (balanced_blocks(config, get_world().size, max(1, batch_size // 8), get_world())
                  if balance_stages == "time" else None)
        for schedule in schedules:
            for m in microbatches:
                if schedule == "interleaved" and m % get_world().size:
                    continue  # Megatron-LM's interleaved schedule needs m to be a multiple of p
                v = virtual_stages if schedule == "interleaved" else 1
                trainer = PipelineTrainer(config, OptimSettings(lr=1e-3, steps=steps), task, batch_size,
                                          group=get_world(), microbatches=m, schedule=schedule, virtual_stages=v,
                                          stage_blocks=blocks if v == 1 else None, explain_bubble=True)
                traffic.reset()
                seconds = []
                for s in range(steps):
                    start = time.perf_counter()
                    with trace.step(s, trainer):  # --trace: a span, then the memory ledger (a no-op without)
                        trainer.step(s)
                        seconds.append(time.perf_counter() - start)
                report = trainer.pipeline_report()
                sent = traffic.snapshot().get("pipeline", {})
                records.append({**report, "balance_stages": balance_stages if v == 1 else "blocks",
                                "step_seconds": float(np.median(seconds[1:] or seconds)),
                                "messages": sent.get("messages", 0) // steps,
                                "bytes_sent": sent.get("bytes_sent", 0) // steps,
                                "bubble_per_step": trainer.bubbles, "events": trainer.step_events(),
                                "memory": trainer.memory()})
    trace.end(trace_path, get_world())
    return records


def print_table(records) -> None:
    p = records[0]["stages"]
    print(f"pipeline of p={p} stages (one per rank); bubble = idle share of the step's compute span")
    print("simulated = the schedule run with each stage's measured forward and backward times, messages free")
    print("replayed = the same with each forward and backward's own measured time (the run's jitter in)")
    print(f"{'schedule':16s} {'blocks':>7s} {'m':>3s} {'measured':>9s} {'replayed':>9s} {'modelled':>9s} {'simulated':>9s} {'theory':>7s} {'step ms':>8s}"
          f" {'msgs':>5s} {'MB sent':>8s}  peak activations per rank")
    for r in records:
        peaks = "  ".join(f"{a['microbatches']} ({a['bytes'] / 1e6:.1f} MB)" for a in r["peak_activations"])
        name = r["schedule"] + (f" v={r['virtual_stages']}" if r["virtual_stages"] > 1 else "")
        cut = "+".join(str(b) for b in r["stage_blocks"])
        print(f"{name:16s} {cut:>7s} {r['microbatches']:3d} {r['bubble_measured']:9.3f} {r['bubble_replayed']:9.3f} {r['bubble_modelled']:9.3f} {r['bubble_simulated']:9.3f} "
              f"{r['bubble_theory']:7.3f} {r['step_seconds'] * 1e3:8.1f} {r['messages']:5d} "
              f"{r['bytes_sent'] / 1e6:8.2f}  {peaks}")
    for r in records[:1]:
        costs = ", ".join(f"rank {s['rank']}{'.' + str(s['chunk']) if r['virtual_stages'] > 1 else ''}: "
                          f"F {s['forward'] * 1e3:.2f} B {s['backward'] * 1e3:.2f} ms" for s in r["stage_seconds"])
        print(f"stage costs per micro-batch ({r['schedule']}, m={r['microbatches']}): {costs}")


def main(argv=None):
    from minidist.comm import faults, get_world
    from minidist.parallel.pipeline import check_pipeline_layout
    from minidist.runtime import limit_threads_per_rank

    faults.install()
    positive = cli.integer(1)
    parser = cli.OneLineParser(prog="python -m minidist.bench pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=cli.listof(positive), default=[1, 2, 4, 8])
    parser.add_argument("--schedules", type=cli.listof(cli.one_of(["gpipe", "1f1b", "interleaved"])),
                        default=["gpipe", "1f1b"])
    parser.add_argument("--virtual-stages", type=positive, default=2, help="chunks per rank of the interleaved schedule")
    parser.add_argument("--steps", type=positive, default=4)
    parser.add_argument("--batch-size", type=positive, default=16)
    parser.add_argument("--balance-stages", type=cli.one_of(["blocks", "time"]), default="blocks",
                        help="cut the blocks into stages by count, or by measured cost (interleaved: by count)")
    parser.add_argument("--vocab-size", type=cli.integer(2, 1 << 16), default=DEFAULT_CONFIG["vocab_size"],
                        help="a larger vocabulary makes the last stage's head heavier")
    parser.add_argument("--n-layer", type=cli.integer(1, 64), default=DEFAULT_CONFIG["n_layer"])
    parser.add_argument("--json", type=cli.output_file, help="write the records (without events) to this file (rank 0)")
    parser.add_argument("--trace", type=cli.output_file, help="write the job's trace (Chrome Trace Event Format) here")
    args = parser.parse_args(argv)
    world = get_world()
    shape = {**DEFAULT_CONFIG, "vocab_size": args.vocab_size, "n_layer": args.n_layer}
    config = GPTConfig(**shape)
    for schedule in args.schedules:  # the same verdict on every rank, before any message
        for m in args.microbatches:
            if schedule == "interleaved" and m % world.size:
                continue  # measure() skips it
            try:
                check_pipeline_layout(config, args.batch_size, world.size, m, schedule,
                             args.virtual_stages if schedule == "interleaved" else 1)
            except ValueError as error:
                parser.error(f"--schedules {schedule} --microbatches {m} --batch-size {args.batch_size} "
                             f"--n-layer {args.n_layer} on {world.size} ranks: {error}")
    limit_threads_per_rank()  # ranks share the machine's cores (chapter 2)
    records = measure(args.schedules, args.microbatches, args.steps, args.batch_size, config=shape,
                      virtual_stages=args.virtual_stages, trace_path=args.trace, balance_stages=args.balance_stages)
    if world.rank == 0:
        print_table(records)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([{k: v for k, v in r.items() if k != "events"} for r in records], f, indent=1)
    return 0
