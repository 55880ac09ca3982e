"""A DeepSpeed JSON config as a minidist layout and run (chapter 9).

Every key of the config ends in the translation's ledger: applied (its value reaches the run,
through one of the demo's flags) or refused with the reason. Hugging Face's Trainer writes "auto"
for the values it fills in from its own arguments; `resolve_auto` fills them the same way from the
demo's flags, the model and the world size, at any depth.
"""
from __future__ import annotations

import json
import math

from minidist.frameworks.translation import (
    LOW_PRECISION, NO_RECOMPUTE, Translation, checked_number, data_parallel_size, batch_rule, finish_translation,
    set_layout_steps)


DS_IGNORED = {
    **dict.fromkeys(("steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard", "wandb", "csv_monitor",
                     "comet", "flops_profiler", "comms_logger", "memory_breakdown"),
                    "ignored: logging (the demo prints its progress; --json keeps the measurements)"),
    **dict.fromkeys(("data_efficiency", "curriculum_learning", "dataloader_drop_last"),
                    "ignored: minidist generates its data"),
    "checkpoint": "ignored: the demo checkpoints with --checkpoint DIR",
    "activation_checkpointing": NO_RECOMPUTE,
    "amp": "NVIDIA Apex's AMP (its opt_level O1/O2): minidist's 16-bit training is --precision fp16|bf16 (chapter 10)",
    "communication_data_type": "minidist communicates in the training dtype",
    "prescale_gradients": "minidist averages the gradients inside the all-reduce (one division)",
    "gradient_predivide_factor": "minidist averages the gradients inside the all-reduce (one division)",
    "zero_allow_untested_optimizer": "ignored: minidist's ZeRO partitions its own AdamW",
    "zero_force_ds_cpu_optimizer": "ignored: minidist's ZeRO partitions its own AdamW",
    "pipeline": "the stages come from PipelineModule(num_stages=...) in code: pass pp (--pp)",
}
ZERO_REASONS = {
    "allgather_bucket_size": "minidist's ZeRO gathers one unit (a transformer block) per message",
    "contiguous_gradients": "a device-memory defragmentation; minidist's gradient buckets are flat arrays already",
    "sub_group_size": "minidist's sharded AdamW updates its whole chunk at once",
    "stage3_gather_16bit_weights_on_model_save": "the demo's --save gathers the whole model (in fp32) already",
    "round_robin_gradients": "minidist's ZeRO-2 reduce-scatters each unit as its gradients are ready",
}
OFFLOAD = "minidist keeps every state in host memory already: there is no device memory to offload from"
HF_DEFAULTS = {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0,
               "warmup": 0}  # transformers' TrainingArguments defaults


def resolve_auto(config: dict, world_size: int, settings: dict | None = None) -> tuple[dict, dict]:
    """A copy of `config` with every "auto" filled in as Hugging Face's Trainer fills it
    (`HfTrainerDeepSpeedConfig.trainer_config_process` and `..._finalize`), from `settings` (the
    demo's flags: batch_size, accumulation, lr, warmup, steps, weight_decay, clip, adam_beta1/2,
    adam_eps, precision, n_embd; those absent take the Trainer's own defaults), and {path: value}
    of what was filled. A value that cannot be known is left "auto" (the reader refuses it)."""
    s = dict(settings or {})
    filled = {}
    n_embd = s.get("n_embd")

    def fill(path: str, value):
        if value is not None:
            filled[path] = value
        return value if value is not None else "auto"

    accumulation = s.get("accumulation") or 1
    batch = s.get("batch_size")
    micro = batch // (world_size * accumulation) if batch and batch % (world_size * accumulation) == 0 else None
    betas = [s.get("adam_beta1", HF_DEFAULTS["betas"][0]), s.get("adam_beta2", HF_DEFAULTS["betas"][1])]
    rules = {  # path -> the value the Trainer puts there
        "train_batch_size": batch, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
        "gradient_clipping": s.get("clip", HF_DEFAULTS["max_grad_norm"]),
        "optimizer.params.lr": s.get("lr", HF_DEFAULTS["lr"]), "optimizer.params.betas": betas,
        "optimizer.params.eps": s.get("adam_eps", HF_DEFAULTS["eps"]),
        "optimizer.params.weight_decay": s.get("weight_decay", HF_DEFAULTS["weight_decay"]),
        "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": s.get("lr", HF_DEFAULTS["lr"]),
        "scheduler.params.warmup_num_steps": s.get("warmup", HF_DEFAULTS["warmup"]),
        "scheduler.params.total_num_steps": s.get("steps"),
        "fp16.enabled": s.get("precision") == "fp16", "bf16.enabled": s.get("precision") == "bf16",
        "zero_optimization.reduce_bucket_size": n_embd * n_embd if n_embd else None,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * n_embd * n_embd) if n_embd else None,
        "zero_optimization.stage3_param_persistence_threshold": 10 * n_embd if n_embd else None,
    }

    def walk(node, path: str):
        if isinstance(node, dict):
            return {k: walk(v, f"{path}.{k}" if path else k) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(node)]
        return fill(path, rules.get(path)) if node == "auto" else node

    return walk(config, ""), filled


