"""torchtitan's [model] and [parallelism], its batch and its pipeline, as a minidist layout (chapter 9)."""
from __future__ import annotations

import math

from minidist.frameworks.translation import Translation, batch_rule, checked_number, set_layout_steps
from minidist.frameworks.torchtitan.keys import (DEFAULTS, FLOAT8, GPT2, LLAMA3, SCHEDULE_REASONS, SCHEDULES, Keys,
                                                 only_when_off, switch_value, text_value)


# ----------------------------------------------------------------------------- [model]


def read_model(t: Translation, keys: Keys, who: str) -> bool:
    """The model's keys; returns whether float8 training is on (model.converters)."""
    key, name = keys.take("model.name")
    name = "llama3" if name is None else text_value(who, key, name)
    if key:
        t.refuse(key, f"{name}: {GPT2}" + (", not Llama's RMSNorm, SwiGLU, rotary positions and grouped-query "
                                           "attention" if name.startswith("llama") else ""))
    key, flavor = keys.take("model.flavor")
    if key:
        flavor = text_value(who, key, flavor)
        dims = LLAMA3.get(flavor) if name == "llama3" else None
        t.refuse(key, f"{flavor}: the flavor's dimensions are in torchtitan's code, not in this file"
                 + (f" ({name} {flavor}: {dims[0]} layers, dim {dims[1]}, {dims[2]} heads)" if dims else "")
                 + "; the demo's --n-layer, --n-embd and --n-head set minidist's model")
    for key_name, field, flag in (("n_layers", "n_layer", "n_layer"), ("dim", "n_embd", "n_embd"),
                                  ("n_heads", "n_head", "n_head")):  # a model spelled out in the file
        key, value = keys.take(f"model.{key_name}")
        if key:
            setattr(t, field, checked_number(f"{who}: {key}", value, lo=1, integer=True))
            t.use(key, getattr(t, field), flag, f"{key} {getattr(t, field)} -> --{flag.replace('_', '-')} "
                                                f"{getattr(t, field)}")
    for key_name in ("tokenizer_path", "hf_assets_path"):
        key, value = keys.take(f"model.{key_name}")
        if key:
            t.refuse(key, "ignored: the demo's data is bytes (256 symbols): no tokenizer")
    key, converters = keys.take("model.converters")
    float8 = False
    if key:
        listed = [c.strip() for c in converters.split(",")] if isinstance(converters, str) else converters
        if not isinstance(listed, list):
            raise ValueError(f"{who}: {key}: expected a list of names, got {converters!r}")
        float8 = "float8" in listed
        if any(c in ("float8", "mx") for c in listed):
            t.refuse(key, f"{listed}: {FLOAT8}")
        elif listed and listed != [""]:
            t.refuse(key, f"{listed}: no minidist counterpart")
        else:
            t.use(key, converters, None)
    for key_name in ("norm_type", "vocab_size"):
        key, value = keys.take(f"model.{key_name}")
        if key:
            t.refuse(key, f"{value}: " + (GPT2 if key_name == "norm_type" else "the demo's byte-level data has "
                                                                                 "256 symbols"))
    key, value = keys.take("model.print_after_conversion")
    if key:
        t.refuse(key, "ignored: logging")
    for key in keys.section("model"):
        t.refuse(key, GPT2 + " (set by the demo's flags)")
    return float8



# ----------------------------------------------------------------------------- [parallelism]


def degree_of(keys: Keys, who: str, name: str) -> tuple:
    """(the key as written, its degree >= 1), or (None, 1) if absent."""
    key, value = keys.take(f"parallelism.{name}")
    if key is None:
        return None, 1
    return key, checked_number(f"{who}: {key}", value, lo=1, integer=True)


