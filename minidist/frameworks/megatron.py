"""A Megatron-LM argument line as a minidist layout (chapter 9)."""
from __future__ import annotations

import argparse
import shlex

from minidist import cli
from minidist.frameworks.translation import (
    DEMO_VOCAB, LOW_PRECISION, NO_RECOMPUTE, Translation, data_parallel_size,
    batch_rule, finish_translation, set_layout_steps)


SWITCHES = {"--sequence-parallel", "--fp16", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--untie-embeddings-and-output-weights", "--use-torch-fsdp2", "--use-megatron-fsdp",
            "--recompute-activations", "--checkpoint-activations", "--deepspeed", "--no-pipeline-parallel",
            "--deepspeed-activation-checkpointing"}
DESTS = {  # a Megatron-LM flag -> the demo's argument its value reaches (None: the layout or the batch split)
    "--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp", "--micro-batch-size": None,
    "--global-batch-size": "batch_size", "--num-layers": "n_layer", "--hidden-size": "n_embd",
    "--num-attention-heads": "n_head", "--seq-length": "block_size", "--max-position-embeddings": "block_size",
    "--use-distributed-optimizer": "zero", "--zero-stage": "zero", "--use-torch-fsdp2": "zero",
    "--use-megatron-fsdp": "zero", "--data-parallel-sharding-strategy": "zero", "--sequence-parallel": "sequence_parallel",
    "--recompute-granularity": "recompute", "--recompute-activations": "recompute", "--checkpoint-activations": "recompute",
    "--recompute-method": "recompute", "--activations-checkpoint-method": "recompute",
    "--recompute-num-layers": "recompute", "--activations-checkpoint-num-layers": "recompute",
    "--fp16": "precision", "--bf16": "precision", "--seed": "seed", "--lr": "lr", "--min-lr": "min_lr",
    "--weight-decay": "weight_decay", "--clip-grad": "clip", "--train-iters": "steps", "--lr-warmup-iters": "warmup",
    "--lr-warmup-fraction": "warmup", "--lr-decay-style": "lr_decay", "--adam-beta1": "adam_beta1",
    "--adam-beta2": "adam_beta2", "--adam-eps": "adam_eps", "--initial-loss-scale": "initial_loss_scale",
    "--loss-scale-window": "loss_scale_window", "--untie-embeddings-and-output-weights": "untied",
    "--num-virtual-stages-per-pipeline-rank": "virtual_stages", "--virtual-pipeline-model-parallel-size": "virtual_stages",
    "--num-layers-per-virtual-pipeline-stage": "virtual_stages",
}
MEGATRON_IGNORED = [  # (flag prefixes, why minidist does not follow them)
    (("--data", "--split", "--tokenizer", "--vocab-file", "--merge-file", "--mock-data", "--train-data",
      "--valid-data", "--test-data", "--num-workers", "--hf-tokenizer", "--make-vocab-size"),
     "ignored: minidist generates its data"),
    (("--save", "--load", "--ckpt", "--no-save", "--no-load", "--finetune", "--exit-", "--use-checkpoint"),
     "ignored: the demo saves with --checkpoint DIR and --save PATH"),
    (("--log", "--eval", "--tensorboard", "--wandb", "--timing", "--profile"),
     "ignored: logging and evaluation (the demo prints its progress; --json keeps the measurements)"),
    (("--recompute", "--distribute-saved-activations"), NO_RECOMPUTE),
    (("--swiglu", "--normalization", "--position-embedding", "--use-rotary", "--rotary", "--disable-bias-linear",
      "--group-query-attention", "--num-query-groups", "--kv-channels", "--squared-relu", "--init-method-std",
      "--apply-layernorm-1p", "--qk-layernorm", "--add-qkv-bias", "--no-position-embedding"),
     "minidist's GPT is GPT-2's: LayerNorm, a GELU MLP of 4 x n_embd, learned positions, biases"),
    (("--moe", "--expert", "--num-experts"),
     "minidist's mixture of experts (--experts E --ep N, chapter 11) is set by its own flags, not read from here"),
    (("--fp8", "--fp4", "--accumulate-allreduce", "--attention-softmax-in-fp32", "--fp16-lm-cross-entropy",
      "--fp32-residual"),
     LOW_PRECISION),
    (("--train-samples", "--rampup-batch-size", "--lr-warmup-samples", "--lr-decay-samples"),
     "a sample-based schedule: give --train-iters (minidist counts steps)"),
    (("--overlap-param-gather",), "minidist's ZeRO gathers the updated parameters after the step, not overlapped"),
    (("--distributed-backend", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-",
      "--use-flash-attn", "--transformer-impl", "--attention-backend", "--use-mcore", "--tp-comm", "--cuda-graph",
      "--no-async", "--use-legacy"),
     "ignored: a GPU kernel or backend choice (minidist runs NumPy on CPUs over MPI)"),
]
FSDP_STAGES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def words(text: str) -> list[str]:
    """A shell line's words, as bash would pass them: quotes, backslash-newlines, # comments."""
    return shlex.split(text.replace("\\\n", " "), comments=True)


