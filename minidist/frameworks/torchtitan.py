"""A torchtitan TOML job config as a minidist layout and run (chapter 9).

torchtitan (github.com/pytorch/torchtitan) is PyTorch's own pretraining stack: FSDP2, tensor,
pipeline and context parallelism, all from torch.distributed, chosen by one TOML file of sections
([job], [model], [optimizer], [lr_scheduler], [training], [parallelism], [activation_checkpoint],
[checkpoint], [metrics], ...). Its layout is five degrees on one mesh, in the order pp,
dp_replicate, dp_shard, cp, tp (tp fastest), which is minidist's pp x dp x cp x tp:

    world = data_parallel_replicate_degree x data_parallel_shard_degree x context_parallel_degree
            x tensor_parallel_degree x pipeline_parallel_degree          (shard -1: the ranks left over)

    dp = replicate x shard;  shard > 1 is FSDP (fully_shard): ZeRO-3, or ZeRO-2 when
    fsdp_reshard_after_forward = "never" (the gathered weights stay for backward)

The batch: `local_batch_size` sequences per dp rank and micro-step, `global_batch_size` per step
(-1: local x dp), so global = local x gradient-accumulation steps x dp, DeepSpeed's rule under
other names. With a pipeline, each accumulation step's local batch is cut into micro-batches of
`pipeline_parallel_microbatch_size`; minidist runs all of a step's micro-batches as the
pipeline's (the same gradient: a sum over the same sequences).

Every key path ends in the translation's ledger, applied or refused with the reason; torchtitan's
own defaults (torchtitan/config/job_config.py) fill what the file leaves out, where they decide
the run (the optimizer, the schedule, clipping, the precision).
"""
from __future__ import annotations

import math
import re
import tomllib

from minidist.frameworks.translation import (
    LOW_PRECISION, NO_RECOMPUTE, Translation, batch_rule, checked_number, finish_translation, set_layout_steps)

# torchtitan's JobConfig defaults (torchtitan/config/job_config.py): what a file that leaves a key out trains with
DEFAULTS = {"optimizer.lr": 8e-4, "optimizer.beta1": 0.9, "optimizer.beta2": 0.95, "optimizer.eps": 1e-8,
            "optimizer.weight_decay": 0.1, "lr_scheduler.warmup_steps": 200, "lr_scheduler.decay_type": "linear",
            "lr_scheduler.lr_min": 0.0, "training.local_batch_size": 8, "training.max_norm": 1.0,
            "training.mixed_precision_param": "bfloat16", "parallelism.pipeline_parallel_schedule": "1F1B",
            "parallelism.pipeline_parallel_microbatch_size": 1, "activation_checkpoint.selective_ac_option": "2"}
# where older torchtitan versions kept a key (its current place <- the older one)
OLDER_PLACES = {
    "training.local_batch_size": ("training.batch_size",),
    "lr_scheduler.warmup_steps": ("training.warmup_steps",),
    "lr_scheduler.lr_min": ("lr_scheduler.min_lr_factor",),  # the name in torchtitan's Python configs
    "parallelism.data_parallel_replicate_degree": ("training.data_parallel_replicate_degree",),
    "parallelism.data_parallel_shard_degree": ("training.data_parallel_shard_degree", "training.data_parallel_degree"),
    "parallelism.tensor_parallel_degree": ("training.tensor_parallel_degree",),
    "parallelism.enable_async_tensor_parallel": ("experimental.enable_async_tensor_parallel",),
    "parallelism.pipeline_parallel_degree": ("experimental.pipeline_parallel_degree",),
    "parallelism.pipeline_parallel_schedule": ("experimental.pipeline_parallel_schedule",),
    "parallelism.pipeline_parallel_split_points": ("experimental.pipeline_parallel_split_points",),
    "parallelism.context_parallel_degree": ("experimental.context_parallel_degree",),
}
SECTIONS = ("job", "profiling", "metrics", "model", "optimizer", "lr_scheduler", "training", "parallelism",
            "checkpoint", "activation_checkpoint", "float8", "mx", "comm", "memory_estimation", "fault_tolerance",
            "experimental", "validation", "compile")