def _block(who: str, name: str, value) -> dict:
    """A nested object of the config (absent: empty), as a copy to pop keys from."""
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{who}: {name} must be a JSON object {{...}}, got {value!r}")
    return dict(value or {})


def _read_json(config) -> dict:
    if isinstance(config, dict):
        return config
    try:
        with open(config, "rb") as f:
            raw = f.read()
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{config}: not a text file (a DeepSpeed config is UTF-8 JSON)") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{config}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})") from None
    except OSError as error:
        raise ValueError(f"{config}: cannot read it ({error.strerror})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config}: a DeepSpeed config is a JSON object {{...}}, got {type(data).__name__}")
    return data


def from_deepspeed(config, world_size: int, pp: int = 1, tp: int = 1, settings: dict | None = None) -> Translation:
    """Translate a DeepSpeed config (a path or a parsed dict). DeepSpeed sets pipeline stages in
    code (PipelineModule(num_stages=pp)) and Megatron-DeepSpeed sets tp in code: pass them.
    `settings`: the demo's flags that fill Hugging Face's "auto" values (`resolve_auto`)."""
    who = f"deepspeed config {config}" if not isinstance(config, dict) else "deepspeed config"
    data, filled = resolve_auto(_read_json(config), world_size, settings)
    rest = dict(data)
    t = Translation("DeepSpeed", world_size, tp=tp, pp=pp)
    for name in ("n_layer", "n_embd", "n_head", "block_size"):  # the model is built in code: the caller's
        if settings and settings.get(name) is not None:
            setattr(t, name, settings[name])
    t.dp = data_parallel_size(world_size, tp, pp, who)
    for path, value in filled.items():
        t.notes.append(f'{path} "auto" -> {value} (as Hugging Face\'s Trainer fills it)')

    def take(key, **check):  # pop a top-level number; an unfilled "auto" is refused
        value = rest.pop(key, None)
        if value == "auto":
            t.refuse(key, "'auto' is filled in by the Hugging Face Trainer from its arguments: give a number, or "
                          "the demo's flag that fills it")
            return None
        return None if value is None else checked_number(f"{who}: {key}", value, **check)

    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    given = {key: key in data and data[key] != "auto" for key in keys}
    batch, micro, steps = (take(k, lo=1, integer=True) for k in keys)
    try:
        t.batch_size, t.micro_batch_size, steps = batch_rule(t.dp, batch, micro, steps)
    except ValueError as error:
        raise ValueError(f"{who}: {error}") from None
    t.notes.append(f"train_batch_size {t.batch_size} = train_micro_batch_size_per_gpu {t.micro_batch_size} x "
                   f"gradient_accumulation_steps {steps} x dp {t.dp} -> --batch-size {t.batch_size}")
    set_layout_steps(t, steps, "gradient_accumulation_steps")
    for key, value, flag in zip(keys, (t.batch_size, t.micro_batch_size, steps),
                                ("batch_size", None, "microbatches" if t.pp > 1 else "accumulation")):
        if given[key]:
            t.use(key, value, flag)
    t.clip = take("gradient_clipping", lo=0)
    if t.clip is None:
        t.clip = 0.0
        t.notes.append("no gradient_clipping: DeepSpeed's default 0 (no clipping) -> --clip 0")
    else:
        t.use("gradient_clipping", t.clip, "clip", f"gradient_clipping {t.clip:g} -> --clip {t.clip:g} (max global "
                                                   "gradient norm; 0: off)")
    _ds_zero(t, _block(who, "zero_optimization", rest.pop("zero_optimization", None)), who)
    _ds_precision(t, rest, who)
    _ds_optimizer(t, rest.pop("optimizer", None), who)
    _ds_scheduler(t, rest.pop("scheduler", None), who)
    for key in rest:
        t.refuse(key, DS_IGNORED.get(key, "ignored: no minidist counterpart"))
    return finish_translation(t, who)


