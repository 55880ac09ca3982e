"""A DeepSpeed JSON config as a minidist layout (chapter 9)."""
from __future__ import annotations

import json
import math

from minidist.frameworks.translation import (
    BETAS, EPS, LOW_PRECISION, NO_RECOMPUTE, Translation, checked_number, data_parallel_size,
    batch_rule, finish_translation, set_layout_steps)


DS_IGNORED = {
    **dict.fromkeys(("steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard", "wandb", "csv_monitor",
                     "comet", "flops_profiler", "comms_logger", "memory_breakdown"),
                    "ignored: logging (the demo prints its progress; --json keeps the measurements)"),
    **dict.fromkeys(("data_efficiency", "curriculum_learning", "dataloader_drop_last"),
                    "ignored: minidist generates its data"),
    "checkpoint": "ignored: the demo checkpoints with --checkpoint DIR",
    "activation_checkpointing": NO_RECOMPUTE,
    "amp": LOW_PRECISION,
    "communication_data_type": "minidist communicates in the training dtype",
    "prescale_gradients": "minidist averages the gradients inside the all-reduce (one division)",
    "gradient_predivide_factor": "minidist averages the gradients inside the all-reduce (one division)",
    "zero_allow_untested_optimizer": "ignored: minidist's ZeRO partitions its own AdamW",
    "zero_force_ds_cpu_optimizer": "ignored: minidist's ZeRO partitions its own AdamW",
    "pipeline": "the stages come from PipelineModule(num_stages=...) in code: pass pp (--pp)",
}
ZERO_REASONS = {
    "offload_optimizer": "minidist keeps every state in host memory already (no device)",
    "offload_param": "minidist keeps every state in host memory already (no device)",
    "cpu_offload": "minidist keeps every state in host memory already (no device)",
    "allgather_bucket_size": "minidist's ZeRO gathers one unit (a transformer block) per message",
    "contiguous_gradients": "a device-memory defragmentation; minidist's gradient buckets are flat arrays already",
    "sub_group_size": "minidist's sharded AdamW updates its whole chunk at once",
    "stage3_gather_16bit_weights_on_model_save": "the demo's --save gathers the whole model (in fp32) already",
}


def _block(who: str, name: str, value) -> dict:
    """A nested object of the config (absent: empty), as a copy to pop keys from."""
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{who}: {name} must be a JSON object {{...}}, got {value!r}")
    return dict(value or {})


def _read_json(config) -> dict:
    if isinstance(config, dict):
        return config
    try:
        with open(config) as f:
            data = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{config}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})") from None
    except OSError as error:
        raise ValueError(f"{config}: cannot read it ({error.strerror})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{config}: a DeepSpeed config is a JSON object {{...}}, got {type(data).__name__}")
    return data