def parse_megatron(argv) -> dict[str, str | None]:
    """Megatron-LM's command line as {flag: value} (None for a switch; the last one wins, as in
    argparse). A whole pasted launch line works: everything up to the training script is dropped."""
    tokens = words(argv) if isinstance(argv, str) else list(argv)
    scripts = [i for i, token in enumerate(tokens) if token.endswith(".py")]
    tokens = tokens[scripts[0] + 1:] if scripts else tokens
    flags, i = {}, 0
    while i < len(tokens):
        name, eq, value = tokens[i].partition("=")
        if not name.startswith("--"):
            raise ValueError(f"megatron args: expected a --flag, got {tokens[i]!r}"
                             + (f" after {tokens[i - 1]} (a switch takes no value)" if i and tokens[i - 1] in SWITCHES
                                else ""))
        i += 1
        if not eq and name not in SWITCHES:  # a flag's values run up to the next --flag
            values = []
            while i < len(tokens) and not tokens[i].startswith("--"):
                values.append(tokens[i])
                i += 1
            value = " ".join(values) if values else None
        flags[name] = value if eq or name not in SWITCHES else None
    return flags


def from_megatron(argv, world_size: int) -> Translation:
    """Translate a Megatron-LM argument line (a string, or a list of words) on `world_size` ranks."""
    flags, who = parse_megatron(argv), "megatron args"
    t = Translation("Megatron-LM", world_size)

    def take(flag, kind=int, lo=1, default=None):  # the flag's value, and it goes into the ledger as applied
        if flag not in flags:
            return default
        text = flags.pop(flag)
        t.use(flag, True if text is None else text, DESTS.get(flag))
        if kind is bool:
            return True
        if text is None:
            raise ValueError(f"{who}: {flag} needs a value")
        try:
            return cli.integer(lo)(text) if kind is int else kind(text) if kind is str else cli.number(lo)(text or "")
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"{who}: {flag}: {error}") from None

    t.tp, t.pp = take("--tensor-model-parallel-size", default=1), take("--pipeline-model-parallel-size", default=1)
    t.cp = take("--context-parallel-size", default=1)
    t.dp = data_parallel_size(world_size, t.tp * t.cp, t.pp, who)  # Megatron's rule: dp = world / (tp cp pp)
    if t.cp > 1:
        t.notes.append(f"--context-parallel-size {t.cp} -> --cp {t.cp} (each sequence split over {t.cp} ranks, "
                       "chapter 11; the mesh's dp x cp group averages the gradients)")
    micro = take("--micro-batch-size")
    if micro is None:
        raise ValueError(f"{who}: --micro-batch-size is required (Megatron-LM asserts it)")
    try:
        t.batch_size, t.micro_batch_size, steps = batch_rule(t.dp, take("--global-batch-size"), micro, names=(
            "--global-batch-size", "--micro-batch-size", "micro-batches"))
    except ValueError as error:
        raise ValueError(f"{who}: {error}") from None
    t.notes.append(f"--global-batch-size {t.batch_size} = --micro-batch-size {micro} x {steps} micro-batches x "
                   f"dp {t.dp} -> --batch-size {t.batch_size}")
    set_layout_steps(t, steps, "micro-batches per step")
    _megatron_model(t, take)
    _megatron_virtual(t, take, who)
    t.zero = 1 if take("--use-distributed-optimizer", bool) else 0
    if t.zero:
        t.notes.append("--use-distributed-optimizer (optimizer states sharded over dp) -> --zero 1")
    strategy = take("--data-parallel-sharding-strategy", str) or "no_shard"  # Megatron-FSDP's stages
    fsdp = "--use-torch-fsdp2" if take("--use-torch-fsdp2", bool) else (
        f"--use-megatron-fsdp (sharding {strategy})" if take("--use-megatron-fsdp", bool) else None)
    if fsdp:
        stage = 3 if fsdp == "--use-torch-fsdp2" else FSDP_STAGES.get(strategy)
        if stage is None:
            raise ValueError(f"{who}: --data-parallel-sharding-strategy {strategy}: expected one of "
                             f"{', '.join(FSDP_STAGES)}")
        t.zero = max(t.zero, stage)
        t.notes.append(f"{fsdp} is ZeRO-{stage} (chapter 8) -> --zero {t.zero}")
    sp = bool(take("--sequence-parallel", bool))
    t.sequence_parallel = sp and t.tp > 1
    if sp:
        t.notes.append("--sequence-parallel -> --sequence-parallel" if t.tp > 1 else
                       "--sequence-parallel with tp=1: Megatron-LM turns it off, and so does minidist")
    if take("--overlap-grad-reduce", bool):
        t.notes.append("--overlap-grad-reduce: minidist's data parallelism always overlaps its bucketed all-reduces")
    _megatron_optimizer(t, take)
    granularity = take("--recompute-granularity", str)
    if take("--recompute-activations", bool):  # Megatron's older switch for selective recomputation
        granularity = granularity or "selective"
    if take("--checkpoint-activations", bool):  # the oldest spelling: full recomputation of every layer
        granularity = granularity or "full"
    method = take("--recompute-method", str) or take("--activations-checkpoint-method", str)
    layers = take("--recompute-num-layers") or take("--activations-checkpoint-num-layers")
    if method is not None:
        granularity = granularity or "full"
        if method != "uniform" or (layers or 1) != 1:
            for flag in ("--recompute-method", "--activations-checkpoint-method", "--recompute-num-layers",
                         "--activations-checkpoint-num-layers"):
                if flag in t.applied:
                    t.refuse(flag, f"{method} x {layers or 1} layers: minidist recomputes each block alone (uniform, "
                                   "1 layer); --segments groups the whole model's blocks (serial and dp only)")
    if granularity is not None:
        if granularity not in ("full", "selective"):
            raise ValueError(f"{who}: --recompute-granularity must be full or selective, got {granularity!r}")
        t.recompute = granularity
        t.notes.append(f"--recompute-granularity {granularity} -> --recompute {granularity} (chapter 11)")
    fp16, bf16 = take("--fp16", bool), take("--bf16", bool)
    if fp16 and bf16:
        raise ValueError(f"{who}: --fp16 and --bf16 both given; Megatron-LM accepts one of them")
    if fp16 or bf16:
        t.precision = "fp16" if fp16 else "bf16"
        t.notes.append(f"--{t.precision} -> --precision {t.precision} (16-bit compute, fp32 master weights)")
    t.seed = take("--seed", lo=0)
    if t.seed is not None:
        t.notes.append(f"--seed {t.seed} -> --seed {t.seed} (minidist's weights and batches, not Megatron's)")
    _megatron_loss_scale(t, take, who)
    _megatron_deepspeed(t, take, world_size, who)
    for flag, value in flags.items():
        reason = next((why for prefixes, why in MEGATRON_IGNORED if flag.startswith(prefixes)),
                      "ignored: no minidist counterpart")
        t.refuse(flag, ("" if value is None else f"{value}: ") + reason)
    return finish_translation(t, who)


