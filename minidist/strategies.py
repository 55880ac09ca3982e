"""Every strategy by name: which layout flags choose it, how to check them, how to build it.

Chapter 9 in miniature. The strategies in `minidist/parallel/` know nothing of each other;
this is the one place that knows them all, for the demo and its tour. Each strategy is a
`train.Trainer`: `name`, `step(step) -> (loss, accuracy)`, `memory()`, `state_dict()`
(collective: rank 0 receives the whole model), `num_parameters()`, `report()`, `model`.

    kind        layout flags                       trainer                       chapter
    serial      (none, one rank)                   SerialTrainer                 1
    dp          --dp N                             DataParallelTrainer           3
    dp-naive    --dp N --naive-dp                  ... (overlap=False)           3
    (either)    ... --balance: rows split by speed BalancedDataParallelTrainer   3
    mp          --pp N --microbatches 1            PipelineTrainer               4
    pp-gpipe    --pp N --microbatches M --schedule gpipe                         5
    pp-1f1b     --pp N --microbatches M --schedule 1f1b                          5
    pp-interleaved  --pp N --microbatches M --schedule interleaved [--virtual-stages V]   5
    tp          --tp N                             TensorParallelTrainer         6
    tp-sp       --tp N --sequence-parallel         ... (SequenceParallelGPT)     6
    zero1..3    --dp N --zero S                    Zero1Trainer .. Zero3Trainer  8

Layouts that combine several degrees (DP x TP x PP) are not built yet: a layout names one.
"""
from __future__ import annotations

from minidist.parallel.balance import BalancedDataParallelTrainer
from minidist.parallel.data_parallel import DataParallelTrainer
from minidist.parallel.pipeline import PipelineTrainer
from minidist.parallel.pipeline import check_layout as check_pipeline
from minidist.parallel.tensor_parallel import TensorParallelTrainer, check_tensor_parallel
from minidist.parallel.zero import ZeroTrainer
from minidist.train import OptimSettings, SerialTrainer

SERIAL = {"dp": 1, "tp": 1, "pp": 1, "zero": 0}


def choose(args, config, world_size: int) -> tuple[str | None, dict]:
    """(kind, layout) for the flags, or (None, SERIAL) for the tour; ValueError names the problem.

    Pure arithmetic on the flags, so every rank reaches the same verdict before any message."""
    given = {name: getattr(args, name) for name in ("dp", "tp", "pp") if getattr(args, name) is not None}
    if len(given) > 1:
        raise ValueError(f"combining {' and '.join('--' + k for k in given)} is not supported yet: pick one")
    if args.zero and "dp" not in given:
        raise ValueError("--zero needs --dp N (ZeRO partitions the data-parallel replicas)")
    if args.accumulation != 1 and ("dp" not in given or args.zero):
        raise ValueError("--accumulation needs --dp without --zero (gradient accumulation is part of data parallelism)")
    if getattr(args, "balance", False) and ("dp" not in given or args.zero):
        raise ValueError("--balance needs --dp without --zero (it re-splits the data-parallel batch)")
    if args.sequence_parallel and "tp" not in given:
        raise ValueError("--sequence-parallel needs --tp N (it splits what tensor parallelism replicates)")
    if not given:
        return (None if world_size > 1 else "serial"), dict(SERIAL)
    (name, degree), = given.items()
    if degree != world_size:
        raise ValueError(f"layout {name}={degree} needs {degree} ranks, but this job has {world_size} "
                         f"(run: mpirun -n {degree} python -m minidist.demo --{name} {degree})")
    layout = {**SERIAL, name: degree, "zero": args.zero or 0}
    if name == "dp":
        if args.batch_size % (degree * args.accumulation):
            raise ValueError(f"--batch-size {args.batch_size} (the global batch) is not divisible by dp={degree} x "
                             f"accumulation={args.accumulation}")
        kind = f"zero{args.zero}" if args.zero else ("dp-naive" if args.naive_dp else "dp")
    elif name == "tp":
        check_tensor_parallel(config, degree, args.sequence_parallel)
        kind = "tp-sp" if args.sequence_parallel else "tp"
    else:
        check_pipeline(config, args.batch_size, degree, args.microbatches, args.schedule, _virtual(args, args.schedule))
        kind = "mp" if args.microbatches == 1 and args.schedule != "interleaved" else f"pp-{args.schedule}"
    return kind, layout


def make_trainer(kind: str, args, config, task, world):
    settings = OptimSettings(lr=args.lr, steps=args.steps, warmup=min(10, args.steps // 10), min_lr=args.lr / 10)
    common = dict(seed=args.seed)
    if kind == "serial":
        return SerialTrainer(config, settings, task, args.batch_size, **common)
    if kind in ("dp", "dp-naive"):
        trainer = BalancedDataParallelTrainer if getattr(args, "balance", False) else DataParallelTrainer
        return trainer(config, settings, task, args.batch_size, group=world, overlap=kind == "dp",
                       bucket_cap_bytes=args.bucket_kb * 1024, accumulation=args.accumulation, **common)
    if kind in ("tp", "tp-sp"):
        return TensorParallelTrainer(config, settings, task, args.batch_size, group=world,
                                     sequence_parallel=kind == "tp-sp", **common)
    if kind.startswith("zero"):
        return ZeroTrainer(config, settings, task, args.batch_size, group=world, stage=int(kind[-1]), **common)
    if kind == "mp":
        return PipelineTrainer(config, settings, task, args.batch_size, group=world, microbatches=1, **common)
    if kind.startswith("pp-"):
        return PipelineTrainer(config, settings, task, args.batch_size, group=world, microbatches=args.microbatches,
                               schedule=kind[3:], virtual_stages=_virtual(args, kind[3:]), **common)
    raise ValueError(f"unknown strategy {kind!r}")


def tour_plan(args, config, world_size: int) -> tuple[list, list[str]]:
    """[(kind, layout, ranks)] for every strategy this world and model allow, and why others are
    skipped. ranks=None means every rank takes part."""
    n = world_size
    plan = [("serial", dict(SERIAL), [0]),
            ("dp", {**SERIAL, "dp": n}, None),
            ("dp-naive", {**SERIAL, "dp": n}, None)]
    plan += [(f"zero{s}", {**SERIAL, "dp": n, "zero": s}, None) for s in (1, 2, 3)]
    skipped = []
    try:
        check_tensor_parallel(config, n)
        plan.append(("tp", {**SERIAL, "tp": n}, None))
        check_tensor_parallel(config, n, sequence_parallel=True)
        plan.append(("tp-sp", {**SERIAL, "tp": n}, None))
    except ValueError as why:
        skipped.append(f"tp: {why}")
    try:
        check_pipeline(config, args.batch_size, n, args.microbatches, args.schedule)
        plan.append(("mp", {**SERIAL, "pp": n}, None))
        plan += [(f"pp-{schedule}", {**SERIAL, "pp": n}, None) for schedule in ("gpipe", "1f1b")]
    except ValueError as why:
        skipped.append(f"pp: {why}")
    else:
        try:  # interleaved needs n_layer >= pp x V and m a multiple of pp
            check_pipeline(config, args.batch_size, n, args.microbatches, "interleaved", _virtual(args, "interleaved"))
            plan.append(("pp-interleaved", {**SERIAL, "pp": n}, None))
        except ValueError as why:
            skipped.append(f"pp-interleaved: {why}")
    return plan, skipped


def _virtual(args, schedule: str) -> int:
    """Chunks per rank: --virtual-stages for the interleaved schedule, 1 for the others."""
    return getattr(args, "virtual_stages", 2) if schedule == "interleaved" else 1