def read_layout(t: Translation, keys: Keys, who: str) -> dict:
    """The five degrees, the ZeRO stage FSDP means, sequence parallelism; returns {name: degree}."""
    r_key, r = degree_of(keys, who, "data_parallel_replicate_degree")
    s_key, s = keys.take("parallelism.data_parallel_shard_degree")
    if s_key is None:
        s = -1  # torchtitan's default: the ranks left over
    elif s != -1:
        s = checked_number(f"{who}: {s_key}", s, lo=1, integer=True)
    tp_key, t.tp = degree_of(keys, who, "tensor_parallel_degree")
    pp_key, t.pp = degree_of(keys, who, "pipeline_parallel_degree")
    cp_key, t.cp = degree_of(keys, who, "context_parallel_degree")
    named = [(k or f"parallelism.{n}", v) for k, n, v in ((r_key, "data_parallel_replicate_degree", r),
                                                          (tp_key, "tensor_parallel_degree", t.tp),
                                                          (pp_key, "pipeline_parallel_degree", t.pp),
                                                          (cp_key, "context_parallel_degree", t.cp))]
    others = r * t.tp * t.pp * t.cp
    product = " x ".join(f"{k.split('.')[-1]} {v}" for k, v in named if v > 1) or "1"
    if s == -1:
        if t.world_size % others:
            raise ValueError(f"{who}: world size {t.world_size} is not divisible by {product} = {others} "
                             "(data_parallel_shard_degree -1 takes the ranks left over)")
        s = t.world_size // others
        t.notes.append(f"data_parallel_shard_degree -1: the ranks left over, {t.world_size} / {others} = {s}")
    elif s * others != t.world_size:
        raise ValueError(f"{who}: data_parallel_shard_degree {s} x {product} = {s * others} ranks, but the world "
                         f"has {t.world_size} (torchtitan asserts they match; -1 takes the ranks left over)")
    t.dp = r * s
    if r_key:
        t.use(r_key, r, None, (f"{r_key} {r}: data-parallel replicas" + (" (HSDP: FSDP inside each)" if s > 1
                                                                          else " (DDP)")) if r > 1 else None)
    for key, value, flag in ((tp_key, t.tp, "tp"), (pp_key, t.pp, "pp"), (cp_key, t.cp, "cp")):
        if key and value > 1:
            t.use(key, value, flag, f"{key} {value} -> --{flag} {value}")
        elif key:
            t.use(key, value, None)  # 1: no such axis (the demo's default)
    read_sharding(t, keys, who, s_key, s, r)
    read_tensor(t, keys, who)
    key, ep = degree_of(keys, who, "expert_parallel_degree")
    if key:
        if ep > 1:
            t.refuse(key, f"{ep}: minidist's mixture of experts (--experts E --ep N, chapter 11) is set by its own "
                          "flags; the model here is dense")
        else:
            t.use(key, ep, None)
    key, etp = degree_of(keys, who, "expert_tensor_parallel_degree")
    if key and etp > 1:
        t.refuse(key, f"{etp}: minidist's experts are cut by --tp with the rest of the model (chapter 11)")
    elif key:
        t.use(key, etp, None)
    key, method = keys.take("parallelism.context_parallel_rotate_method")
    if key:
        if t.cp > 1:
            t.refuse(key, f"{method}: minidist's ring attention passes each K/V shard to the next rank (send/recv), "
                          "it does not all-gather or all-to-all them")
        else:
            t.use(key, method, None, f"{key}: no context parallelism, no effect")
    for key, value in keys.section("parallelism").items():
        if "pipeline" in key or key.endswith("module_fqns_per_model_part"):
            keys.flat[key] = value  # the pipeline's keys: read_pipeline reads them
        else:
            t.refuse(key, "ignored: no minidist counterpart")
    return {"replicate": r, "shard": s, "tp": t.tp, "pp": t.pp, "cp": t.cp}