IGNORED = {  # whole sections minidist does not read, and why
    "job": "ignored: the job's name and output folder (the demo prints its progress; --json PATH keeps the "
           "measurements)",
    "metrics": "ignored: logging (the demo prints its progress; --json keeps the measurements)",
    "profiling": "ignored: the torch profiler and memory snapshots (--json has each rank's memory ledger and step "
                 "times)",
    "checkpoint": "ignored: the demo checkpoints with --checkpoint DIR --checkpoint-every K",
    "comm": "ignored: NCCL's timeouts and flight recorder (minidist's messages are MPI's, chapter 2)",
    "compile": "ignored: torch.compile (minidist runs NumPy, eagerly)",
    "validation": "ignored: evaluation on a held-out set (the demo reports the training loss and accuracy)",
    "memory_estimation": "ignored: FSDP's memory estimate (python -m minidist.plan.memory estimates a layout's)",
    "fault_tolerance": "TorchFT's fault-tolerant replica groups: no minidist counterpart",
    "experimental": "ignored: custom imports and JobConfig extensions",
    "mx": "MX (microscaling) formats: " + LOW_PRECISION,
}
TRAINING_IGNORED = {
    **dict.fromkeys(("dataset", "dataset_path", "dataset_type"), "ignored: minidist generates its data (--data)"),
    **dict.fromkeys(("compile", "enable_compiled_autograd"), "ignored: torch.compile (minidist runs NumPy, eagerly)"),
    **dict.fromkeys(("gc_freq", "gc_debug"), "ignored: Python's garbage-collector schedule"),
}
FLOAT8 = ('float8 training (torchao\'s Float8Linear, on with model.converters = ["float8"]): minidist\'s fp8 is '
          "on the MLP only (minidist.precision.fp8, chapter 10), not one of the demo's --precision values")
GPT2 = "minidist's GPT is GPT-2's: LayerNorm, a GELU MLP of 4 x n_embd, learned positions, biases"
LLAMA3 = {"debugmodel": (6, 256, 16), "8B": (32, 4096, 32), "70B": (80, 8192, 64), "405B": (126, 16384, 128)}
# torch.distributed.pipelining's schedules (lower case, as torch looks them up): minidist's, and one chunk or several
SCHEDULES = {"gpipe": ("gpipe", False), "1f1b": ("1f1b", False), "interleaved1f1b": ("interleaved", True),
             "loopedbfs": ("interleaved", True), "interleavedzerobubble": ("interleaved", True),
             "zbvzerobubble": ("interleaved", True), "dualpipev": ("interleaved", True),
             "pipelineschedulesingle": ("1f1b", False), "pipelineschedulemulti": ("interleaved", True)}
SCHEDULE_REASONS = {
    "loopedbfs": "each rank runs all micro-batches through one chunk before the next (breadth first)",
    "interleavedzerobubble": "zero-bubble schedules split each backward into input and weight gradients; "
                             "minidist's backward is one piece",
    "zbvzerobubble": "zero-bubble V: split backward, chunks placed in a V (rank 0 holds the first and the last)",
    "dualpipev": "DualPipe's V placement, forward and backward of two micro-batches overlapped",
    "pipelineschedulesingle": "a schedule read from pipeline_parallel_schedule_csv",
    "pipelineschedulemulti": "a schedule read from pipeline_parallel_schedule_csv",
}


