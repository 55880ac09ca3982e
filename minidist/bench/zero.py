"""Benchmark: memory and traffic per rank under ZeRO stages 0-3, measured beside the formulas (chapter 8).

    mpirun -n 4 python -m minidist.bench zero [--stages 0,1,2,3] [--steps 2] [--json PATH] [--trace PATH]

Stage 0 is plain data parallelism (DataParallelTrainer, ring all-reduce). For each stage it
trains the demo's GPT for a few float32 steps on the ranks of the job and prints, per rank:
the model states it keeps (params + grads + AdamW moments) against `memory.model_state_bytes`
for plain-precision AdamW (4 + 4 + 8 bytes per parameter), the step's peak (adds activations,
gathered units and gradient buckets), and the bytes it sent per step against the formula
(`comm.cost.zero_bytes_sent`):

    stage 0   ring all-reduce                        2 (N-1)/N x 4Ψ
    stage 1-2 reduce-scatter + all-gather            2 (N-1)/N x 4Ψ       (the same)
    stage 3   + a second all-gather of the blocks    (N-1)/N x 4(2Ψ + Ψ_blocks)   (~1.5x)

Measured model states exceed the formula by the padding (each unit rounded up to a multiple of
N elements): a few bytes. `measure(...)` is the rank program notebooks call through
`minidist.comm.launch.run`. With --trace PATH every stage's steps go into one trace of the job
(minidist/trace/): ZeRO-3's gathers before each block, its reduce-scatters in backward.
"""
from __future__ import annotations

import json

from minidist import cli
from minidist.plan import memory
from minidist.comm.cost import zero_bytes_sent
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.training.train import OptimSettings

DEFAULT_CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def measure(stages=(0, 1, 2, 3), steps: int = 2, batch_size: int = 16, config: dict | None = None,
            dtype: str = "float32", trace_path: str | None = None) -> list[dict]:
    """Rank program: one record per stage with this rank's memory ledger and traffic per step
    (with `trace_path`, the job's trace written there by rank 0)."""
    from minidist import trace
    from minidist.comm import get_world, traffic
    from minidist.parallel.data_parallel import DataParallelTrainer
    from minidist.parallel.zero import ZeroTrainer, make_units
    from minidist.core.model import GPT
    from minidist.core.tensor import default_dtype

    world = get_world()
    n = world.size
    config = GPTConfig(**(config or DEFAULT_CONFIG))
    settings = OptimSettings(lr=3e-3, steps=steps, warmup=1)
    records = []
    if trace_path:
        trace.begin(world, {"command": "python -m minidist.bench zero", "world_size": n})
    with default_dtype(dtype):
        task = make_task("sort", config.block_size, seed=0)
        itemsize = GPT(config).wte.weight.dtype.itemsize
        units = [u.numel for u in make_units(GPT(config), n, world.rank)]
        num_params = sum(units)
        for stage in stages:
            if stage == 0:
                trainer = DataParallelTrainer(config, settings, task, batch_size, group=world, algorithm="ring",
                                              bucket_cap_bytes=1 << 30)
            else:
                trainer = ZeroTrainer(config, settings, task, batch_size, group=world, stage=stage)
            traffic.reset()
            for s in range(steps):
                with trace.step(s, trainer):  # --trace: a span, then the memory ledger (a no-op without)
                    trainer.step(s)
            kinds = traffic.snapshot()
            sent = {k: v["bytes_sent"] / steps for k, v in kinds.items() if k not in ("total", "check")}
            ledger = trainer.memory()
            scale = itemsize / 4  # the formula's fp32 bytes, in this run's dtype
            formula = {k: v * scale for k, v in memory.model_state_bytes(num_params, n, stage, "fp32").items()}
            records.append({
                "stage": stage, "dp": n, "rank": world.rank, "num_params": num_params, "units": units,
                "memory": ledger, "model_states": ledger["params"] + ledger["grads"] + ledger["optimizer"],
                "formula": formula,
                # the ZeRO paper's mixed-precision Adam (2 + 2 + 12 bytes), for the same model
                "formula_mixed": memory.model_state_bytes(num_params, n, stage, "mixed"),
                "bytes_sent_per_step": sent,
                "collective_bytes_per_step": sum(v for k, v in sent.items()
                                                 if k.split(".")[0] in ("all_reduce", "reduce_scatter", "all_gather")),
                "traffic_formula": zero_bytes_sent(stage, n, units, itemsize),
            })
    trace.end(trace_path, world)
    return records


def main(argv=None) -> int:
    parser = cli.OneLineParser(prog="python -m minidist.bench zero", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=cli.listof(cli.integer(0, 3)), default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=cli.integer(1), default=2)
    parser.add_argument("--batch-size", type=cli.integer(1), default=16)
    parser.add_argument("--json", metavar="PATH", type=cli.output_file)
    parser.add_argument("--trace", metavar="PATH", type=cli.output_file,
                        help="write the job's trace (Chrome Trace Event Format) here")
    args = parser.parse_args(argv)
    from minidist.comm import get_world
    from minidist.runtime import limit_threads_per_rank

    world = get_world()
    if args.batch_size % world.size:  # the same verdict on every rank, before any message
        parser.error(f"--batch-size {args.batch_size} is not divisible by the {world.size} ranks")
    limit_threads_per_rank()  # ranks share the machine's cores (chapter 2)
    records = measure(args.stages, args.steps, args.batch_size, trace_path=args.trace)
    everyone = world.comm.gather(records, root=0)
    if world.rank != 0:
        return 0
    n = world.size
    print(f"ZeRO on dp={n}, GPT {DEFAULT_CONFIG}, Ψ = {records[0]['num_params']:,} float32 parameters; "
          "per rank (rank 0), bytes")
    print(f"{'stage':>5} {'params':>10} {'grads':>10} {'optimizer':>10} {'states':>10} {'formula':>10} "
          f"{'peak':>10} {'sent/step':>10} {'formula':>10} {'x stage 0':>9}")
    base = records[0]["collective_bytes_per_step"] if records[0]["stage"] == 0 else None
    for r in records:
        m = r["memory"]
        ratio = f"{r['collective_bytes_per_step'] / base:9.2f}" if base else f"{'':9s}"
        print(f"{r['stage']:>5} {m['params']:>10,} {m['grads']:>10,} {m['optimizer']:>10,} {r['model_states']:>10,} "
              f"{r['formula']['total']:>10,.0f} {m['peak']:>10,} {r['collective_bytes_per_step']:>10,.0f} "
              f"{r['traffic_formula']:>10,.0f} {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([rec for rank in everyone for rec in rank], f, indent=1)
    return 0