def _megatron_loss_scale(t: Translation, take, who: str) -> None:
    """fp16's loss scale: a static --loss-scale is refused; the dynamic one's start and window apply."""
    static = take("--loss-scale", float, lo=0)
    if static:
        t.refuse("--loss-scale", f"{static:g} (a static scale): minidist's loss scale is dynamic (chapter 10)")
    t.initial_loss_scale = take("--initial-loss-scale", float, lo=0)
    t.loss_scale_window = take("--loss-scale-window")
    for name in ("initial_loss_scale", "loss_scale_window"):
        if getattr(t, name) is not None:
            t.notes.append(f"--{name.replace('_', '-')} {getattr(t, name):g} -> --{name.replace('_', '-')}")
    hysteresis = take("--hysteresis")
    if hysteresis not in (None, 1):
        t.refuse("--hysteresis", f"{hysteresis}: minidist's scaler halves at the first overflow (torch GradScaler's rule)")
    floor = take("--min-loss-scale", float, lo=0)
    if floor is not None:
        t.refuse("--min-loss-scale", f"{floor:g}: minidist's dynamic scaler has no floor (torch GradScaler's rule)")


def _megatron_deepspeed(t: Translation, take, world_size: int, who: str) -> None:
    """Megatron-DeepSpeed: --zero-stage N, and the DeepSpeed config its launch scripts write inline."""
    if take("--deepspeed", bool):
        t.notes.append("--deepspeed: Megatron-DeepSpeed (its ZeRO and precision from --zero-stage and the config)")
    stage = take("--zero-stage", lo=0)
    if stage is not None:
        if stage > 3:
            raise ValueError(f"{who}: --zero-stage must be 0..3, got {stage}")
        t.zero = max(t.zero, stage)
        t.notes.append(f"--zero-stage {stage} (Megatron-DeepSpeed) -> --zero {stage}")
    path = take("--deepspeed_config", str) or take("--deepspeed-config", str)
    if path is None:
        return
    from minidist.frameworks.deepspeed import from_deepspeed
    model = {k: getattr(t, k) for k in ("n_layer", "n_embd", "n_head", "block_size") if getattr(t, k) is not None}
    ds = from_deepspeed(path, world_size, pp=t.pp, tp=t.tp, settings=model)
    t.zero = max(t.zero, ds.zero)
    if ds.precision != "fp32":
        t.precision = ds.precision
    # under --deepspeed the DeepSpeed engine clips and scales the loss, from its JSON (Megatron-DeepSpeed's
    # get_megatron_optimizer hands it the bare AdamW): the JSON's values win over the flags'
    if "--clip-grad" in t.applied and ds.clip != t.clip:
        t.refuse("--clip-grad", f"{t.clip:g}: under --deepspeed the DeepSpeed config's gradient_clipping ({ds.clip:g}) "
                                "clips")
    t.clip = ds.clip
    for name in ("initial_loss_scale", "loss_scale_window"):
        if getattr(ds, name) is not None:
            setattr(t, name, getattr(ds, name))
    for key, why in ds.refused.items():
        t.refuse(f"--deepspeed_config {key}", why)
    t.notes.append(f"--deepspeed_config {path}: ZeRO-{ds.zero}, {ds.precision} (its batch and optimizer keys: the "
                   "flags' values win, as Megatron-DeepSpeed checks they agree)")


