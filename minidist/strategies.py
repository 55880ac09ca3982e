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
    dp2-tp2 ... two or three of --dp --tp --pp     MeshTrainer (composed.py)     9
    cp4, dp2-cp2  --cp N [--dp M] [--cp-algorithm ulysses] [--cp-split contiguous]
                                                   ContextParallelTrainer        11
                ... --zero 1                       MeshZero1Trainer
                --dp --tp (no --pp) --zero 2|3     TensorParallelZero2/3Trainer (zero_tensor.py)

A composed layout's name lists its degrees above 1 in the mesh's order, then "sp" and the ZeRO
stage: "dp2-tp2", "tp2-pp2", "dp2-tp2-pp2-zero1", "dp2-tp2-sp-zero3". Its degrees multiply to
the world size. With a pipeline, --microbatches M cuts each replica's batch; without one,
--accumulation k does (a one-stage pipeline of k micro-batches).
"""
from __future__ import annotations

import re

from minidist.moe import MoEConfig, MoETrainer
from minidist.parallel import zero_tensor
from minidist.parallel.balance import BalancedDataParallelTrainer
from minidist.parallel.composed import MeshTrainerFor, check_composed, mesh_name
from minidist.parallel.context_parallel import (ContextParallelTrainer, check_context_parallel, context_parallel_name,
                                                parse_context_parallel_name)
from minidist.parallel.data_parallel import DataParallelTrainer
from minidist.parallel.expert_parallel import ExpertParallelTrainer, check_expert_parallel
from minidist.parallel.pipeline import PipelineTrainer
from minidist.parallel.pipeline import check_layout as check_pipeline
from minidist.parallel.tensor_parallel import TensorParallelTrainer, check_tensor_parallel
from minidist.parallel.zero import ZeroTrainer
from minidist.train import OptimSettings, SerialTrainer

SERIAL = {"dp": 1, "tp": 1, "pp": 1, "zero": 0}


def choose(args, config, world_size: int) -> tuple[str | None, dict]:
    """(kind, layout) for the flags, or (None, SERIAL) for the tour; ValueError names the problem.

    Pure arithmetic on the flags, so every rank reaches the same verdict before any message."""
    if getattr(args, "cp", None) is not None:
        return choose_context_parallel(args, config, world_size)
    if isinstance(config, MoEConfig) or getattr(args, "ep", None) is not None:
        return choose_moe(args, config, world_size)
    given = {name: getattr(args, name) for name in ("dp", "tp", "pp") if getattr(args, name) is not None}
    if len(given) > 1:  # a degree of 1 adds nothing: --dp 4 --tp 1 is --dp 4
        given = {name: degree for name, degree in given.items() if degree > 1} or {next(iter(given)): 1}
    if len(given) > 1:
        return low_precision_kind(*choose_mesh(args, config, world_size, given), args)
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
    return low_precision_kind(kind, layout, args)


EXPERT_PARALLEL_NAME = re.compile(r"dp(\d+)-ep(\d+)")


def choose_moe(args, config, world_size: int) -> tuple[str, dict]:
    """(kind, layout) of a mixture-of-experts run (chapter 11): "moe" on one rank, or data
    parallelism with the experts split over groups of --ep ranks: "dp4-ep2"."""
    if not isinstance(config, MoEConfig):
        raise ValueError("--ep needs --experts E (expert parallelism splits the experts of a MoE model)")
    others = [f"--{name}" for name in ("tp", "pp", "zero") if getattr(args, name)]
    others += [flag for flag, on in (("--sequence-parallel", args.sequence_parallel), ("--naive-dp", args.naive_dp),
                                     ("--balance", getattr(args, "balance", False)),
                                     ("--accumulation", args.accumulation != 1)) if on]
    if others:
        raise ValueError(f"--experts combines with --dp and --ep only, not with {' '.join(others)}")
    dp, ep = args.dp or 1, args.ep or 1
    if dp != world_size:  # every rank is a data-parallel replica; --ep groups some of them
        raise ValueError(f"--experts on {world_size} ranks needs --dp {world_size}, got --dp {dp} (run: mpirun -n "
                         f"{world_size} python -m minidist.demo --experts {config.num_experts} --dp {world_size} --ep {ep})")
    check_expert_parallel(config, world_size, ep, args.batch_size)
    if world_size == 1:
        return "moe", dict(SERIAL)
    return f"dp{dp}-ep{ep}", {**SERIAL, "dp": dp, "ep": ep}


def choose_context_parallel(args, config, world_size: int) -> tuple[str, dict]:
    """(kind, layout) of --cp N [--dp M] (chapter 11): each sequence split over cp ranks."""
    others = [flag for flag in ("tp", "pp") if getattr(args, flag) not in (None, 1)]
    others += [flag for flag in ("zero", "sequence_parallel", "balance", "naive_dp", "experts", "ep")
               if getattr(args, flag, None)]
    if others:
        raise ValueError(f"--cp combines with --dp only, not --{others[0].replace('_', '-')}")
    if args.accumulation != 1:
        raise ValueError("--cp runs one step per batch: leave --accumulation 1")
    dp = args.dp or 1
    if args.cp * dp != world_size:
        flags = f"--cp {args.cp}" + (f" --dp {dp}" if args.dp else "")
        raise ValueError(f"layout cp={args.cp} x dp={dp} needs {args.cp * dp} ranks, but this job has {world_size} "
                         f"(run: mpirun -n {args.cp * dp} python -m minidist.demo {flags})")
    try:
        check_context_parallel(config, args.cp, dp, world_size, args.batch_size, args.cp_algorithm, args.cp_split)
    except ValueError as why:
        raise ValueError(f"--cp {args.cp}: {why}") from None
    return context_parallel_name(args.cp, dp, args.cp_algorithm, args.cp_split), {**SERIAL, "dp": dp, "cp": args.cp}


def low_precision_kind(kind: str, layout: dict, args) -> tuple[str, dict]:
    """Chapter 10: in bf16 or fp16, tensor and pipeline layouts run on the mesh trainer (which
    carries the master weights and the loss scaler through every combination): "tp" becomes
    "tp4", "pp-1f1b" "pp4". The other kinds carry them themselves."""
    model_parallel_alone = kind in ("tp", "tp-sp", "mp") or kind.startswith("pp-")
    if getattr(args, "precision", "fp32") == "fp32" or not model_parallel_alone:
        return kind, layout
    return mesh_name(layout["dp"], layout["tp"], layout["pp"], sequence_parallel=kind == "tp-sp"), layout


def choose_mesh(args, config, world_size: int, given: dict) -> tuple[str, dict]:
    """(kind, layout) of a composed layout: two or three of --dp --tp --pp (chapter 9)."""
    degrees = {"dp": 1, "tp": 1, "pp": 1, **given}
    product = degrees["dp"] * degrees["tp"] * degrees["pp"]
    if product != world_size:
        flags = " ".join(f"--{k} {v}" for k, v in given.items())
        raise ValueError(f"layout {' x '.join(f'{k}={v}' for k, v in given.items())} needs {product} ranks, but this job "
                         f"has {world_size} (run: mpirun -n {product} python -m minidist.demo {flags})")
    for flag in ("balance", "naive_dp"):
        if getattr(args, flag, False):
            raise ValueError(f"--{flag.replace('_', '-')} needs --dp alone (it changes plain data parallelism)")
    if args.sequence_parallel and degrees["tp"] == 1:
        raise ValueError("--sequence-parallel needs --tp N (it splits what tensor parallelism replicates)")
    zero = args.zero or 0
    if zero and degrees["dp"] == 1:
        raise ValueError("--zero needs --dp N (ZeRO partitions the data-parallel replicas)")
    if degrees["pp"] > 1 and args.accumulation != 1:
        raise ValueError("--accumulation with --pp: a pipeline's micro-batches are its accumulation (use --microbatches)")
    if zero >= 2 and degrees["pp"] == 1 and args.accumulation != 1:
        raise ValueError(f"--accumulation with --zero {zero}: stages 2-3 shard the gradients, which accumulation "
                         "would need whole (use --zero 1)")
    schedule = args.schedule
    m = args.microbatches if degrees["pp"] > 1 else args.accumulation
    check_composed(config, world_size, args.batch_size, **degrees, microbatches=m, schedule=schedule,
                   virtual_stages=_virtual(args, schedule), sequence_parallel=args.sequence_parallel,
                   zero=zero if degrees["pp"] > 1 else min(zero, 1))
    return mesh_name(**degrees, zero=zero, sequence_parallel=args.sequence_parallel), {**degrees, "zero": zero}


MESH_NAME = re.compile(r"(?:dp(\d+))?-?(?:tp(\d+))?-?(?:pp(\d+))?(-sp)?(?:-zero(\d))?")


def parse_mesh_name(kind: str) -> dict | None:
    """{"dp", "tp", "pp", "sequence_parallel", "zero"} of a mesh trainer's name ("dp2-tp2", and
    in 16 bits also "tp4" or "pp4"), else None. A plain "dp" never runs on the mesh."""
    match = MESH_NAME.fullmatch(kind)
    if not match or match.group(2) is None and match.group(3) is None:  # no tp, no pp: not a mesh
        return None
    dp, tp, pp, sp, zero = match.groups()
    return {"dp": int(dp or 1), "tp": int(tp or 1), "pp": int(pp or 1), "sequence_parallel": bool(sp),
            "zero": int(zero or 0)}


def make_mesh_trainer(mesh: dict, args, config, task, world, settings):
    """The composed trainer: ZeRO-2/3 over dp x tp shards, or the pipeline mesh (ZeRO-0/1)."""
    if mesh["zero"] >= 2:
        trainer = zero_tensor.STAGES[mesh["zero"]]
        return trainer(config, settings, task, args.batch_size, seed=args.seed, group=world, dp=mesh["dp"],
                       tp=mesh["tp"], sequence_parallel=mesh["sequence_parallel"],
                       precision=getattr(args, "precision", "fp32"))
    pipeline = mesh["pp"] > 1
    return MeshTrainerFor(mesh["zero"])(
        config, settings, task, args.batch_size, seed=args.seed, group=world, dp=mesh["dp"], tp=mesh["tp"],
        pp=mesh["pp"], microbatches=args.microbatches if pipeline else args.accumulation,
        schedule=args.schedule if pipeline else "1f1b", virtual_stages=_virtual(args, args.schedule) if pipeline else 1,
        sequence_parallel=mesh["sequence_parallel"], bucket_cap_bytes=args.bucket_kb * 1024,
        fp32_grads=getattr(args, "fp32_grads", False),
        precision=getattr(args, "precision", "fp32"))


RECOMPUTE_FULL = ("serial", "dp", "dp-naive", "zero1", "zero2", "mp")  # and pipelines, meshes with ZeRO 0-1


def check_recompute_layout(kind: str | None, args) -> None:
    """--recompute reaches the layouts whose forward runs the model's blocks in a loop it owns
    (chapter 11): the whole GPT, a pipeline stage, a mesh's stage (full only with tensor parallelism).
    One line, before any message."""
    mode = getattr(args, "recompute", "none")
    if mode == "none" or kind is None:
        return
    mesh = parse_mesh_name(kind)
    if kind in RECOMPUTE_FULL or kind.startswith("pp-") or (mesh is not None and mesh["zero"] <= 1):
        if mode == "selective" and mesh is not None and mesh["tp"] > 1:
            raise ValueError("--recompute selective is written for the serial attention, not the tensor-parallel "
                             "one: use --recompute full with --tp")
        if getattr(args, "segments", None) is not None and kind != "serial" and not kind.startswith(("dp", "zero")):
            raise ValueError("--segments groups the whole model's blocks: a pipeline stage checkpoints each of its "
                             "blocks (drop --segments)")
        return
    raise ValueError(f"--recompute {mode} is not built for the {kind} layout (the model's blocks run inside "
                     "FSDP's or tensor parallelism's own loop there): use it with serial, --dp, --zero 1/2, --pp "
                     "or a composed layout")


def check_fp32_grads(kind: str | None, args) -> None:
    """--fp32-grads (chapter 10): the gradients of 16-bit weights kept and all-reduced in fp32 by
    data parallelism's buckets. One line, before any message, where it cannot apply."""
    if not getattr(args, "fp32_grads", False):
        return
    if getattr(args, "precision", "fp32") == "fp32":
        raise ValueError("--fp32-grads keeps the gradients of 16-bit weights in fp32: it needs --precision bf16|fp16")
    mesh = parse_mesh_name(kind) if kind else None
    if kind != "dp" and (mesh is None or mesh["zero"]):
        raise ValueError(f"--fp32-grads applies to data parallelism's buckets (--dp N, or a composed layout without "
                         f"--zero), not to the {kind or 'tour'} layout")