class _Keys:
    """The config's key paths ("section.key"), taken one at a time; those left at the end are refused."""

    def __init__(self, data: dict, who: str):
        self.who = who
        self.flat: dict = {}
        for section, value in data.items():
            if section in SECTIONS and not isinstance(value, dict):
                raise ValueError(f"{who}: [{section}] must be a table of keys, got {section} = {value!r}")
            self._flatten(value, section)

    def _flatten(self, value, path: str) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                self._flatten(inner, f"{path}.{key}")
        else:
            self.flat[path] = value

    def take(self, path: str):
        """(the key as the file writes it, its value), or (None, None) if absent; an older place of
        the same key counts too (given in both: an error)."""
        given = [p for p in (path, *OLDER_PLACES.get(path, ())) if p in self.flat]
        if len(given) > 1:
            raise ValueError(f"{self.who}: {given[0]} and {given[1]} are the same setting (the second is an older "
                             "torchtitan's place): give one")
        return (given[0], self.flat.pop(given[0])) if given else (None, None)

    def section(self, name: str) -> dict:
        """What is left of a section: {key path: value}, taken out."""
        keys = [p for p in self.flat if p == name or p.startswith(name + ".")]
        return {p: self.flat.pop(p) for p in keys}


def _read_toml(config) -> dict:
    if isinstance(config, dict):
        return config
    try:
        with open(config, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise ValueError(f"{config}: cannot read it ({error.strerror})") from None
    try:
        if b"\x00" in raw:
            raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{config}: not a text file (a torchtitan config is UTF-8 TOML)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        message = str(error).splitlines()[0] if str(error) else "cannot parse it"
        where = re.search(r"\(at (line \d+, column \d+|end of document)\)$", message)
        what = message[:where.start()].strip() if where else message
        raise ValueError(f"{config}: not valid TOML ({where.group(1) if where else 'somewhere'}: {what})") from None


def _text(who: str, key: str, value, choices=None) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{who}: {key}: expected a string, got {value!r}")
    if choices is not None and value.lower() not in choices:
        raise ValueError(f"{who}: {key}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def _switch(who: str, key: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{who}: {key}: expected true or false, got {value!r}")
    return value


def from_torchtitan(config, world_size: int, settings: dict | None = None) -> Translation:
    """Translate a torchtitan TOML job config (a path, or the parsed dict) on `world_size` ranks.
    `settings`: the demo's flags given on its command line (n_layer decides, with
    pipeline_parallel_layers_per_stage, how many chunks each pipeline rank holds)."""
    who = f"torchtitan config {config}" if not isinstance(config, dict) else "torchtitan config"
    keys = _Keys(_read_toml(config), who)
    t = Translation("torchtitan", world_size)
    float8 = _tt_model(t, keys, who)
    degrees = _tt_layout(t, keys, who)
    _tt_batch(t, keys, who, settings or {})
    _tt_optimizer(t, keys, who)
    _tt_schedule(t, keys, who)
    _tt_precision(t, keys, who, degrees)
    _tt_training(t, keys, who)
    _tt_recompute(t, keys, who)
    for section, reason in IGNORED.items():
        if keys.section(section):
            t.refuse(section, reason)
    if keys.section("float8"):
        t.refuse("float8", FLOAT8 if float8 else 'ignored: float8 is off (model.converters has no "float8")')
    for key in list(keys.flat):
        t.refuse(key, "ignored: no minidist counterpart")
        keys.flat.pop(key)
    given = {name: (settings or {}).get(name) for name in ("n_layer", "n_embd", "n_head", "block_size")}
    for name, value in given.items():  # the model the run trains: the command line's, where it names one
        if value is not None:
            setattr(t, name, value)
            t.notes.append(f"{name} {value}: the command line's (torchtitan names its model by flavor)")
    _fit_recompute(t)
    try:
        return finish_translation(t, who)
    except ValueError as error:
        model = t.model_config()
        if t.n_layer is None or t.n_head is None or t.n_embd is None:  # the demo's default model was judged
            raise ValueError(f"{error} (judged on the model n_layer {model.n_layer}, n_embd {model.n_embd}, n_head "
                             f"{model.n_head}, block_size {model.block_size}: give the one to run with --n-layer, "
                             "--n-embd, --n-head, --block-size)") from None
        raise


# ----------------------------------------------------------------------------- [model]


def _tt_model(t: Translation, keys: _Keys, who: str) -> bool:
    """The model's keys; returns whether float8 training is on (model.converters)."""
    key, name = keys.take("model.name")
    name = "llama3" if name is None else _text(who, key, name)
    if key:
        t.refuse(key, f"{name}: {GPT2}" + (", not Llama's RMSNorm, SwiGLU, rotary positions and grouped-query "
                                           "attention" if name.startswith("llama") else ""))
    key, flavor = keys.take("model.flavor")
    if key:
        flavor = _text(who, key, flavor)
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


def _degree(keys: _Keys, who: str, name: str) -> tuple:
    """(the key as written, its degree >= 1), or (None, 1) if absent."""
    key, value = keys.take(f"parallelism.{name}")
    if key is None:
        return None, 1
    return key, checked_number(f"{who}: {key}", value, lo=1, integer=True)


def _tt_layout(t: Translation, keys: _Keys, who: str) -> dict:
    """The five degrees, the ZeRO stage FSDP means, sequence parallelism; returns {name: degree}."""
    r_key, r = _degree(keys, who, "data_parallel_replicate_degree")
    s_key, s = keys.take("parallelism.data_parallel_shard_degree")
    if s_key is None:
        s = -1  # torchtitan's default: the ranks left over
    elif s != -1:
        s = checked_number(f"{who}: {s_key}", s, lo=1, integer=True)
    tp_key, t.tp = _degree(keys, who, "tensor_parallel_degree")
    pp_key, t.pp = _degree(keys, who, "pipeline_parallel_degree")
    cp_key, t.cp = _degree(keys, who, "context_parallel_degree")
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
    _tt_sharding(t, keys, who, s_key, s, r)
    _tt_tensor(t, keys, who)
    key, ep = _degree(keys, who, "expert_parallel_degree")
    if key:
        if ep > 1:
            t.refuse(key, f"{ep}: minidist's mixture of experts (--experts E --ep N, chapter 11) is set by its own "
                          "flags; the model here is dense")
        else:
            t.use(key, ep, None)
    key, etp = _degree(keys, who, "expert_tensor_parallel_degree")
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
            keys.flat[key] = value  # the pipeline's keys: _tt_pipeline reads them
        else:
            t.refuse(key, "ignored: no minidist counterpart")
    return {"replicate": r, "shard": s, "tp": t.tp, "pp": t.pp, "cp": t.cp}


def _tt_sharding(t: Translation, keys: _Keys, who: str, s_key, s: int, r: int) -> None:
    """FSDP over `s` ranks is ZeRO-3 (ZeRO-2 when it keeps the gathered weights until backward)."""
    rf_key, reshard = keys.take("parallelism.fsdp_reshard_after_forward")
    if rf_key:
        reshard = _text(who, rf_key, reshard, ("default", "always", "never")).lower()
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


def _tt_tensor(t: Translation, keys: _Keys, who: str) -> None:
    """torchtitan's tensor-parallel plan shards the norms over the sequence (SequenceParallel), and the loss
    over the vocabulary (loss parallel): minidist's --sequence-parallel and its vocab-parallel cross-entropy."""
    key, sp = keys.take("parallelism.enable_sequence_parallel")
    sp = True if key is None else _switch(who, key, sp)
    t.sequence_parallel = t.tp > 1 and sp
    if key:
        t.use(key, sp, "sequence_parallel" if t.tp > 1 else None)
    if t.sequence_parallel:
        t.notes.append("tensor parallelism: torchtitan's plan runs the norms on T/tp tokens (SequenceParallel) -> "
                       "--sequence-parallel")
    key, value = keys.take("parallelism.disable_loss_parallel")
    if key:
        if _switch(who, key, value) and t.tp > 1:
            t.refuse(key, "true: minidist's tensor parallelism always computes the cross-entropy on the "
                          "vocabulary-sharded logits (loss parallel)")
        else:
            t.use(key, value, None)
    key, value = keys.take("parallelism.enable_async_tensor_parallel")
    if key:
        if _switch(who, key, value):
            t.refuse(key, "true (torch.compile's micro-pipelining of tp's collectives into the matmuls): minidist's "
                          "tensor-parallel all-reduces are not overlapped")
        else:
            t.use(key, False, None)


# ----------------------------------------------------------------------------- the batch and the pipeline


def _tt_batch(t: Translation, keys: _Keys, who: str, settings: dict) -> None:
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
        _tt_pipeline_unused(t, keys)
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
    _tt_pipeline(t, keys, who, settings)


def _tt_pipeline_unused(t: Translation, keys: _Keys) -> None:
    """pp = 1: the pipeline's other keys change nothing, in torchtitan as here."""
    older = [keys.take(path) for path in ("parallelism.pipeline_parallel_schedule",
                                          "parallelism.pipeline_parallel_split_points")]
    for key, value in [*(pair for pair in older if pair[0]), *keys.section("parallelism").items()]:
        t.use(key, value, None, f"{key}: no pipeline, no effect (as in torchtitan)")


def _tt_pipeline(t: Translation, keys: _Keys, who: str, settings: dict) -> None:
    """The schedule, and the chunks each pipeline rank holds: torchtitan derives them from the model's
    layers (pipeline_parallel_layers_per_stage, split points) or takes 1 (GPipe, 1F1B) or 2 (looped)."""
    key, name = keys.take("parallelism.pipeline_parallel_schedule")
    name = DEFAULTS["parallelism.pipeline_parallel_schedule"] if key is None else _text(who, key, name)
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


# ----------------------------------------------------------------------------- [optimizer], [lr_scheduler]


def _tt_optimizer(t: Translation, keys: _Keys, who: str) -> None:
    name_key, name = keys.take("optimizer.name")
    name = "AdamW" if name_key is None else _text(who, name_key, name)
    values = {}
    for field, flag, check in (("lr", "lr", dict(lo_open=True)), ("beta1", "adam_beta1", {}),
                               ("beta2", "adam_beta2", {}), ("eps", "adam_eps", dict(lo_open=True)),
                               ("weight_decay", "weight_decay", {})):
        key, value = keys.take(f"optimizer.{field}")
        if key is None:
            values[field] = DEFAULTS[f"optimizer.{field}"]
            t.notes.append(f"optimizer.{field} not given: torchtitan's default {values[field]:g}")
            continue
        values[field] = checked_number(f"{who}: {key}", value, **check)
        if field.startswith("beta") and values[field] >= 1:
            raise ValueError(f"{who}: {key}: expected a number < 1, got {value!r}")
        t.use(key, values[field], flag, f"{key} {values[field]:g} -> --{flag.replace('_', '-')} {values[field]:g}")
    t.lr, t.eps, t.weight_decay = values["lr"], values["eps"], values["weight_decay"]
    t.betas = (values["beta1"], values["beta2"])
    if name.lower() == "adamw" or (name.lower() == "adam" and t.weight_decay == 0):
        if name_key:
            t.use(name_key, name, None, f"{name_key} {name}: AdamW (torchtitan decays every parameter; minidist the "
                                        "matrices only, GPT-2's rule)")
    elif name.lower() == "adam":
        t.refuse(name_key, f"Adam with weight_decay {t.weight_decay:g} adds the decay to the gradient (L2): minidist's "
                           "AdamW decays the weights directly")
    else:
        t.refuse(name_key, f"{name}: minidist has AdamW only (optim.py); it trains with AdamW")
    for field in ("implementation", "fused", "foreach"):  # which kernel runs, not what it computes
        key, value = keys.take(f"optimizer.{field}")
        if key:
            t.use(key, value, None)
    key, value = keys.take("optimizer.early_step_in_backward")
    if key:
        if _switch(who, key, value):
            t.refuse(key, "true: minidist steps once the whole backward is done (and clips the global norm first)")
        else:
            t.use(key, False, None)
    for key in keys.section("optimizer"):
        t.refuse(key, "no minidist counterpart (minidist's AdamW: lr, betas, eps, weight_decay)")


def _tt_schedule(t: Translation, keys: _Keys, who: str) -> None:
    """Linear warm-up, then linear / cosine decay down to lr x lr_min (torchtitan/components/lr_scheduler.py)."""
    key, warmup = keys.take("lr_scheduler.warmup_steps")
    t.warmup = DEFAULTS["lr_scheduler.warmup_steps"] if key is None else checked_number(f"{who}: {key}", warmup,
                                                                                          integer=True)
    if key:
        t.use(key, t.warmup, "warmup", f"{key} {t.warmup} -> --warmup {t.warmup} (torchtitan warms up as "
                                       f"(step+1)/(warmup+1), minidist as (step+1)/warmup)")
    else:
        t.notes.append(f"lr_scheduler.warmup_steps not given: torchtitan's default {t.warmup} -> --warmup {t.warmup}")
    key, decay = keys.take("lr_scheduler.decay_type")
    decay = DEFAULTS["lr_scheduler.decay_type"] if key is None else _text(who, key, decay,
                                                                          ("linear", "sqrt", "cosine")).lower()
    if decay == "sqrt":
        t.refuse(key, "sqrt (1 - sqrt(progress)): minidist decays by cosine, linearly or not at all; the run decays "
                      "by the demo's --lr-decay (default cosine)")
    else:
        t.decay = decay
        if key:
            t.use(key, decay, "lr_decay", f"{key} {decay} -> --lr-decay {decay}")
        else:
            t.notes.append(f"lr_scheduler.decay_type not given: torchtitan's default {decay} -> --lr-decay {decay}")
    key, ratio = keys.take("lr_scheduler.lr_min")
    ratio = DEFAULTS["lr_scheduler.lr_min"] if key is None else checked_number(f"{who}: {key}", ratio)
    t.min_lr = float(f"{t.lr * ratio:.12g}")  # 3e-05, not 2.9999999999999997e-05
    if key:
        t.use(key, ratio, "min_lr", f"{key} {ratio:g} (a fraction of the lr) -> --min-lr {t.min_lr:g}")
    else:
        t.notes.append("lr_scheduler.lr_min not given: torchtitan's default 0, the lr decays to 0 -> --min-lr 0")
    key, ratio = keys.take("lr_scheduler.decay_ratio")
    if key:
        _tt_decay_ratio(t, keys, who, key, ratio)
    for key in keys.section("lr_scheduler"):
        t.refuse(key, "no minidist counterpart (minidist's schedule: --warmup, --lr-decay, --min-lr)")


def _tt_decay_ratio(t: Translation, keys: _Keys, who: str, key: str, ratio) -> None:
    """Warmup-stable-decay: the lr stays at its peak until the last `decay_ratio` of the steps."""
    if ratio is None:
        t.use(key, None, None)
        return
    ratio = checked_number(f"{who}: {key}", ratio)
    steps_key, steps = keys.take("training.steps")
    if steps_key:
        keys.flat[steps_key] = steps  # _tt_training reads it
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    if steps is not None and t.warmup + round(steps * ratio) == steps:
        t.use(key, ratio, None, f"{key} {ratio:g}: the decay starts right after the warm-up, as minidist's")
    else:
        t.refuse(key, f"{ratio:g} (warmup-stable-decay: the peak lr held until the last {ratio:g} of the steps): "
                      "minidist decays right after the warm-up")


# ----------------------------------------------------------------------------- [training], precision, recompute


def _tt_training(t: Translation, keys: _Keys, who: str) -> None:
    key, seq = keys.take("training.seq_len")
    if key:
        t.block_size = checked_number(f"{who}: {key}", seq, lo=1, integer=True)
        t.use(key, t.block_size, "block_size", f"{key} {t.block_size} -> --block-size {t.block_size}")
    key, clip = keys.take("training.max_norm")
    t.clip = DEFAULTS["training.max_norm"] if key is None else checked_number(f"{who}: {key}", clip)
    if key:
        t.use(key, t.clip, "clip", f"{key} {t.clip:g} -> --clip {t.clip:g} (max global gradient norm)")
    else:
        t.notes.append(f"training.max_norm not given: torchtitan's default {t.clip:g} -> --clip {t.clip:g}")
    key, steps = keys.take("training.steps")
    if key:
        t.steps = checked_number(f"{who}: {key}", steps, lo=1, integer=True)
        t.use(key, t.steps, "steps", f"{key} {t.steps} -> --steps {t.steps}")
    else:
        t.notes.append("training.steps not given (torchtitan's default 10000): the demo's --steps decides")
    key, seed = keys.take("training.seed")
    if key and seed is not None:
        t.seed = checked_number(f"{who}: {key}", seed, integer=True)
        t.use(key, t.seed, "seed", f"{key} {t.seed} -> --seed {t.seed} (minidist's weights and batches, not "
                                   "torchtitan's)")
    elif key:
        t.use(key, None, None)
    key, value = keys.take("training.deterministic")
    if key:
        t.use(key, _switch(who, key, value), None, f"{key}: minidist's runs are deterministic already")
    key, value = keys.take("training.enable_cpu_offload")
    if key:
        if _switch(who, key, value):
            t.refuse(key, "true: minidist keeps every state in host memory already: there is no device memory to "
                          "offload from")
        else:
            t.use(key, False, None)
    for key in keys.section("training"):
        t.refuse(key, TRAINING_IGNORED.get(key.split(".", 1)[1], "ignored: no minidist counterpart"))


def _tt_precision(t: Translation, keys: _Keys, who: str, degrees: dict) -> None:
    """mixed_precision_param takes effect through FSDP (shard > 1 or cp > 1), or through autocast
    when nothing but DDP runs (job_config.py); with tp or pp alone torchtitan trains in float32."""
    key, param = keys.take("training.mixed_precision_param")
    param = DEFAULTS["training.mixed_precision_param"] if key is None else _text(who, key, param,
                                                                                 ("bfloat16", "float32"))
    fsdp = degrees["shard"] > 1 or degrees["cp"] > 1
    autocast = not fsdp and degrees["tp"] == 1 and degrees["pp"] == 1
    applies = fsdp or autocast
    t.precision = "bf16" if param.lower() == "bfloat16" and applies else "fp32"
    how = "through FSDP" if fsdp else "through autocast (DDP or one rank)" if autocast else ""
    if param.lower() == "bfloat16" and not applies:
        note = (f"{key or 'mixed_precision_param'} bfloat16: torchtitan applies it through FSDP or autocast, not with "
                "tp or pp alone: float32, as minidist runs it")
    elif param.lower() == "bfloat16":
        note = f"{key or 'training.mixed_precision_param'} bfloat16 ({how}) -> --precision bf16 (fp32 master weights)"
    else:
        note = f"{key} float32 -> fp32"
    if key:
        t.use(key, param, "precision", note)
    else:
        t.notes.append("training.mixed_precision_param not given: torchtitan's default bfloat16; " + note)
    key, reduce = keys.take("training.mixed_precision_reduce")
    if key:
        reduce = _text(who, key, reduce)
        if t.precision == "bf16" and reduce.lower() == "float32":
            t.refuse(key, "float32: minidist's 16-bit training reduces the gradients in bf16 (with --dp and no "
                          "--zero, --fp32-grads keeps them and their all-reduce in fp32, chapter 10)")
        else:
            t.use(key, reduce, None, f"{key} {reduce}: the run is fp32, its reductions too")


def _tt_recompute(t: Translation, keys: _Keys, who: str) -> None:
    """Activation checkpointing: full (every block), selective by op (saves the matmuls' outputs)
    or every Nth block; minidist's: every block, or attention's core."""
    mode_key, mode = keys.take("activation_checkpoint.mode")
    option_key, option = keys.take("activation_checkpoint.selective_ac_option")
    if mode_key is None:
        t.notes.append("no activation_checkpoint.mode: minidist recomputes nothing (--recompute none)")
        if option_key:
            t.use(option_key, option, None, f"{option_key}: no mode given, no effect here")
        for key in keys.section("activation_checkpoint"):
            t.refuse(key, NO_RECOMPUTE)
        return
    mode = _text(who, mode_key, mode).lower()
    if mode == "none":
        t.use(mode_key, mode, None, f"{mode_key} none: no recomputation")
    elif mode == "full":
        t.recompute = "full"
        t.use(mode_key, mode, "recompute", f"{mode_key} full -> --recompute full (every block's forward rerun in "
                                           "backward, chapter 11)")
    elif mode == "selective":
        option = DEFAULTS["activation_checkpoint.selective_ac_option"] if option_key is None else option
        text = str(option).strip().lower()
        if text == "op":
            t.recompute = "selective"
            t.use(mode_key, mode, "recompute", f"{mode_key} selective, option op -> --recompute selective: "
                  "torchtitan's op-level policy saves the matmuls' outputs and recomputes the cheap ops; minidist's "
                  "(Megatron's) recomputes attention's core (scores, softmax) and keeps the rest (chapter 11)")
        elif text.isdigit() and int(text) == 1:
            t.recompute = "full"
            t.use(mode_key, mode, "recompute", f"{mode_key} selective every 1 block = every block -> --recompute full")
        elif text.isdigit() and int(text) > 1:
            t.refuse(mode_key, f"selective, every {text} blocks: minidist recomputes every block (--recompute full) or "
                               "attention's core in each (--recompute selective), not one block in N")
        else:
            raise ValueError(f"{who}: {option_key or 'activation_checkpoint.selective_ac_option'}: expected 'op' or a "
                             f"whole number >= 1, got {option!r}")
        if option_key and mode_key in t.applied:
            t.use(option_key, option, "recompute")
        elif option_key:
            t.refuse(option_key, t.refused[mode_key])
    else:
        t.refuse(mode_key, f"{mode}: minidist recomputes every block (full) or attention's core (selective)")
    if option_key and mode != "selective":
        t.use(option_key, option, None, f"{option_key}: mode {mode}, no effect")
    for key in keys.section("activation_checkpoint"):
        t.refuse(key, "minidist's recomputation is fixed by --recompute (chapter 11)")


def _fit_recompute(t: Translation) -> None:
    """Recomputation changes memory, not the training: where minidist's layout cannot recompute
    (FSDP's own block loop, context parallelism, selective with tp), refuse it and train without."""
    if t.recompute is None:
        return
    layout = t.layout()
    batch = t.batch_size or t.dp * layout.microbatches
    why = layout.why_invalid(t.model_config(), t.world_size, batch)
    asked, t.recompute = t.recompute, None
    if why is None or t.layout().why_invalid(t.model_config(), t.world_size, batch) == why:
        t.recompute = asked  # valid, or invalid for another reason: finish_translation says which
        return
    for key, entry in list(t.applied.items()):
        if entry["flag"] == "recompute":
            t.refuse(key, f"{entry['value']}: {why}" if key.endswith(".mode") else
                     f"{entry['value']}: with activation_checkpoint.mode, which this layout cannot follow")
            t.notes = [note for note in t.notes if not note.startswith(key)]
    t.notes.append(f"no recomputation: minidist's {asked} recomputation does not reach this layout (see "
                   "activation_checkpoint.mode)")
