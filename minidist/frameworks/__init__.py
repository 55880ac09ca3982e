"""Frameworks (DeepSpeed, Megatron-LM, torchtitan): read a real config and say what layout it means here.

Chapter 9. DeepSpeed and Megatron-LM describe the same few decisions that minidist makes with
its demo's flags: how many ranks split the batch (dp), the layers (pp) and each layer (tp);
which ZeRO stage shards what; how a step's batch is cut into micro-batches; the optimizer's
schedule. This file translates a DeepSpeed JSON config, a Megatron-LM argument line or a
torchtitan TOML job config into those decisions, so a learner can paste a real config and run
its layout small:

    python -m minidist.frameworks deepspeed examples/frameworks/deepspeed_zero2.json --world 4
    python -m minidist.frameworks megatron --world 8 --file examples/frameworks/megatron_gpt_tp2_pp2.txt
    python -m minidist.frameworks torchtitan examples/frameworks/torchtitan_hsdp_tp.toml --world 8

All three obey one batch rule, here as there:

    global batch = micro-batch per rank x micro-steps x dp,     dp = world / (tp x pp)

DeepSpeed names the three `train_batch_size`, `train_micro_batch_size_per_gpu` and
`gradient_accumulation_steps` (any two give the third); Megatron-LM `--global-batch-size` and
`--micro-batch-size` (micro-steps = global / (micro x dp)); torchtitan `global_batch_size` and
`local_batch_size`, with dp = data_parallel_replicate_degree x data_parallel_shard_degree. With
a pipeline (pp > 1) the micro-steps are the pipeline's micro-batches; without, gradient
accumulation. The mesh is pp x dp x tp with tp fastest, Megatron's default order
(tp-cp-ep-dp-pp) on the same grid, and torchtitan's (pp, dp_replicate, dp_shard, cp, tp).

Every key is accounted for: `notes` say how each supported one was mapped, `unsupported` why
each other one is not (a key minidist cannot honour is listed, never silently dropped). In code:

    t = from_deepspeed("ds.json", world_size=4, pp=1)     # or from_megatron("--tensor-... 2 ...", 8)
    t.dp, t.tp, t.pp, t.zero, t.batch_size, t.microbatches   # the layout
    t.demo_flags()                                        # ['--dp', '4', '--zero', '2', ...]
    t.apply(args)                                         # onto the demo's argparse Namespace
"""
from minidist.frameworks.deepspeed import from_deepspeed
from minidist.frameworks.megatron import from_megatron, parse_megatron, words
from minidist.frameworks.torchtitan import from_torchtitan
from minidist.frameworks.translation import Translation, given_flags

__all__ = ["Translation", "from_deepspeed", "from_megatron", "from_torchtitan", "given_flags", "parse_megatron",
           "words"]