def _megatron_model(t: Translation, take) -> None:
    for flag, name in (("--num-layers", "n_layer"), ("--hidden-size", "n_embd"), ("--num-attention-heads", "n_head"),
                       ("--seq-length", "block_size")):
        value = take(flag)
        if value is not None:
            setattr(t, name, value)
            t.notes.append(f"{flag} {value} -> --{name.replace('_', '-')} {value}")
    positions = take("--max-position-embeddings")
    if positions is not None:
        t.block_size = t.block_size or positions
        if positions != t.block_size:
            t.refuse("--max-position-embeddings", f"{positions}: minidist's position table has block_size "
                                 f"= {t.block_size} rows")
    padded, vocab = take("--padded-vocab-size"), take("--vocab-size")
    vocab = padded or vocab
    if vocab is not None:
        t.vocab_size = vocab
        t.refuse("--padded-vocab-size" if padded else "--vocab-size", f"{vocab}: reported, not applied: the demo's byte-level data has "
                             f"{DEMO_VOCAB} symbols")
    ffn = take("--ffn-hidden-size")
    if ffn is not None and t.n_embd is not None and ffn != 4 * t.n_embd:
        t.refuse("--ffn-hidden-size", f"{ffn}: minidist's MLP is 4 x n_embd = {4 * t.n_embd}")
    t.tie_weights = not take("--untie-embeddings-and-output-weights", bool)
    if not t.tie_weights:
        t.notes.append("--untie-embeddings-and-output-weights -> --untied (a separate LM head)")
    for flag in ("--hidden-dropout", "--attention-dropout"):
        value = take(flag, float, lo=0)
        if value:  # Megatron's default is 0.1, minidist's 0
            t.refuse(flag, f"{value:g}: the demo has one --dropout for all (0 keeps parallel = serial)")


def _megatron_virtual(t: Translation, take, who: str) -> None:
    """Interleaved 1F1B: v model chunks per pipeline rank, given as v or as layers per chunk."""
    v, old_name = take("--num-virtual-stages-per-pipeline-rank"), take("--virtual-pipeline-model-parallel-size")
    v = v or old_name
    layers = take("--num-layers-per-virtual-pipeline-stage")
    if layers is not None:
        if t.n_layer is None or t.n_layer % (t.pp * layers):
            raise ValueError(f"{who}: --num-layers-per-virtual-pipeline-stage {layers} needs --num-layers divisible "
                             f"by pp={t.pp} x {layers} = {t.pp * layers}, got {t.n_layer}")
        v = t.n_layer // (t.pp * layers)
    if v and v > 1:
        t.schedule, t.virtual_stages = "interleaved", v
        t.notes.append(f"{v} virtual stages per pipeline rank -> --schedule interleaved --virtual-stages {v}")
    elif t.pp > 1:
        t.notes.append("pp > 1 without virtual stages: Megatron-LM's 1F1B -> --schedule 1f1b")