def read_sharding(t: Translation, keys: Keys, who: str, s_key, s: int, r: int) -> None:
    """FSDP over `s` ranks is ZeRO-3 (ZeRO-2 when it keeps the gathered weights until backward)."""
    rf_key, reshard = keys.take("parallelism.fsdp_reshard_after_forward")
    if rf_key:
        reshard = text_value(who, rf_key, reshard, ("default", "always", "never")).lower()
    reshard = reshard or "default"
    if s == 1:
        t.zero = 0
        t.notes.append("no FSDP (data_parallel_shard_degree 1): " + (f"plain data parallelism over {r} replicas"
                                                                    if r > 1 else "one data-parallel rank")
                       + (" (torchtitan's FSDP still shards the weights over the cp ranks; minidist's cp ranks hold "
                          "whole copies)" if t.cp > 1 else ""))
        if s_key:
            t.use(s_key, 1, None)
        if rf_key:
            t.use(rf_key, reshard, None, f"{rf_key}: no FSDP, no effect")
        return
    # torchtitan's "default": reshard after forward unless a pipeline runs (no all-gather per micro-batch)
    keep = reshard == "never" or (reshard == "default" and t.pp > 1)
    t.zero = 2 if keep else 3
    why = ("the whole weights stay gathered from forward to backward (fsdp_reshard_after_forward never" +
           (", torchtitan's default with a pipeline" if reshard == "default" else "") +
           "): only the gradients and the optimizer states stay sharded, which is ZeRO-2" if keep else
           "weights, gradients and optimizer states all sharded, each block's weights gathered when used: ZeRO-3")
    fsdp = f"FSDP over {s} ranks" + (f" in each of {r} replicas (HSDP)" if r > 1 else "")
    if t.pp > 1 or t.cp > 1:  # minidist's ZeRO-2/3 do not combine with these (Layout's rule); ZeRO-1 does
        axis = f"--pp {t.pp}" if t.pp > 1 else f"--cp {t.cp}"
        t.zero = 1
        t.refuse(s_key or "parallelism.data_parallel_shard_degree",
                 f"{s} ({fsdp}: {why}): minidist's ZeRO-{2 if keep else 3} does not combine with {axis} (a "
                 "pipeline or a context split keeps whole gradients across its micro-batches), so these ranks are "
                 f"data-parallel replicas with ZeRO-1 (the optimizer states sharded over dp {t.dp}): the same "
                 "training, more memory per rank")
        if rf_key:
            t.refuse(rf_key, f"{reshard}: no ZeRO-2/3 with {axis} in minidist")
        return
    note = f"{fsdp}: {why} -> --zero {t.zero}" + (
        f" (minidist shards over all dp = {t.dp} ranks; HSDP's replicas each keep a whole copy)" if r > 1 else "")
    if s_key:
        t.use(s_key, s, None, note)
    else:
        t.notes.append(f"data_parallel_shard_degree not given: torchtitan's default -1, {note}")
    if rf_key:
        t.use(rf_key, reshard, "zero")


def read_tensor(t: Translation, keys: Keys, who: str) -> None:
    """torchtitan's tensor-parallel plan shards the norms over the sequence (SequenceParallel), and the loss
    over the vocabulary (loss parallel): minidist's --sequence-parallel and its vocab-parallel cross-entropy."""
    key, sp = keys.take("parallelism.enable_sequence_parallel")
    sp = True if key is None else switch_value(who, key, sp)
    t.sequence_parallel = t.tp > 1 and sp
    if key:
        t.use(key, sp, "sequence_parallel" if t.tp > 1 else None)
    if t.sequence_parallel:
        t.notes.append("tensor parallelism: torchtitan's plan runs the norms on T/tp tokens (SequenceParallel) -> "
                       "--sequence-parallel")
    key, value = keys.take("parallelism.disable_loss_parallel")
    if key:
        if switch_value(who, key, value) and t.tp > 1:
            t.refuse(key, "true: minidist's tensor parallelism always computes the cross-entropy on the "
                          "vocabulary-sharded logits (loss parallel)")
        else:
            t.use(key, value, None)
    only_when_off(t, keys, who, "parallelism.enable_async_tensor_parallel",
                  "true (torch.compile's micro-pipelining of tp's collectives into the matmuls): minidist's "
                  "tensor-parallel all-reduces are not overlapped")


