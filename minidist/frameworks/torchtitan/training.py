"""torchtitan's [optimizer], [lr_scheduler], [training], precision and recomputation (chapter 9)."""
from __future__ import annotations

from minidist.frameworks.translation import NO_RECOMPUTE, Translation, checked_number
from minidist.frameworks.torchtitan.keys import (DEFAULTS, TRAINING_IGNORED, Keys, only_when_off, switch_value,
                                                 text_value)


# ----------------------------------------------------------------------------- [optimizer], [lr_scheduler]


def read_optimizer(t: Translation, keys: Keys, who: str) -> None:
    name_key, name = keys.take("optimizer.name")
    name = "AdamW" if name_key is None else text_value(who, name_key, name)
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
    only_when_off(t, keys, who, "optimizer.early_step_in_backward",
                  "true: minidist steps once the whole backward is done (and clips the global norm first)")
    for key in keys.section("optimizer"):
        t.refuse(key, "no minidist counterpart (minidist's AdamW: lr, betas, eps, weight_decay)")


def read_schedule(t: Translation, keys: Keys, who: str) -> None:
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
    decay = DEFAULTS["lr_scheduler.decay_type"] if key is None else text_value(who, key, decay,
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
        read_decay_ratio(t, keys, who, key, ratio)
    for key in keys.section("lr_scheduler"):
        t.refuse(key, "no minidist counterpart (minidist's schedule: --warmup, --lr-decay, --min-lr)")


def read_decay_ratio(t: Translation, keys: Keys, who: str, key: str, ratio) -> None:
    """Warmup-stable-decay: the lr stays at its peak until the last `decay_ratio` of the steps."""
    if ratio is None:
        t.use(key, None, None)
        return
    ratio = checked_number(f"{who}: {key}", ratio)
    steps_key, steps = keys.take("training.steps")
    if steps_key:
        keys.flat[steps_key] = steps  # read_training reads it
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    if steps is not None and t.warmup + round(steps * ratio) == steps:
        t.use(key, ratio, None, f"{key} {ratio:g}: the decay starts right after the warm-up, as minidist's")
    else:
        t.refuse(key, f"{ratio:g} (warmup-stable-decay: the peak lr held until the last {ratio:g} of the steps): "
                      "minidist decays right after the warm-up")


# ----------------------------------------------------------------------------- [training], precision, recompute


def read_training(t: Translation, keys: Keys, who: str) -> None:
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
        t.use(key, switch_value(who, key, value), None, f"{key}: minidist's runs are deterministic already")
    only_when_off(t, keys, who, "training.enable_cpu_offload",
                  "true: minidist keeps every state in host memory already: there is no device memory to "
                  "offload from")
    for key in keys.section("training"):
        t.refuse(key, TRAINING_IGNORED.get(key.split(".", 1)[1], "ignored: no minidist counterpart"))


def read_precision(t: Translation, keys: Keys, who: str, degrees: dict) -> None:
    """mixed_precision_param takes effect through FSDP (shard > 1 or cp > 1), or through autocast
    when nothing but DDP runs (job_config.py); with tp or pp alone torchtitan trains in float32."""
    key, param = keys.take("training.mixed_precision_param")
    param = DEFAULTS["training.mixed_precision_param"] if key is None else text_value(who, key, param,
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
        reduce = text_value(who, key, reduce)
        if t.precision == "bf16" and reduce.lower() == "float32":
            t.refuse(key, "float32: minidist's 16-bit training reduces the gradients in bf16 (with --dp and no "
                          "--zero, --fp32-grads keeps them and their all-reduce in fp32, chapter 10)")
        else:
            t.use(key, reduce, None, f"{key} {reduce}: the run is fp32, its reductions too")


def read_recompute(t: Translation, keys: Keys, who: str) -> None:
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
    mode = text_value(who, mode_key, mode).lower()
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


def fit_recompute(t: Translation) -> None:
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