def why_megatron_refuses(layout, n_layer: int) -> str | None:
    """Why Megatron-LM would not run `layout` (a minidist Layout) for a model of `n_layer` layers
    where minidist would, in one line; None where it would run it. minidist's pipeline may cut the
    layers unevenly (chapter 5 balances stages by cost); Megatron-LM cuts them evenly, and its
    interleaved schedule has rules of its own. As its code asserts them (the 2021 code that
    Narayanan et al. ran, and Megatron Core since):

    - the layers divide evenly over the stages ("num_layers must be divisible by
      pipeline_model_parallel_size", megatron/model/transformer.py);
    - interleaving needs more than two stages ("pipeline-model-parallel size should be greater
      than 2 with interleaved schedule", megatron/arguments.py), each stage's layers in equal
      chunks (--num-layers-per-virtual-pipeline-stage), and a number of micro-batches that the
      stages divide ("number of microbatches is not divisible by pipeline-parallel size when
      using interleaved schedule", megatron/training.py)."""
    p, v, m = layout.pp, layout.virtual_stages, layout.microbatches
    if n_layer % p:
        return f"{n_layer} layers do not divide evenly over pp={p} stages"
    if layout.schedule == "interleaved":
        if p <= 2:
            return f"the interleaved schedule needs more than 2 stages, got pp={p}"
        if (n_layer // p) % v:
            return f"{n_layer // p} layers per stage do not cut into {v} equal chunks"
        if m % p:
            return f"{m} micro-batches are not a multiple of pp={p} (the interleaved schedule's rule)"
    return None


MEGATRON_DEFAULTS = {"weight_decay": 0.01, "min_lr": 0.0, "clip": 1.0, "betas": (0.9, 0.999), "eps": 1e-8,
                     "warmup": 0}  # megatron/training/arguments.py: what a line that leaves them out trains with


def _megatron_optimizer(t: Translation, take) -> None:
    kind = take("--optimizer", str)
    if kind not in (None, "adam"):
        t.refuse("--optimizer", f"{kind}: minidist has AdamW only; it trains with AdamW")
    for flag, name in (("--lr", "lr"), ("--min-lr", "min_lr"), ("--weight-decay", "weight_decay"),
                       ("--clip-grad", "clip")):
        value = take(flag, float, lo=0)
        if value is not None:
            setattr(t, name, value)
            t.notes.append(f"{flag} {value:g} -> {name}")
    t.steps, t.warmup = take("--train-iters"), take("--lr-warmup-iters", lo=0)
    fraction, decay_iters = take("--lr-warmup-fraction", float, lo=0), take("--lr-decay-iters")
    if fraction is not None and (decay_iters or t.steps):
        t.warmup = round(fraction * (decay_iters or t.steps))
    elif fraction is not None:
        t.refuse("--lr-warmup-fraction", f"{fraction:g}: a fraction of --train-iters, which is not given")
    if t.steps is not None:
        t.notes.append(f"--train-iters {t.steps} -> --steps {t.steps}")
    if t.warmup is not None:
        t.notes.append(f"warm-up {t.warmup} iterations -> warmup")
    if decay_iters is not None and decay_iters != t.steps:
        t.refuse("--lr-decay-iters", f"{decay_iters}: minidist decays over all {t.steps} steps")
    style = take("--lr-decay-style", str)
    if style is None and t.lr is not None:
        style = "linear"  # Megatron-LM's default
        t.notes.append("no --lr-decay-style: Megatron-LM's default, linear -> --lr-decay linear")
    if style in ("linear", "cosine", "constant"):
        t.decay = style
        t.notes.append(f"--lr-decay-style {style} -> --lr-decay {style}")
    elif style is not None:
        t.refuse("--lr-decay-style", f"{style}: minidist decays by cosine, linearly, or not at all")
    betas = [take("--adam-beta1", float, lo=0), take("--adam-beta2", float, lo=0)]
    if any(b is not None for b in betas):
        t.betas = (betas[0] if betas[0] is not None else 0.9, betas[1] if betas[1] is not None else 0.999)
        t.notes.append(f"--adam-beta1/2 -> betas {t.betas} (Megatron-LM's defaults 0.9, 0.999 where not given)")
    t.eps = take("--adam-eps", float, lo=0)
    for name, value in MEGATRON_DEFAULTS.items():  # the framework's defaults, not minidist's
        if getattr(t, name) is None:
            setattr(t, name, value)
            t.notes.append(f"no --{name.replace('_', '-')}: Megatron-LM's default {value}")