def apply_recompute(trainer, args) -> None:
    """Switch the trainer's model (or stage) to --recompute (checked by check_recompute_layout)."""
    mode = getattr(args, "recompute", "none")
    if mode == "none":
        return
    stage = getattr(trainer, "stage", None)
    if stage is None or isinstance(stage, int):  # the whole GPT (ZeRO's `stage` is its number)
        model = trainer.model if trainer.model is not None else trainer.module
        model.set_recompute(mode, getattr(args, "segments", None))
    else:
        stage.set_recompute(mode)


def make_trainer(kind: str, args, config, task, world):
    trainer = build_trainer(kind, args, config, task, world)
    apply_recompute(trainer, args)
    return trainer


def build_trainer(kind: str, args, config, task, world):
    settings = OptimSettings(lr=args.lr, steps=args.steps, warmup=min(10, args.steps // 10), min_lr=args.lr / 10,
                             initial_loss_scale=getattr(args, "initial_loss_scale", 2.0**16),
                             loss_scale_window=getattr(args, "loss_scale_window", 2000))
    common = dict(seed=args.seed)
    precision = getattr(args, "precision", "fp32")
    if kind == "moe":
        return MoETrainer(config, settings, task, args.batch_size, precision=precision, **common)
    if EXPERT_PARALLEL_NAME.fullmatch(kind):
        return ExpertParallelTrainer(config, settings, task, args.batch_size, group=world, ep=args.ep or 1,
                                     precision=precision, **common)
    mesh = parse_mesh_name(kind)
    if mesh is not None:
        return make_mesh_trainer(mesh, args, config, task, world, settings)
    context = parse_context_parallel_name(kind)
    if context is not None:
        return ContextParallelTrainer(config, settings, task, args.batch_size, group=world,
                                      precision=getattr(args, "precision", "fp32"), **context, **common)
    if kind == "serial":
        return SerialTrainer(config, settings, task, args.batch_size, precision=precision, **common)
    if kind in ("dp", "dp-naive"):
        trainer = BalancedDataParallelTrainer if getattr(args, "balance", False) else DataParallelTrainer
        return trainer(config, settings, task, args.batch_size, group=world, overlap=kind == "dp",
                       bucket_cap_bytes=args.bucket_kb * 1024, accumulation=args.accumulation,
                       fp32_grads=getattr(args, "fp32_grads", False),
                       precision=precision, **common)
    if kind in ("tp", "tp-sp"):
        return TensorParallelTrainer(config, settings, task, args.batch_size, group=world,
                                     sequence_parallel=kind == "tp-sp", **common)
    if kind.startswith("zero"):
        return ZeroTrainer(config, settings, task, args.batch_size, group=world, stage=int(kind[-1]),
                           precision=precision, **common)
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
    try:  # chapter 11: each sequence split over the n ranks, attention in a ring
        check_context_parallel(config, n, 1, n, args.batch_size)
        plan.append((context_parallel_name(n), {**SERIAL, "cp": n}, None))
    except ValueError as why:
        skipped.append(f"cp: {why}")
    plan += [(kind, layout, None) for kind, layout in mesh_plan(args, config, n)]
    plan = [(low_precision_kind(kind, layout, args)[0], layout, ranks) for kind, layout, ranks in plan]
    if getattr(args, "recompute", "none") != "none":  # chapter 11: the rows it reaches
        kept = []
        for row in plan:
            try:
                check_recompute_layout(row[0], args)
                kept.append(row)
            except ValueError as why:
                skipped.append(f"{row[0]}: {why}")
        plan = kept
    return plan, skipped


def mesh_plan(args, config, world_size: int) -> list[tuple[str, dict]]:
    """Every composed layout of this world (at least two degrees above 1) that the model allows,
    with the flags' micro-batches and schedule (chapter 9's rows of the tour)."""
    plan = []
    for dp in range(1, world_size + 1):
        for tp in range(1, world_size // dp + 1):
            pp = world_size // (dp * tp)
            if dp * tp * pp != world_size or sum(d > 1 for d in (dp, tp, pp)) < 2:
                continue
            m = args.microbatches if pp > 1 else 1
            try:
                check_composed(config, world_size, args.batch_size, dp, tp, pp, m, args.schedule,
                               _virtual(args, args.schedule))
            except ValueError:
                continue
            plan.append((mesh_name(dp, tp, pp), {"dp": dp, "tp": tp, "pp": pp, "zero": 0}))
    return sorted(plan, key=lambda row: (-row[1]["dp"], -row[1]["tp"]))  # dp x tp, dp x pp, tp x pp


def _virtual(args, schedule: str) -> int:
    """Chunks per rank: --virtual-stages for the interleaved schedule, 1 for the others."""
    return getattr(args, "virtual_stages", 2) if schedule == "interleaved" else 1
