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

from minidist.frameworks.translation import Translation, finish_translation
from minidist.frameworks.torchtitan.keys import FLOAT8, IGNORED, Keys, read_toml
from minidist.frameworks.torchtitan.parallelism import read_batch, read_layout, read_model
from minidist.frameworks.torchtitan.training import (fit_recompute, read_optimizer, read_precision, read_recompute,
                                                     read_schedule, read_training)


def from_torchtitan(config, world_size: int, settings: dict | None = None) -> Translation:
    """Translate a torchtitan TOML job config (a path, or the parsed dict) on `world_size` ranks.
    `settings`: the demo's flags given on its command line (n_layer decides, with
    pipeline_parallel_layers_per_stage, how many chunks each pipeline rank holds)."""
    who = f"torchtitan config {config}" if not isinstance(config, dict) else "torchtitan config"
    keys = Keys(read_toml(config), who)
    t = Translation("torchtitan", world_size)
    float8 = read_model(t, keys, who)
    degrees = read_layout(t, keys, who)
    read_batch(t, keys, who, settings or {})
    read_optimizer(t, keys, who)
    read_schedule(t, keys, who)
    read_precision(t, keys, who, degrees)
    read_training(t, keys, who)
    read_recompute(t, keys, who)
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
    fit_recompute(t)
    try:
        return finish_translation(t, who)
    except ValueError as error:
        model = t.model_config()
        if t.n_layer is None or t.n_head is None or t.n_embd is None:  # the demo's default model was judged
            raise ValueError(f"{error} (judged on the model n_layer {model.n_layer}, n_embd {model.n_embd}, n_head "
                             f"{model.n_head}, block_size {model.block_size}: give the one to run with --n-layer, "
                             "--n-embd, --n-head, --block-size)") from None
        raise


__all__ = ["from_torchtitan"]