def from_deepspeed(config, world_size: int, pp: int = 1, tp: int = 1) -> Translation:
    """Translate a DeepSpeed config (a path or a parsed dict). DeepSpeed sets pipeline stages in
    code (PipelineModule(num_stages=pp)) and Megatron-DeepSpeed sets tp in code: pass them."""
    who = f"deepspeed config {config}" if not isinstance(config, dict) else "deepspeed config"
    rest = dict(_read_json(config))
    t = Translation("DeepSpeed", world_size, tp=tp, pp=pp)
    t.dp = data_parallel_size(world_size, tp, pp, who)

    def take(key, **check):  # pop a top-level number; "auto" (filled in by HF's Trainer) counts as absent
        value = rest.pop(key, None)
        if value == "auto":
            t.unsupported.append(f"{key}: 'auto' is filled in by the Hugging Face Trainer; give a number")
            return None
        return None if value is None else checked_number(f"{who}: {key}", value, **check)

    batch, micro, steps = (take(k, lo=1, integer=True) for k in
                           ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    try:
        t.batch_size, t.micro_batch_size, steps = batch_rule(t.dp, batch, micro, steps)
    except ValueError as error:
        raise ValueError(f"{who}: {error}") from None
    t.notes.append(f"train_batch_size {t.batch_size} = train_micro_batch_size_per_gpu {t.micro_batch_size} x "
                   f"gradient_accumulation_steps {steps} x dp {t.dp} -> --batch-size {t.batch_size}")
    set_layout_steps(t, steps, "gradient_accumulation_steps")
    t.clip = take("gradient_clipping", lo=0)
    if t.clip is not None:
        t.notes.append(f"gradient_clipping {t.clip:g} -> clip (max global gradient norm; 0: off)")
    _ds_zero(t, _block(who, "zero_optimization", rest.pop("zero_optimization", None)), who)
    _ds_precision(t, rest, who)
    _ds_optimizer(t, rest.pop("optimizer", None), who)
    _ds_scheduler(t, rest.pop("scheduler", None), who)
    for key in rest:
        t.unsupported.append(f"{key}: {DS_IGNORED.get(key, 'ignored: no minidist counterpart')}")
    return finish_translation(t, who)


def _ds_zero(t: Translation, zero: dict, who: str) -> None:
    t.zero = checked_number(f"{who}: zero_optimization.stage", zero.pop("stage", 0), integer=True)
    if t.zero > 3:
        raise ValueError(f"{who}: zero_optimization.stage must be 0..3, got {t.zero}")
    t.notes.append(f"zero_optimization.stage {t.zero} -> --zero {t.zero}" if t.zero
                   else "no ZeRO: plain data parallelism")
    if "overlap_comm" in zero:
        t.notes.append(f"zero_optimization.overlap_comm {json.dumps(zero.pop('overlap_comm'))}: minidist's data "
                       "parallelism always overlaps its bucketed all-reduces with backward, ZeRO-2 its "
                       "reduce-scatters (hooks)")
    if zero.pop("reduce_scatter", True) is False:
        t.unsupported.append("zero_optimization.reduce_scatter false: minidist's ZeRO always reduce-scatters")
    zero.pop("allgather_partitions", None)  # DeepSpeed's default (true) is what minidist does
    if "reduce_bucket_size" in zero:
        elements = checked_number(f"{who}: zero_optimization.reduce_bucket_size", zero.pop("reduce_bucket_size"), lo=1)
        if t.zero == 0 and t.dp > 1:
            t.bucket_kb = max(1, math.ceil(elements * 4 / 1024))
            t.notes.append(f"zero_optimization.reduce_bucket_size {elements:g} elements x 4 bytes -> --bucket-kb "
                           f"{t.bucket_kb} (data-parallel gradient buckets)")
        else:
            t.unsupported.append("zero_optimization.reduce_bucket_size: " + (
                "minidist's ZeRO reduce-scatters one unit (a transformer block) per message" if t.zero
                else "no data-parallel all-reduce at dp=1"))
    for key in zero:
        reason = ZERO_REASONS.get(key) or ("ZeRO-3 prefetch and persistence tuning: minidist's ZeRO-3 gathers a "
                                           "block when it is used and frees it after" if key.startswith("stage3_")
                                           else "no minidist counterpart")
        t.unsupported.append(f"zero_optimization.{key}: {reason}")


def _ds_precision(t: Translation, rest: dict, who: str) -> None:
    enabled = []
    for name in ("fp16", "bf16", "bfloat16"):  # bfloat16: the older name of bf16
        block = _block(who, name, rest.pop(name, None))
        on = block.pop("enabled", False)
        if on == "auto":
            t.unsupported.append(f"{name}.enabled: 'auto' is filled in by the Hugging Face Trainer; give true/false")
        elif on:
            enabled.append(name[:2] + "16")
            t.notes.append(f"{name}.enabled -> --precision {enabled[-1]} (16-bit compute, fp32 master weights)")
            for key in block:  # loss_scale, initial_scale_power, loss_scale_window, hysteresis, ...
                t.unsupported.append(f"{name}.{key}: {LOW_PRECISION}")
    if len(enabled) > 1:
        raise ValueError(f"{who}: fp16 and bf16 are both enabled; DeepSpeed accepts one of them")
    t.precision = enabled[0] if enabled else "fp32"


def _ds_optimizer(t: Translation, optimizer, who: str) -> None:
    if optimizer is None:
        t.notes.append(f"no optimizer block (the optimizer is built in code): minidist uses AdamW betas {BETAS}")
        return
    optimizer = _block(who, "optimizer", optimizer)
    kind, params = optimizer.get("type"), _block(who, "optimizer.params", optimizer.get("params"))
    if str(kind).lower() not in ("adam", "adamw"):
        t.unsupported.append(f"optimizer.type {kind}: minidist has AdamW only (optim.py); it trains with AdamW")
    elif params.pop("adam_w_mode", True) is False:
        t.unsupported.append("optimizer.params.adam_w_mode false (Adam with L2 in the gradient): minidist's "
                             "AdamW decays the weights directly")
    params.pop("torch_adam", None)  # which kernel runs, not what it computes
    if "lr" in params:
        t.lr = checked_number(f"{who}: optimizer.params.lr", params.pop("lr"), lo_open=True)
        t.notes.append(f"optimizer.params.lr {t.lr:g} -> --lr {t.lr:g}")
    if "weight_decay" in params:
        t.weight_decay = checked_number(f"{who}: optimizer.params.weight_decay", params.pop("weight_decay"))
        t.notes.append(f"optimizer.params.weight_decay {t.weight_decay:g} -> weight_decay (minidist decays matrices, "
                       "not biases or norms)")
    betas = params.pop("betas", None)
    if betas is not None and [checked_number(f"{who}: optimizer.params.betas", b)
                                  for b in (betas if isinstance(betas, list) else [betas])] != list(BETAS):
        t.unsupported.append(f"optimizer.params.betas {list(betas)}: minidist's AdamW uses betas {BETAS}")
    eps = params.pop("eps", None)
    if eps is not None and checked_number(f"{who}: optimizer.params.eps", eps) != EPS:
        t.unsupported.append(f"optimizer.params.eps {eps:g}: minidist's AdamW uses eps {EPS:g}")
    t.unsupported += [f"optimizer.params.{key}: no minidist counterpart" for key in params]


def _ds_scheduler(t: Translation, scheduler, who: str) -> None:
    if scheduler is None:
        return
    scheduler = _block(who, "scheduler", scheduler)
    kind, p = scheduler.get("type"), _block(who, "scheduler.params", scheduler.get("params"))
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        t.unsupported.append(f"scheduler.type {kind}: minidist warms up linearly, then decays by cosine")
        return
    where = f"{who}: scheduler.params"
    t.warmup = checked_number(f"{where}.warmup_num_steps", p.pop("warmup_num_steps", 1000), integer=True)
    if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
        ratio = checked_number(f"{where}.cos_min_ratio", p.pop("cos_min_ratio", 0.0001))
        t.min_lr = ratio * t.lr if t.lr is not None else None
        low = p.pop("warmup_min_ratio", 0.0)
        t.notes.append(f"WarmupCosineLR: warmup_num_steps {t.warmup} -> warmup; cos_min_ratio {ratio:g} -> min_lr "
                       f"{'%g' % t.min_lr if t.min_lr is not None else '(no optimizer lr)'}")
    else:
        t.lr = checked_number(f"{where}.warmup_max_lr", p.pop("warmup_max_lr", 0.001), lo_open=True)
        low = p.pop("warmup_min_lr", 0.0)
        # WarmupLR holds the peak; minidist's cosine from lr to min_lr = lr is exactly that
        t.min_lr = t.lr if kind == "WarmupLR" else low
        t.notes.append(f"{kind}: warmup_max_lr {t.lr:g} -> --lr, warmup_num_steps {t.warmup} -> warmup, min_lr "
                       f"{t.min_lr:g}" + (" (constant after warm-up)" if kind == "WarmupLR" else ""))
        if kind == "WarmupDecayLR":
            t.unsupported.append("scheduler WarmupDecayLR decays linearly: minidist decays by cosine (same ends)")
    if low:
        t.unsupported.append(f"scheduler warm-up start {low:g}: minidist warms up from lr/warmup")
    if p.pop("warmup_type", "log") != "linear":
        t.unsupported.append("scheduler.params.warmup_type log (DeepSpeed's default): minidist warms up linearly")
    if "total_num_steps" in p:
        t.steps = checked_number(f"{where}.total_num_steps", p.pop("total_num_steps"), lo=1, integer=True)
        t.notes.append(f"scheduler total_num_steps {t.steps} -> --steps {t.steps}")
    t.unsupported += [f"scheduler.params.{key}: no minidist counterpart" for key in p]