def _offload(t: Translation, key: str, value, who: str) -> None:
    """offload_optimizer / offload_param: {"device": "none"} is no offload, which is what minidist does."""
    block = _block(who, f"zero_optimization.{key}", value) if isinstance(value, dict) else {"device": value}
    device = str(block.get("device", "none")).lower()
    if device in ("none", "false"):
        t.use(f"zero_optimization.{key}", value, None, f'zero_optimization.{key} device "none": no offload, as minidist '
                                                       "runs")
    else:
        t.refuse(f"zero_optimization.{key}", f'device "{device}": {OFFLOAD}')


def _ds_zero(t: Translation, zero: dict, who: str) -> None:
    given = "stage" in zero
    t.zero = checked_number(f"{who}: zero_optimization.stage", zero.pop("stage", 0), integer=True)
    if t.zero > 3:
        raise ValueError(f"{who}: zero_optimization.stage must be 0..3, got {t.zero}")
    if given:
        t.use("zero_optimization.stage", t.zero, "zero")
    t.notes.append(f"zero_optimization.stage {t.zero} -> --zero {t.zero}" if t.zero
                   else "no ZeRO: plain data parallelism")
    if "overlap_comm" in zero:
        value = zero.pop("overlap_comm")
        if value is False:
            t.refuse("zero_optimization.overlap_comm", "false: minidist's data parallelism always overlaps its "
                                                       "bucketed all-reduces (and ZeRO-2 its reduce-scatters) with backward")
        else:
            t.use("zero_optimization.overlap_comm", value, None, "zero_optimization.overlap_comm: minidist overlaps its "
                                                                 "bucketed all-reduces and ZeRO-2's reduce-scatters")
    if "reduce_scatter" in zero:
        if zero.pop("reduce_scatter") is False:
            t.refuse("zero_optimization.reduce_scatter", "false: minidist's ZeRO always reduce-scatters")
        else:
            t.use("zero_optimization.reduce_scatter", True, None)
    if "allgather_partitions" in zero:
        value = zero.pop("allgather_partitions")
        if value is False:
            t.refuse("zero_optimization.allgather_partitions", "false (a broadcast per partition): minidist's ZeRO "
                                                               "all-gathers")
        else:
            t.use("zero_optimization.allgather_partitions", True, None)
    if "reduce_bucket_size" in zero:
        value = zero.pop("reduce_bucket_size")
        if value == "auto":
            t.refuse("zero_optimization.reduce_bucket_size", "'auto' is hidden_size^2 in Hugging Face's Trainer: give "
                                                             "--n-embd, or a number")
        else:
            elements = checked_number(f"{who}: zero_optimization.reduce_bucket_size", value, lo=1)
            if t.zero == 0 and t.dp > 1:
                t.bucket_kb = max(1, math.ceil(elements * 4 / 1024))
                t.use("zero_optimization.reduce_bucket_size", elements, "bucket_kb",
                      f"zero_optimization.reduce_bucket_size {elements:g} elements x 4 bytes -> --bucket-kb "
                      f"{t.bucket_kb} (data-parallel gradient buckets)")
            else:
                t.refuse("zero_optimization.reduce_bucket_size", "minidist's ZeRO reduce-scatters one unit (a transformer "
                         "block) per message" if t.zero else "no data-parallel all-reduce at dp=1")
    for key in ("offload_optimizer", "offload_param", "cpu_offload"):
        if key in zero:
            _offload(t, key, zero.pop(key), who)
    for key, value in zero.items():
        reason = ZERO_REASONS.get(key) or ("ZeRO-3 prefetch and persistence tuning: minidist's ZeRO-3 gathers a "
                                           "block when it is used and frees it after" if key.startswith("stage3_")
                                           else "no minidist counterpart")
        t.refuse(f"zero_optimization.{key}", reason)


def _ds_precision(t: Translation, rest: dict, who: str) -> None:
    enabled = []
    for name in ("fp16", "bf16", "bfloat16"):  # bfloat16: the older name of bf16
        if name not in rest:
            continue
        block = _block(who, name, rest.pop(name))
        on = block.pop("enabled", False)
        if on == "auto":
            t.refuse(f"{name}.enabled", "'auto' is filled in by the Hugging Face Trainer from --fp16/--bf16: give "
                                        "true/false, or --precision")
            t.refuse(name, "its enabled is 'auto'")
            continue
        if on:
            enabled.append(name[:2] + "16")
            t.use(f"{name}.enabled", True, "precision", f"{name}.enabled -> --precision {enabled[-1]} (16-bit "
                                                        "compute, fp32 master weights)")
        else:
            t.use(f"{name}.enabled", False, None)
        if name == "fp16":
            _ds_loss_scale(t, block, who, on)
        for key in block:
            t.refuse(f"{name}.{key}", LOW_PRECISION)
    if len(enabled) > 1:
        raise ValueError(f"{who}: fp16 and bf16 are both enabled; DeepSpeed accepts one of them")
    t.precision = enabled[0] if enabled else "fp32"


