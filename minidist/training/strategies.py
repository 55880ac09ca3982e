"""Every strategy by its layout: how to build the trainer that runs it (chapter 9 in miniature).

The strategies in `minidist/parallel/` know nothing of each other; this is the one place that
knows them all. Which layouts are valid is `Layout.validate`'s to say (`minidist/training/layout.py`), and
which trainer runs one is `layout.strategy`'s; here each is built. Every strategy is a
`train.Trainer`: `name`, `step(step) -> (loss, accuracy)`, `memory()`, `state_dict()`
(collective: rank 0 receives the whole model), `num_parameters()`, `report()`, `model`.

    strategy      layout (its name)                  trainer                       chapter
    serial        serial                             SerialTrainer                 1
    dp            dp4 [-m2 accumulation]             DataParallelTrainer           3
    dp-naive      dp4-naive                          ... (overlap=False)           3
    (either)      dp4-balance: rows split by speed   BalancedDataParallelTrainer   3
    mp            pp4 (one micro-batch)              PipelineTrainer               4
    pp-1f1b       pp4-m8 [-gpipe | -interleaved-v2]  PipelineTrainer               5
    tp, tp-sp     tp4 [-sp]                          TensorParallelTrainer         6
    zero1..3      dp4-zero2 [-m2]                    Zero1Trainer .. Zero3Trainer  8
    dp2-tp2 ...   two or three of dp, tp, pp         MeshTrainer (composed.py)     9
                  ... -zero1                         MeshZero1Trainer              9
                  dp2-tp2-zero2|3 (no pp)            zero_tensor's ZeRO over tp shards
    cp4, dp2-cp2  [-ulysses] [-contiguous]           ContextParallelTrainer        11
    tp2-cp2 ...   cp with tp, pp, ZeRO-1 or m > 1    MeshTrainer (context_stage.py) 9, 11
    moe, dp4-ep2  with --experts E                   MoETrainer, ExpertParallelTrainer  11
    dp2-pp2-ep2   --experts E with --tp, --pp or -m  ExpertMeshTrainer (expert_stage.py) 11
                  ... -zero1                         ExpertMeshZero1Trainer        11

Every trainer holds one `mixed_precision.Precision` (the format, the fp32 masters, the loss
scaler), so each layout runs the same code in every precision. Tensor parallelism with
accumulation runs on the mesh trainer (a one-stage pipeline of m micro-batches).
"""
from __future__ import annotations

from dataclasses import replace

from minidist.training.layout import Layout, strategy
from minidist.core.moe import MoEConfig
from minidist.training.train import MoETrainer
from minidist.parallel import zero_tensor
from minidist.parallel.balance import BalancedDataParallelTrainer
from minidist.parallel.composed import MeshTrainerFor
from minidist.parallel.context_parallel import ContextParallelTrainer, context_parallel_name
from minidist.parallel.data_parallel import DataParallelTrainer
from minidist.parallel.expert_parallel import ExpertParallelTrainer
from minidist.parallel.expert_stage import ExpertMeshTrainer, ExpertMeshZero1Trainer
from minidist.parallel.pipeline import PipelineTrainer
from minidist.parallel.tensor_parallel import TensorParallelTrainer
from minidist.parallel.zero import ZeroTrainer
from minidist.training.train import OptimSettings, SerialTrainer