# ----------------------------------------------------------------------------- the batch and the pipeline


def read_batch(t: Translation, keys: Keys, who: str, settings: dict) -> None:
    """global = local_batch_size x accumulation steps x dp; a pipeline's micro-batches from them."""
    local_key, local = keys.take("training.local_batch_size")
    local = DEFAULTS["training.local_batch_size"] if local_key is None else checked_number(
        f"{who}: {local_key}", local, lo=1, integer=True)
    global_key, batch = keys.take("training.global_batch_size")
    if global_key is not None and batch != -1:
        batch = checked_number(f"{who}: {global_key}", batch, lo=1, integer=True)
    given_batch = None if batch in (None, -1) else batch
    try:
        t.batch_size, local, steps = batch_rule(t.dp, given_batch, local, names=(
            global_key or "training.global_batch_size", local_key or "training.local_batch_size",
            "gradient-accumulation steps"))
    except ValueError as error:
        raise ValueError(f"{who}: {error}") from None
    if local_key is None:
        t.notes.append(f"training.local_batch_size not given: torchtitan's default {local}")
    else:
        t.use(local_key, local, None)
    if given_batch is not None:
        t.use(global_key, t.batch_size, "batch_size")
    elif global_key is not None:
        t.use(global_key, -1, None, f"{global_key} -1: local_batch_size x dp = {t.batch_size} (no accumulation)")
    t.notes.append(f"global batch {t.batch_size} = local_batch_size {local} x {steps} accumulation step(s) x dp {t.dp} "
                   f"-> --batch-size {t.batch_size}")
    mb_key, mb = keys.take("parallelism.pipeline_parallel_microbatch_size")
    mb = DEFAULTS["parallelism.pipeline_parallel_microbatch_size"] if mb_key is None else checked_number(
        f"{who}: {mb_key}", mb, lo=1, integer=True)
    if t.pp == 1:
        t.micro_batch_size = local
        set_layout_steps(t, steps, "gradient-accumulation steps")
        if mb_key:
            t.use(mb_key, mb, None, f"{mb_key}: no pipeline, no effect (as in torchtitan)")
        read_pipeline_unused(t, keys)
        return
    if local % mb:
        raise ValueError(f"{who}: {local_key or 'training.local_batch_size'} {local} is not divisible by "
                         f"{mb_key or 'parallelism.pipeline_parallel_microbatch_size'} {mb} (torchtitan cuts each "
                         "local batch into micro-batches of that size)")
    t.micro_batch_size = mb
    set_layout_steps(t, steps * (local // mb), "micro-batches per step")
    t.notes.append(f"the pipeline: local_batch_size {local} / pipeline_parallel_microbatch_size {mb} = {local // mb} "
                   f"micro-batches per accumulation step x {steps} step(s) = {t.microbatches} micro-batches of one "
                   "step (minidist runs them as one pipeline schedule: the same sum of gradients)")
    if mb_key:
        t.use(mb_key, mb, None)
    read_pipeline(t, keys, who, settings)


def read_pipeline_unused(t: Translation, keys: Keys) -> None:
    """pp = 1: the pipeline's other keys change nothing, in torchtitan as here."""
    older = [keys.take(path) for path in ("parallelism.pipeline_parallel_schedule",
                                          "parallelism.pipeline_parallel_split_points")]
    for key, value in [*(pair for pair in older if pair[0]), *keys.section("parallelism").items()]:
        t.use(key, value, None, f"{key}: no pipeline, no effect (as in torchtitan)")


def read_pipeline(t: Translation, keys: Keys, who: str, settings: dict) -> None:
    """The schedule, and the chunks each pipeline rank holds: torchtitan derives them from the model's
    layers (pipeline_parallel_layers_per_stage, split points) or takes 1 (GPipe, 1F1B) or 2 (looped)."""
    key, name = keys.take("parallelism.pipeline_parallel_schedule")
    name = DEFAULTS["parallelism.pipeline_parallel_schedule"] if key is None else text_value(who, key, name)
    if name.lower() not in SCHEDULES:
        raise ValueError(f"{who}: {key}: {name!r} is not one of torch.distributed.pipelining's schedules (GPipe, "
                         "1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)")
    t.schedule, looped = SCHEDULES[name.lower()]
    if key is None:
        t.notes.append(f"no pipeline_parallel_schedule: torchtitan's default {name} -> --schedule {t.schedule}")
    elif name.lower() in SCHEDULE_REASONS:
        t.refuse(key, f"{name} ({SCHEDULE_REASONS[name.lower()]}): minidist runs --schedule {t.schedule}, the same "
                      "chunks per rank")
    else:
        t.use(key, name, "schedule", f"{key} {name} -> --schedule {t.schedule}")
    n_layer = settings.get("n_layer") or t.n_layer or t.model_config().n_layer
    source = ("the demo's --n-layer" if settings.get("n_layer") else "model.n_layers" if t.n_layer
              else "the demo's default n_layer")
    first_key, first = keys.take("parallelism.pipeline_parallel_first_stage_less_layers")
    last_key, last = keys.take("parallelism.pipeline_parallel_last_stage_less_layers")
    first = 1 if first_key is None else checked_number(f"{who}: {first_key}", first, integer=True)
    last = 1 if last_key is None else checked_number(f"{who}: {last_key}", last, integer=True)
    lps_key, lps = keys.take("parallelism.pipeline_parallel_layers_per_stage")
    split_key, splits = keys.take("parallelism.pipeline_parallel_split_points")
    if lps_key is not None:
        lps = checked_number(f"{who}: {lps_key}", lps, lo=1, integer=True)
        chunks = math.ceil((n_layer + first + last) / lps)
        how = (f"{lps_key} {lps}: ceil(({n_layer} layers ({source}) + {first} + {last} for the embedding and the "
               f"head) / {lps}) = {chunks} chunks")
    elif split_key is not None and splits:
        if not isinstance(splits, (list, str)):
            raise ValueError(f"{who}: {split_key}: expected a list of module names, got {splits!r}")
        chunks = len(splits if isinstance(splits, list) else splits.split(",")) + 1
        how = f"{split_key}: {chunks - 1} split points = {chunks} chunks"
    else:
        chunks = t.pp * (2 if looped else 1)
        how = f"torchtitan's default for {name}: {chunks // t.pp} chunk(s) per pipeline rank"
    if chunks % t.pp:
        raise ValueError(f"{who}: {how}, not divisible by pipeline_parallel_degree {t.pp}")
    per_rank = chunks // t.pp
    if (looped and per_rank < 2) or (not looped and per_rank != 1):
        raise ValueError(f"{who}: {how} = {per_rank} per pipeline rank, but {name} runs "
                         + ("at least 2" if looped else "exactly 1") + " per rank"
                         + (" (give the demo's --n-layer for the model you run)" if lps_key else ""))
    t.virtual_stages = per_rank if looped else 1
    t.notes.append(f"{how} -> " + (f"--virtual-stages {per_rank}" if looped else "one chunk per pipeline rank"))
    for k, v in ((first_key, first), (last_key, last), (lps_key, lps)):
        if k:
            t.use(k, v, None)  # they decide the chunks per rank (--virtual-stages), no flag of their own
    if split_key:
        t.use(split_key, splits, None, f"{split_key}: their number decides the chunks; minidist cuts the blocks "
                                       "evenly, not at these names" if splits else None)
    key, csv = keys.take("parallelism.pipeline_parallel_schedule_csv")
    if key:
        if csv:
            t.refuse(key, f"{csv}: a schedule from a file; minidist's are gpipe, 1f1b and interleaved")
        else:
            t.use(key, csv, None)
    for key, value in keys.section("parallelism").items():
        t.refuse(key, "minidist cuts the blocks evenly over the pipeline's chunks (chapter 5)")