def _ds_loss_scale(t: Translation, block: dict, who: str, on: bool) -> None:
    """DeepSpeed's fp16 loss-scale keys: dynamic (loss_scale 0) is what minidist's scaler does."""
    if "loss_scale" in block:
        scale = checked_number(f"{who}: fp16.loss_scale", block.pop("loss_scale"))
        if scale == 0:
            t.use("fp16.loss_scale", 0, None, "fp16.loss_scale 0: a dynamic loss scale, as minidist's")
        else:
            t.refuse("fp16.loss_scale", f"{scale:g} (a static scale): minidist's loss scale is dynamic (chapter 10)")
    if "initial_scale_power" in block:
        power = checked_number(f"{who}: fp16.initial_scale_power", block.pop("initial_scale_power"), integer=True)
        t.initial_loss_scale = 2.0 ** power
        t.use("fp16.initial_scale_power", power, "initial_loss_scale",
              f"fp16.initial_scale_power {power} -> --initial-loss-scale {t.initial_loss_scale:g}")
    if "loss_scale_window" in block:
        t.loss_scale_window = checked_number(f"{who}: fp16.loss_scale_window", block.pop("loss_scale_window"), lo=1,
                                             integer=True)
        t.use("fp16.loss_scale_window", t.loss_scale_window, "loss_scale_window",
              f"fp16.loss_scale_window {t.loss_scale_window} -> --loss-scale-window {t.loss_scale_window}")
    if "hysteresis" in block:
        hysteresis = block.pop("hysteresis")
        if hysteresis == 1:
            t.use("fp16.hysteresis", 1, None, "fp16.hysteresis 1: halve at the first overflow, as minidist's scaler")
        else:
            t.refuse("fp16.hysteresis", f"{hysteresis}: minidist's scaler halves at the first overflow (torch "
                                        "GradScaler's rule), it does not wait for more")
    for key in ("min_loss_scale", "consecutive_hysteresis"):
        if key in block:
            t.refuse(f"fp16.{key}", f"{block.pop(key)}: minidist's dynamic scaler has no floor and no hysteresis "
                                    "(torch GradScaler's rule)")


def _ds_optimizer(t: Translation, optimizer, who: str) -> None:
    if optimizer is None:
        t.notes.append("no optimizer block (the optimizer is built in code): minidist uses AdamW with the demo's flags")
        return
    optimizer = _block(who, "optimizer", optimizer)
    kind, params = optimizer.pop("type", None), _block(who, "optimizer.params", optimizer.pop("params", None))
    if str(kind).lower() not in ("adam", "adamw", "fusedadam", "cpuadam"):
        t.refuse("optimizer.type", f"{kind}: minidist has AdamW only (optim.py); it trains with AdamW")
    elif params.get("adam_w_mode", True) is False:
        params.pop("adam_w_mode")
        t.refuse("optimizer.params.adam_w_mode", "false (Adam with L2 in the gradient): minidist's AdamW decays the "
                                                 "weights directly")
    else:
        t.use("optimizer.type", kind, None, f"optimizer.type {kind}: AdamW")
        if "adam_w_mode" in params:
            t.use("optimizer.params.adam_w_mode", params.pop("adam_w_mode"), None)
    if "torch_adam" in params:  # which kernel runs, not what it computes
        t.use("optimizer.params.torch_adam", params.pop("torch_adam"), None)
    for key, name, flag, check in (("lr", "lr", "lr", dict(lo_open=True)),
                                   ("weight_decay", "weight_decay", "weight_decay", {}),
                                   ("eps", "eps", "adam_eps", dict(lo_open=True))):
        if key not in params:
            continue
        value = params.pop(key)
        if value == "auto":
            t.refuse(f"optimizer.params.{key}", "'auto' is filled in by the Hugging Face Trainer: give --"
                                                + flag.replace("_", "-") + " or a number")
            continue
        setattr(t, name, checked_number(f"{who}: optimizer.params.{key}", value, **check))
        t.use(f"optimizer.params.{key}", getattr(t, name), flag,
              f"optimizer.params.{key} {getattr(t, name):g} -> --{flag.replace('_', '-')} {getattr(t, name):g}")
    if "betas" in params:
        betas = params.pop("betas")
        if not (isinstance(betas, list) and len(betas) == 2):
            raise ValueError(f"{who}: optimizer.params.betas must be [beta1, beta2], got {betas!r}")
        t.betas = tuple(checked_number(f"{who}: optimizer.params.betas", b) for b in betas)
        t.use("optimizer.params.betas", list(t.betas), "adam_beta1",
              f"optimizer.params.betas {list(t.betas)} -> --adam-beta1 {t.betas[0]:g} --adam-beta2 {t.betas[1]:g}")
    for name, value in (("betas", (0.9, 0.999)), ("eps", 1e-8), ("weight_decay", 0.0)):  # torch's Adam(W) defaults
        if getattr(t, name) is None:
            setattr(t, name, value)
            t.notes.append(f"optimizer.params.{name} not given: DeepSpeed's (torch's) default {value}")
    for key in params:
        t.refuse(f"optimizer.params.{key}", "no minidist counterpart")
    for key in optimizer:
        t.refuse(f"optimizer.{key}", "no minidist counterpart")