def optim_settings(args) -> OptimSettings:
    """The optimizer's schedule and the loss scaler's settings from the demo's flags (a framework
    config has set them first where it gives them, chapter 9)."""
    warmup, min_lr = getattr(args, "warmup", None), getattr(args, "min_lr", None)
    return OptimSettings(lr=args.lr, steps=args.steps, warmup=min(10, args.steps // 10) if warmup is None else warmup,
                         min_lr=args.lr / 10 if min_lr is None else min_lr,
                         weight_decay=getattr(args, "weight_decay", 0.1), clip=getattr(args, "clip", 1.0),
                         betas=(getattr(args, "adam_beta1", 0.9), getattr(args, "adam_beta2", 0.95)),
                         eps=getattr(args, "adam_eps", 1e-8), decay=getattr(args, "lr_decay", "cosine"),
                         initial_loss_scale=getattr(args, "initial_loss_scale", 2.0**16),
                         loss_scale_window=getattr(args, "loss_scale_window", 2000))


def make_trainer(layout: Layout, args, config, task, world):
    """The trainer of a validated layout, with the demo's optimizer settings and --recompute."""
    blocks = None
    if getattr(args, "balance_stages", "blocks") == "time":  # every rank measures; the cut is their mean's (chapter 5)
        from minidist.parallel.stage_balance import balanced_blocks
        rows = max(1, args.batch_size // max(1, layout.dp * layout.microbatches))
        blocks = balanced_blocks(config, layout.pp, rows, world)
    trainer = build_trainer(layout, config, task, world, optim_settings(args), args.batch_size, args.seed,
                            stage_blocks=blocks)
    apply_recompute(trainer, layout)
    return trainer


def build_trainer(layout: Layout, config, task, world, settings: OptimSettings, batch_size: int, seed: int = 0,
                  stage_blocks: list[int] | None = None):
    """Build the trainer `layout.strategy` names (the layout is valid: `Layout.validate`);
    `stage_blocks`, a pipeline's blocks per stage (stage_balance.py; None: the even cut)."""
    kind = strategy(layout, isinstance(config, MoEConfig))
    common = dict(seed=seed, precision=layout.precision)
    if kind == "moe":
        return MoETrainer(config, settings, task, batch_size, microbatches=layout.microbatches, **common)
    if kind == "serial":
        return SerialTrainer(config, settings, task, batch_size, **common)
    if kind == f"dp{layout.dp}-ep{layout.ep}":
        return ExpertParallelTrainer(config, settings, task, batch_size, group=world, ep=layout.ep, **common)
    if isinstance(config, MoEConfig):
        trainer = ExpertMeshZero1Trainer if layout.zero else ExpertMeshTrainer
        return trainer(config, settings, task, batch_size, group=world, dp=layout.dp, tp=layout.tp,
                                 pp=layout.pp, ep=layout.ep, microbatches=layout.microbatches,
                                 schedule=layout.schedule or "1f1b", virtual_stages=layout.virtual_stages, **common)
    if layout.cp > 1 and kind == context_parallel_name(layout.cp, layout.dp, layout.cp_algorithm, layout.cp_split):
        return ContextParallelTrainer(config, settings, task, batch_size, group=world, cp=layout.cp, dp=layout.dp,
                                      algorithm=layout.cp_algorithm, split=layout.cp_split, **common)
    if kind in ("dp", "dp-naive"):
        trainer = BalancedDataParallelTrainer if layout.balance else DataParallelTrainer
        return trainer(config, settings, task, batch_size, group=world, overlap=not layout.naive_dp,
                       bucket_cap_bytes=layout.bucket_kb * 1024, accumulation=layout.microbatches,
                       fp32_grads=layout.fp32_grads, **common)
    if kind.startswith("zero"):
        return ZeroTrainer(config, settings, task, batch_size, group=world, stage=layout.zero,
                           accumulation=layout.microbatches, **common)
    if kind in ("tp", "tp-sp"):
        return TensorParallelTrainer(config, settings, task, batch_size, group=world,
                                     sequence_parallel=layout.sequence_parallel, **common)
    if kind == "mp" or kind.startswith("pp-"):
        return PipelineTrainer(config, settings, task, batch_size, group=world, microbatches=layout.microbatches,
                               schedule=layout.schedule, virtual_stages=layout.virtual_stages,
                               stage_blocks=stage_blocks, **common)
    return build_mesh_trainer(layout, config, task, world, settings, batch_size, seed, stage_blocks)


def build_mesh_trainer(layout: Layout, config, task, world, settings: OptimSettings, batch_size: int, seed: int,
                       stage_blocks: list[int] | None = None):
    """The composed trainer: ZeRO-2/3 over dp x tp shards, or the pipeline mesh (ZeRO-0/1)."""
    if layout.zero >= 2:
        return zero_tensor.STAGES[layout.zero](config, settings, task, batch_size, seed=seed, group=world,
                                               dp=layout.dp, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                               precision=layout.precision, accumulation=layout.microbatches)
    return MeshTrainerFor(layout.zero)(
        config, settings, task, batch_size, seed=seed, group=world, dp=layout.dp, tp=layout.tp, pp=layout.pp,
        microbatches=layout.microbatches, schedule=layout.schedule or "1f1b", virtual_stages=layout.virtual_stages,
        sequence_parallel=layout.sequence_parallel, bucket_cap_bytes=layout.bucket_kb * 1024,
        fp32_grads=layout.fp32_grads, precision=layout.precision, cp=layout.cp, cp_algorithm=layout.cp_algorithm,
        cp_split=layout.cp_split, stage_blocks=stage_blocks)


def apply_recompute(trainer, layout: Layout) -> None:
    """Switch the trainer's model (or stage) to the layout's recomputation (chapter 11)."""
    if layout.recompute == "none":
        return
    stage = getattr(trainer, "stage", None)
    if stage is None or isinstance(stage, int):  # the whole GPT (ZeRO's `stage` is its number)
        model = trainer.model if trainer.model is not None else trainer.module
        model.set_recompute(layout.recompute, layout.segments)
    else:
        stage.set_recompute(layout.recompute)


def tour_plan(args, config, world_size: int) -> tuple[list[tuple[Layout, list | None]], list[str]]:
    """[(layout, ranks)] for every strategy this world and model allow, and why others are
    skipped (each judged by `Layout.validate`). ranks=None means every rank takes part."""
    n, m = world_size, args.microbatches
    base = Layout(precision=args.precision, recompute=args.recompute, segments=args.segments,
                  bucket_kb=args.bucket_kb)  # what every row of the tour shares
    pipeline = dict(pp=n, microbatches=m)
    candidates = [({}, [0]), (dict(dp=n), None), (dict(dp=n, naive_dp=True), None),
                  *[(dict(dp=n, zero=s), None) for s in (1, 2, 3)],
                  (dict(tp=n), None), (dict(tp=n, sequence_parallel=True), None),
                  (dict(pp=n), None), (dict(pipeline, schedule="gpipe"), None), (dict(pipeline, schedule="1f1b"), None),
                  (dict(pipeline, schedule="interleaved", virtual_stages=args.virtual_stages), None),
                  (dict(cp=n), None)]
    candidates += [(degrees, None) for degrees in mesh_degrees(n, args)]
    plan, skipped = [], []
    for change, ranks in candidates:
        layout = replace(base, **change)
        why = layout.why_invalid(config, 1 if ranks else n, args.batch_size)
        if why is None:
            plan.append((layout, ranks))
        else:
            skipped.append(f"{layout}: {why}")
    return plan, skipped


def mesh_degrees(world_size: int, args) -> list[dict]:
    """Every factorisation dp x tp x pp of the world with two degrees above 1, with the flags'
    micro-batches and schedule (chapter 9's rows of the tour): dp x tp, dp x pp, tp x pp."""
    rows = []
    for dp in range(world_size, 0, -1):
        for tp in range(world_size // dp, 0, -1):
            pp = world_size // (dp * tp)
            if dp * tp * pp != world_size or sum(d > 1 for d in (dp, tp, pp)) < 2:
                continue
            pipeline = dict(microbatches=args.microbatches, schedule=args.schedule,
                            virtual_stages=args.virtual_stages if args.schedule == "interleaved" else 1)
            rows.append(dict(dp=dp, tp=tp, pp=pp, **(pipeline if pp > 1 else {})))
    return rows