def _ds_scheduler(t: Translation, scheduler, who: str) -> None:
    if scheduler is None:
        return
    scheduler = _block(who, "scheduler", scheduler)
    kind, p = scheduler.pop("type", None), _block(who, "scheduler.params", scheduler.pop("params", None))
    for key in scheduler:
        t.refuse(f"scheduler.{key}", "no minidist counterpart")
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        t.refuse("scheduler", f"type {kind}: minidist warms up linearly, then decays by cosine, linearly or not at all")
        return
    where = f"{who}: scheduler.params"
    for key in [k for k, v in p.items() if v == "auto"]:  # what the Trainer would fill and nothing here could
        p.pop(key)
        t.refuse(f"scheduler.params.{key}", "'auto' is filled in by the Hugging Face Trainer: give the demo's flag "
                                            "(--lr, --warmup, --steps) or a number")
    t.use("scheduler.type", kind, "lr_decay")
    t.decay = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}[kind]
    if "warmup_num_steps" in p:
        t.warmup = checked_number(f"{where}.warmup_num_steps", p.pop("warmup_num_steps"), integer=True)
        t.use("scheduler.params.warmup_num_steps", t.warmup, "warmup")
    else:
        t.warmup = 1000  # DeepSpeed's default
        t.notes.append("scheduler.params.warmup_num_steps not given: DeepSpeed's default 1000 -> --warmup 1000")
    if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
        ratio = checked_number(f"{where}.cos_min_ratio", p.pop("cos_min_ratio", 0.0001))
        t.min_lr = ratio * (t.lr if t.lr is not None else 1e-3)
        t.use("scheduler.params.cos_min_ratio", ratio, "min_lr", f"WarmupCosineLR: cos_min_ratio {ratio:g} -> "
                                                                  f"--min-lr {t.min_lr:g}")
        low_key, low = "scheduler.params.warmup_min_ratio", p.pop("warmup_min_ratio", 0.0)
    else:
        t.lr = checked_number(f"{where}.warmup_max_lr", p.pop("warmup_max_lr", 0.001), lo_open=True)
        t.use("scheduler.params.warmup_max_lr", t.lr, "lr")
        low_key, low = "scheduler.params.warmup_min_lr", p.pop("warmup_min_lr", 0.0)
        t.min_lr = t.lr if kind == "WarmupLR" else low  # WarmupDecayLR decays to warmup_min_lr
        t.notes.append(f"{kind}: --lr {t.lr:g}, --warmup {t.warmup}, --lr-decay {t.decay}, --min-lr {t.min_lr:g}")
    if low:
        t.refuse(low_key, f"{low:g}: minidist warms up from lr/warmup, not from a floor")
    else:
        t.use(low_key, low, None)
    warmup_type = p.pop("warmup_type", "log")
    if warmup_type != "linear":
        t.refuse("scheduler.params.warmup_type", f"{warmup_type} (DeepSpeed's default is log): minidist warms up "
                                                 "linearly")
    else:
        t.use("scheduler.params.warmup_type", "linear", None)
    if "total_num_steps" in p:
        t.steps = checked_number(f"{where}.total_num_steps", p.pop("total_num_steps"), lo=1, integer=True)
        t.use("scheduler.params.total_num_steps", t.steps, "steps", f"scheduler total_num_steps {t.steps} -> --steps "
                                                                    f"{t.steps}")
    for key in p:
        t.refuse(f"scheduler.params.{key}", "no minidist counterpart")
