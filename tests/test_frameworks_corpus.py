"""The corpus: DeepSpeed configs and Megatron-LM lines in the shapes real projects ship (chapter 9).

examples/frameworks/ holds configurations written the way DeepSpeed's examples, Hugging Face's
templates, Megatron-LM's and Megatron-DeepSpeed's launch scripts and BLOOM's slurm file write
them (real key names, realistic values; batches and models shrunk where a run must fit a
laptop). CORPUS says, for every file, which reader reads it, on how many ranks its degrees run,
and what real file it is shaped like (a DeepSpeed JSON cannot say it itself: DeepSpeed has no
comment key). Each file is

  * translated: it succeeds, or fails in one line with the reason CORPUS expects (some real
    layouts are ones minidist refuses);
  * accounted for: every key of the input (every dotted JSON path, every Megatron flag) is
    applied or refused, none silently lost; every applied key with a demo flag reaches
    `demo_settings()` with the value the config means (the framework's meaning, written out here
    independently of the readers: `meant`);
  * run small (the full tier; the quick tier runs two): `python -m minidist.demo
    --deepspeed-config PATH` or `--megatron-args "$(cat PATH)"` with a 2-layer model for 2 steps
    under mpiexec, checking the run's optimizer against what the config asked and its
    `framework_config` ledger against the config's keys.

Hugging Face's "auto" values are checked against what transformers' Trainer puts there
(`HfTrainerDeepSpeedConfig.trainer_config_process` / `trainer_config_finalize`): `hf_trainer_fills`.

A file's `bugs` ({aspect: why}) names what a reader is known to get wrong, so that the main tests
leave that aspect out until it is fixed; none is open now.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from minidist import frameworks as fw
from minidist.comm.launch import find_mpiexec
from minidist.frameworks.deepspeed import resolve_auto

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXAMPLES = "examples/frameworks"  # relative to ROOT: the tests and the demo run there (Megatron-DeepSpeed lines name
#                                   their JSON by this path, as the launch scripts name theirs)
SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--steps", "2", "--log-every", "-1"]
STEPS = 2
RUN_TIMEOUT = 120
QUICK_RUNS = {"hf_ds_config_zero2.json", "megatron_llama2_7b.txt"}  # the quick tier's runs: one per reader
# the full tier's runs besides: one per kind of layout and feature the readers map (pipeline, ZeRO-1/3,
# fp16 loss scaling, tensor + pipeline, MoE, context parallelism with fp8, Megatron-DeepSpeed); every
# other config runs in the extended tier (every config is translated and checked in every tier)
FULL_RUNS = {"ds_pipeline_pp2.json", "ds_zero1_gradient_accumulation.json", "ds_zero2_fp16_dynamic.json",
             "ds_zero3_offload_cpu.json", "megatron_gpt_tp2_pp2.txt", "megatron_mixtral_8x7b.txt",
             "megatron_llama3_8b_cp2_fp8.txt", "megatron_deepspeed_gpt_zero1.json"}

# -- the known reader bugs, where a case has one: what is wrong, and the fix proposed (`Case.bugs`)


@dataclass(frozen=True)
class Case:
    file: str
    reader: str                      # "deepspeed" or "megatron"
    world: int                       # the ranks its degrees need (the translation's world size)
    shaped_like: str                 # the real file it follows
    pp: int = 1                      # DeepSpeed: the degrees set in code (PipelineModule, Megatron-DeepSpeed's mpu)
    tp: int = 1
    run: int | None = None           # ranks of the scaled-down demo run (None: translated only)
    why_not_run: str = ""
    flags: tuple = ()                # the run's extra demo flags
    settings: dict | None = None     # HF "auto" templates: what the Trainer's arguments would be
    model: dict | None = None        # DeepSpeed: the model its code builds (the demo's flags), where it matters
    fails: str | None = None         # the one-line reason the translation fails with ({path}: the file's path)
    optimizer: dict = field(default_factory=dict)   # what the config asks of the run's optimizer (others: the demo's)
    bugs: dict = field(default_factory=dict)        # aspect -> why a reader gets it wrong (none open)

    @property
    def path(self) -> str:
        return f"{EXAMPLES}/{self.file}"

    def __str__(self) -> str:
        return self.file


HF_SETTINGS = {"batch_size": 32, "lr": 2e-5, "n_embd": 40, "steps": 100}  # n_embd 40: 0.9 x 40^2 = 1440 exactly
D = "deepspeed"
M = "megatron"
CORPUS = [
    # ---------------------------------------------------------------- DeepSpeed
    Case("deepspeed_zero2.json", D, 4, "DeepSpeed's config-json docs: ZeRO-2 with its bucket sizes, bf16, WarmupCosineLR",
         run=4, optimizer=dict(lr=3e-3, min_lr=0.1 * 3e-3, warmup=20, weight_decay=0.1, clip=1.0, betas=[0.9, 0.95],
                               eps=1e-8, decay="cosine")),
    Case("deepspeed_zero3_offload.json", D, 2, "transformers' tests/deepspeed/ds_config_zero3.json (ZeRO-3, CPU offload, "
         "fp16 dynamic loss scale) with numbers for its values", run=2,
         optimizer=dict(lr=1e-3, min_lr=0.0, warmup=10, weight_decay=0.0, clip=1.0, betas=[0.9, 0.999], eps=1e-8,
                        decay="linear", initial_loss_scale=2.0**16, loss_scale_window=1000)),
    Case("ds_zero0_adam.json", D, 2, "DeepSpeedExamples training/cifar/ds_config.json: stage 0 (plain data parallelism "
         "with reduce_bucket_size), Adam, WarmupLR, an fp16 block switched off", run=2,
         optimizer=dict(lr=1e-3, min_lr=1e-3, warmup=1000, weight_decay=3e-7, clip=1.0, betas=[0.8, 0.999], eps=1e-8,
                        decay="constant", initial_loss_scale=2.0**15, loss_scale_window=500)),
    Case("ds_zero1_gradient_accumulation.json", D, 2, "DeepSpeed's batch keys (train_batch_size = micro x "
         "gradient_accumulation_steps x dp) with ZeRO-1, as Megatron-DeepSpeed's examples_deepspeed/rebase/"
         "ds_config_gbs256_mbs8_log1_zero1.json; WarmupLR with warmup_type linear", run=2,
         optimizer=dict(lr=6e-4, min_lr=6e-4, warmup=2000, weight_decay=0.1, clip=1.0, betas=[0.9, 0.95], eps=1e-8,
                        decay="constant")),
    Case("ds_zero2_fp16_dynamic.json", D, 4, "DeepSpeed's ZeRO tutorial config for Megatron GPT-2 (ds_zero_stage_2.config): "
         "bucket sizes, Adam with max_grad_norm, fp16 with a dynamic loss scale (loss_scale 0, initial_scale_power, "
         "loss_scale_window, hysteresis, min_loss_scale), WarmupDecayLR", run=4,
         optimizer=dict(lr=1.5e-4, min_lr=0.0, warmup=100, weight_decay=0.0, clip=1.0, betas=[0.9, 0.95], eps=1e-8,
                        decay="linear", initial_loss_scale=2.0**16, loss_scale_window=1000)),
    Case("ds_zero2_fp16_static.json", D, 2, "DeepSpeed's config-json docs' fp16 block with a static loss_scale 128, ZeRO-2 "
         "with round_robin_gradients, no scheduler (the demo's schedule runs)", run=2,
         optimizer=dict(lr=2e-4, weight_decay=0.01, clip=0.5, betas=[0.9, 0.999], eps=1e-6,
                        initial_loss_scale=2.0**7, loss_scale_window=1000)),  # the static 128 is refused; the
    #                   dynamic scale minidist runs starts at initial_scale_power 7, the same 128
    Case("ds_zero2_cpu_offload_legacy.json", D, 2, "DeepSpeed's 2020 ZeRO-Offload tutorial: the old \"cpu_offload\": true "
         "spelling, zero_allow_untested_optimizer", run=2,
         optimizer=dict(lr=1.5e-4, weight_decay=0.01, clip=1.0, betas=[0.9, 0.95], eps=1e-8, loss_scale_window=1000)),
    Case("ds_zero3_bf16_offload_none.json", D, 4, "DeepSpeed-Chat's get_train_ds_config (ZeRO-3, offload \"device\": "
         "\"none\", stage3 knobs, hybrid_engine, tensorboard) with bf16 and DeepSpeed's WarmupCosineLR", run=4,
         optimizer=dict(lr=1e-4, min_lr=0.1 * 1e-4, warmup=50, weight_decay=0.0, clip=1.0, betas=[0.9, 0.95], eps=1e-8,
                        decay="cosine")),
    Case("ds_zero3_offload_cpu.json", D, 2, "DeepSpeed's ZeRO-3 Offload tutorial: offload_optimizer and offload_param to "
         "cpu, DeepSpeedCPUAdam's torch_adam and adam_w_mode, bf16", run=2,
         optimizer=dict(lr=1e-4, weight_decay=3e-7, clip=1.0, betas=[0.9, 0.999], eps=1e-8),
         bugs={}),
    Case("ds_zero3_infinity_nvme.json", D, 2, "DeepSpeed's ZeRO-Infinity tutorial: offload to NVMe with an aio block, "
         "fp16 with hysteresis 1, WarmupDecayLR", run=2,
         optimizer=dict(lr=3e-5, min_lr=0.0, warmup=500, weight_decay=0.01, clip=1.0, betas=[0.9, 0.999], eps=1e-8,
                        decay="linear", initial_loss_scale=2.0**12, loss_scale_window=1000)),
    Case("ds_pipeline_pp2.json", D, 4, "DeepSpeedExamples training/pipeline_parallelism/ds_config.json (the stages are "
         "PipelineModule(num_stages=2) in code) with ZeRO-1 and a pipeline block", pp=2, run=4, flags=("--pp", "2"),
         optimizer=dict(lr=1e-3, weight_decay=0.0, clip=0.0, betas=[0.9, 0.999], eps=1e-8)),
    Case("ds_pipeline_zero2.json", D, 4, "a pipeline config asking ZeRO-2 (DeepSpeed refuses it too: ZeRO-2/3 do not "
         "combine with pipeline parallelism)", pp=2, run=4, flags=("--pp", "2"),
         fails="deepspeed config {path}: layout dp2-pp2-zero2-m8-bf16: --zero 2 with --pp 2: stages 2-3 shard the "
               "gradients, which a pipeline keeps across its micro-batches (sharding them would repeat the dp traffic per "
               "micro-batch; DeepSpeed refuses this too): use --zero 1"),
    Case("ds_bing_bert_lamb.json", D, 2, "DeepSpeedExamples bing_bert deepspeed_bsz64k_lamb_config_seq128.json (Lamb, "
         "fp16), its batch shrunk", run=2,
         optimizer=dict(lr=11e-3, weight_decay=0.01, clip=1.0, betas=[0.9, 0.999], eps=1e-8)),
    Case("hf_ds_config_zero2.json", D, 2, "transformers' tests/deepspeed/ds_config_zero2.json and the DeepSpeed page of its "
         "docs: every Trainer value \"auto\" (batch keys, optimizer, scheduler, fp16/bf16, reduce_bucket_size)", run=2,
         settings=HF_SETTINGS, flags=("--lr", "1e-3"),
         optimizer=dict(lr=1e-3, min_lr=1e-3, warmup=0, weight_decay=0.0, clip=1.0, betas=[0.9, 0.999], eps=1e-8,
                        decay="constant"),  # lr: the command line's, filled into "auto" as the Trainer's --learning_rate
         bugs={}),
    Case("hf_ds_config_zero3.json", D, 2, "transformers' docs ZeRO-3 template (tests/deepspeed/ds_config_zero3.json with "
         "\"auto\"): the hidden-size autos of ZeRO-3, WarmupDecayLR with total_num_steps \"auto\"", run=2,
         settings=HF_SETTINGS, flags=("--lr", "1e-3", "--precision", "bf16"),
         optimizer=dict(lr=1e-3, min_lr=0.0, warmup=0, weight_decay=0.0, clip=1.0, betas=[0.9, 0.999], eps=1e-8,
                        decay="linear", initial_loss_scale=2.0**16, loss_scale_window=1000),
         bugs={}),
    # ---------------------------------------------------------------- Megatron-LM
    Case("megatron_gpt_tp2_pp2.txt", M, 8, "Megatron-LM pretrain_gpt.py arguments (examples/gpt3), shrunk: tp 2 x pp 2 "
         "x dp 2, sequence parallel, distributed optimizer", run=8,
         optimizer=dict(lr=3e-3, min_lr=3e-4, warmup=10, weight_decay=0.1, clip=1.0, betas=[0.9, 0.95], eps=1e-8,
                        decay="cosine")),
    Case("megatron_gpt3_175b.txt", M, 1024, "Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh: tp 8 x pp 16, "
         "dp 8 as in Narayanan et al. 2021", why_not_run="tp 8 x pp 16 needs 128 ranks per replica: translated only "
         "(megatron_gpt3_175b_scaled.txt runs its optimizer on 8 ranks)"),
    Case("megatron_gpt3_175b_scaled.txt", M, 8, "megatron_gpt3_175b.txt at tp 2 x pp 2 x dp 2 (GPT-3's optimizer, "
         "--lr-warmup-fraction of --lr-decay-iters)", run=8,
         optimizer=dict(lr=6e-5, min_lr=6e-6, warmup=round(0.001 * 430000), weight_decay=0.1, clip=1.0,
                        betas=[0.9, 0.95], eps=1e-8, decay="cosine")),
    Case("megatron_llama2_7b.txt", M, 4, "Megatron-LM examples/llama/train_llama2.sh (MODEL_SIZE=7): swiglu, RMSNorm, "
         "rope, no biases (refused), tp 2 with sequence parallel and the distributed optimizer", run=4,
         optimizer=dict(lr=3e-4, min_lr=3e-5, warmup=2000, weight_decay=0.1, clip=1.0, betas=[0.9, 0.95], eps=1e-5,
                        decay="cosine")),
    Case("megatron_llama3_8b_cp2_fp8.txt", M, 4, "Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh with "
         "--context-parallel-size 2: GQA, fp8 recipe, a sample-based schedule (refused)", run=4,
         optimizer=dict(lr=1.5e-4, min_lr=1e-5, warmup=0, weight_decay=0.1, clip=1.0, betas=[0.9, 0.95], eps=1e-8,
                        decay="cosine")),
    Case("megatron_mixtral_8x7b.txt", M, 32, "Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh with the "
         "8x7B sizes: --num-experts 8, --moe-*, --expert-model-parallel-size 8, pp 4", run=8, flags=("--n-layer", "4"),
         optimizer=dict(lr=1e-4, min_lr=1e-5, warmup=500, weight_decay=0.1, clip=1.0, betas=[0.9, 0.999], eps=1e-8,
                        decay="cosine"),  # run on 8 ranks: the reader's world 8 shrinks dp 8 -> 2; pp 4 needs 4 layers
         bugs={}),
    Case("megatron_gpt_old_spelling.txt", M, 8, "Megatron-LM's 2021 examples/pretrain_gpt_distributed_with_mp.sh: "
         "--checkpoint-activations, --activations-checkpoint-method uniform, --virtual-pipeline-model-parallel-size, "
         "--DDP-impl", run=8, flags=("--n-layer", "4"),  # interleaved: pp 2 x 2 virtual stages = 4 chunks of >= 1 layer
         optimizer=dict(lr=1.5e-4, min_lr=1e-5, warmup=round(0.01 * 320000), weight_decay=0.01, clip=1.0,
                        betas=[0.9, 0.999], eps=1e-8, decay="cosine")),
    Case("megatron_gpt_selective_recompute_tp4.txt", M, 8, "Megatron-LM README's selective recomputation "
         "(--sequence-parallel --recompute-activations) on a GPT-3 13B-style line at tp 4", run=8,
         fails="megatron args: layout dp2-tp4-sp-zero1-m8-bf16-recompute_selective: --recompute selective is written "
               "for the serial attention, not the tensor-parallel one: use --recompute full with --tp"),
    # ---------------------------------------------------------------- Megatron-DeepSpeed (a line and its JSON)
    Case("megatron_deepspeed_gpt_zero1.txt", M, 8, "microsoft/Megatron-DeepSpeed examples_deepspeed/rebase/"
         "ds_pretrain_gpt_1.3B.sh: --deepspeed --deepspeed_config PATH --zero-stage 1, mp 2 x pp 2, fp16", run=8,
         optimizer=dict(lr=2e-4, min_lr=1e-6, warmup=0, weight_decay=0.1, clip=1.0, betas=[0.9, 0.95], eps=1e-8,
                        decay="cosine",
                        initial_loss_scale=2.0**11, loss_scale_window=500),  # DeepSpeed's fp16 block scales the loss
         bugs={}),
    Case("megatron_deepspeed_gpt_zero1.json", D, 8, "microsoft/Megatron-DeepSpeed examples_deepspeed/rebase/"
         "ds_config_gbs256_mbs8_log1_zero1.json (the line's JSON; tp and pp are set in code)", pp=2, tp=2, run=8,
         flags=("--pp", "2", "--tp", "2"), optimizer=dict(clip=1.0, initial_loss_scale=2.0**11, loss_scale_window=500)),
    Case("megatron_deepspeed_llama2.txt", M, 8, "microsoft/Megatron-DeepSpeed examples_deepspeed/"
         "pretrain_llama2_distributed.sh: tp 2 x pp 2, --zero-stage=0, --deepspeed_config=PATH, Llama's flags", run=8,
         optimizer=dict(lr=3e-4, min_lr=3e-5, warmup=2000, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8,
                        decay="cosine", clip=0.0),  # its JSON has no gradient_clipping: DeepSpeed does not clip
         bugs={}),
    Case("megatron_deepspeed_llama2.json", D, 8, "the inline DeepSpeed config (heredoc) of "
         "examples_deepspeed/pretrain_llama2_distributed.sh", pp=2, tp=2, run=8, flags=("--pp", "2", "--tp", "2"),
         optimizer=dict(clip=0.0)),
    Case("megatron_deepspeed_bloom_176b.txt", M, 384, "bigscience train/tr11-176B-ml/tr11-176B-ml.slurm: tp 4 x pp 12 on "
         "48 nodes x 8 GPUs, bf16 with ZeRO stage 0, ALiBi, a sample-based schedule",
         why_not_run="tp 4 x pp 12 needs 48 ranks per replica: translated only (megatron_deepspeed_bloom_scaled.txt runs)",
         bugs={}),
    Case("megatron_deepspeed_bloom_176b.json", D, 384, "the heredoc DeepSpeed config of tr11-176B-ml.slurm", pp=12, tp=4,
         model={"n_layer": 70, "n_head": 112, "n_embd": 14336, "block_size": 2048},  # BLOOM's, from the line
         why_not_run="pp 12 x tp 4 with 2048 sequences a step: translated only", bugs={}),
    Case("megatron_deepspeed_bloom_scaled.txt", M, 8, "tr11-176B-ml.slurm at tp 2 x pp 2 x dp 2 with a small model and "
         "batch (BLOOM's optimizer, bf16 + ZeRO 0, --checkpoint-activations)", run=8,
         optimizer=dict(lr=6e-5, min_lr=6e-6, warmup=0, weight_decay=0.1, clip=1.0, betas=[0.9, 0.95], eps=1e-8,
                        decay="cosine")),
    Case("megatron_deepspeed_bloom_scaled.json", D, 8, "tr11-176B-ml.slurm's heredoc with the scaled batch", pp=2, tp=2,
         run=8, flags=("--pp", "2", "--tp", "2"), optimizer=dict(clip=1.0)),
]
BY_FILE = {case.file: case for case in CORPUS}
TRANSLATED = [case for case in CORPUS if not case.fails]


@pytest.fixture(autouse=True)
def _at_the_repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # Megatron-DeepSpeed lines name their JSON relative to it


def text(case: Case) -> str:
    with open(os.path.join(ROOT, case.path)) as f:
        return f.read()


def translate(case: Case, settings=None, world=None):
    """The case's reader on the case's world size (or `world`); a DeepSpeed config gets its
    `settings` (HF's "auto") and its `model` as the demo's flags."""
    world = world or case.world
    if case.reader == "deepspeed":
        given = {**(case.model or {}), **((case.settings if settings is None else settings) or {})}
        return fw.from_deepspeed(case.path, world, pp=case.pp, tp=case.tp, settings=given or None)
    return fw.from_megatron(text(case), world)


def input_keys(case: Case) -> list[str]:
    """Every key the file gives: each dotted path to a JSON value that is not an object (a list
    is one value), or each Megatron flag as `parse_megatron` reads it."""
    if case.reader == "megatron":
        return list(fw.parse_megatron(text(case)))
    keys = []

    def walk(node, path):
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else key)
        else:
            keys.append(path)
    walk(json.loads(text(case)), "")
    return keys


def covered(key: str, keys) -> bool:
    """`key` or a block above it is among `keys` (the ledger's rule, `Translation.covers`)."""
    parts = key.split(".")
    return any(".".join(parts[:i]) in keys for i in range(1, len(parts) + 1))


def params(cases, aspect=None, run=False):
    """One parameter per case; with `run`, its tier's marks (and a skip for a translation-only case)."""
    out = []
    for case in cases:
        marks = []
        if run and case.run is None:
            marks.append(pytest.mark.skip(reason=case.why_not_run))
        elif run and case.file not in QUICK_RUNS:
            marks.append(pytest.mark.full if case.file in FULL_RUNS else pytest.mark.extended)
        if aspect and aspect in case.bugs:
            continue
        out.append(pytest.param(case, id=case.file, marks=marks))
    return out


# ----------------------------------------------------------------------------- the corpus itself


def test_the_corpus_lists_every_example_file():
    on_disk = {name for name in os.listdir(os.path.join(ROOT, EXAMPLES))
               if not name.startswith("torchtitan_")}  # the torchtitan reader's files: tests/test_frameworks_torchtitan.py
    assert on_disk == set(BY_FILE)
    assert len(CORPUS) >= 25 and len(CORPUS) == len(BY_FILE)
    assert {case.reader for case in CORPUS} == {D, M}


@pytest.mark.parametrize("case", params(CORPUS))
def test_each_file_says_what_it_is_shaped_like(case):
    assert len(case.shaped_like) > 20
    if case.reader == "megatron":
        first = text(case).splitlines()[0]
        assert first.startswith("# "), "a Megatron line file opens with a comment saying what it is shaped like"
    else:
        config = json.loads(text(case))
        assert isinstance(config, dict) and not any(key.startswith("_") for key in config), \
            "DeepSpeed has no comment key: the provenance is CORPUS's"
    if case.run is None:
        assert case.why_not_run


# ----------------------------------------------------------------------------- translation and the ledger


@pytest.mark.parametrize("case", params(CORPUS, aspect="translate"))
def test_translation_succeeds_or_fails_in_one_line(case):
    if case.fails is None:
        t = translate(case)
        assert t.layout().world_size == case.world
        return
    with pytest.raises(ValueError) as error:
        translate(case)
    assert str(error.value) == case.fails.format(path=case.path)


@pytest.mark.parametrize("case", params(TRANSLATED, aspect="translate"))
def test_every_key_is_applied_or_refused(case):
    t = translate(case)
    lost = [key for key in input_keys(case) if not t.covers(key) and f"covers:{key}" not in case.bugs]
    assert not lost, f"silently lost: {lost}"
    for key in list(t.applied) + list(t.refused):  # and the ledger names keys of this file only
        assert key.split(" ")[0].split(".")[0] in {k.split(".")[0] for k in input_keys(case)} | {
            "vocab"}, key  # "vocab size N": the reader's name for --vocab-size/--padded-vocab-size


def deepspeed_json_of(flags: dict) -> dict:
    path = flags.get("--deepspeed_config") or flags.get("--deepspeed-config")
    with open(os.path.join(ROOT, path)) as f:
        return json.load(f)


def meant(case: Case, t, key: str, value) -> dict:
    """What applied `key` (given as `value`) means in its framework, as the demo's settings
    ({dest: value}). Written from the frameworks' documentation and code, not from the readers."""
    if case.reader == "deepspeed":
        config = json.loads(text(case))
        opt_lr = config.get("optimizer", {}).get("params", {}).get("lr")
        decays = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
        rules = {  # key -> its value's meaning (DeepSpeed's config-json documentation)
            "train_batch_size": lambda v: {"batch_size": v},
            "gradient_accumulation_steps": lambda v: {"microbatches" if t.pp > 1 else "accumulation": v},
            "gradient_clipping": lambda v: {"clip": v},
            "zero_optimization.stage": lambda v: {"zero": v or None},
            "zero_optimization.reduce_bucket_size": lambda v: {"bucket_kb": math.ceil(v * 4 / 1024)},  # fp32 elements
            "fp16.enabled": lambda v: {"precision": "fp16"}, "bf16.enabled": lambda v: {"precision": "bf16"},
            "fp16.initial_scale_power": lambda v: {"initial_loss_scale": 2.0 ** v},
            "fp16.loss_scale_window": lambda v: {"loss_scale_window": v},
            "optimizer.params.lr": lambda v: {"lr": v},
            "optimizer.params.weight_decay": lambda v: {"weight_decay": v},
            "optimizer.params.eps": lambda v: {"adam_eps": v},
            "optimizer.params.betas": lambda v: {"adam_beta1": v[0], "adam_beta2": v[1]},
            "scheduler.type": lambda v: {"lr_decay": decays[v]},
            "scheduler.params.warmup_num_steps": lambda v: {"warmup": v},
            "scheduler.params.warmup_max_lr": lambda v: {"lr": v},
            "scheduler.params.cos_min_ratio": lambda v: {"min_lr": v * (opt_lr if opt_lr is not None else 1e-3)},
            "scheduler.params.total_num_steps": lambda v: {"steps": v},
        }
        if key not in rules:
            raise AssertionError(f"the corpus test has no meaning for applied {key}: add one")
        return rules[key](value)
    flags = fw.parse_megatron(text(case))
    number = float if value is not True else None
    integer = {"--num-layers": "n_layer", "--hidden-size": "n_embd", "--num-attention-heads": "n_head",
               "--seq-length": "block_size", "--max-position-embeddings": "block_size", "--global-batch-size": "batch_size",
               "--train-iters": "steps", "--lr-warmup-iters": "warmup", "--seed": "seed",
               "--loss-scale-window": "loss_scale_window"}
    real = {"--lr": "lr", "--min-lr": "min_lr", "--weight-decay": "weight_decay", "--clip-grad": "clip",
            "--adam-beta1": "adam_beta1", "--adam-beta2": "adam_beta2", "--adam-eps": "adam_eps",
            "--initial-loss-scale": "initial_loss_scale"}
    if key == "--clip-grad" and "--deepspeed" in flags:  # DeepSpeed clips, by its config's gradient_clipping
        return {"clip": float(deepspeed_json_of(flags).get("gradient_clipping", 0.0))}
    if key in integer:
        return {integer[key]: int(value)}
    if key in real and number:
        return {real[key]: float(value)}
    if key in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        axis = "tp" if key.startswith("--tensor") else "pp"
        return {axis: int(value) if int(value) > 1 else None}
    if key == "--use-distributed-optimizer":  # the optimizer states sharded over dp: ZeRO-1 (none at dp 1)
        return {"zero": max(1, int(flags.get("--zero-stage") or 0)) if t.dp > 1 else None}
    if key == "--zero-stage":
        return {"zero": int(value) or (1 if "--use-distributed-optimizer" in flags and t.dp > 1 else None)}
    if key == "--sequence-parallel":  # Megatron-LM switches it off at tp 1
        return {"sequence_parallel": t.tp > 1}
    if key in ("--fp16", "--bf16"):
        return {"precision": key[2:]}
    if key == "--lr-decay-style":
        return {"lr_decay": value}
    if key == "--lr-warmup-fraction":  # a fraction of --lr-decay-iters, else of --train-iters (Megatron-LM's scheduler)
        return {"warmup": round(float(value) * int(flags.get("--lr-decay-iters") or flags["--train-iters"]))}
    if key == "--untie-embeddings-and-output-weights":
        return {"untied": True}
    if key in ("--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank"):
        return {"schedule": "interleaved", "virtual_stages": int(value)}
    if key in ("--checkpoint-activations", "--activations-checkpoint-method", "--recompute-method",
               "--activations-checkpoint-num-layers", "--recompute-num-layers"):
        return {"recompute": "full"}  # the old switch and the methods: every layer recomputed whole
    if key == "--recompute-activations":
        return {"recompute": "selective"}
    if key == "--recompute-granularity":
        return {"recompute": value}
    raise AssertionError(f"the corpus test has no meaning for applied {key}: add one")


def check_setting(case: Case, t, key: str) -> None:
    entry = t.applied[key]
    settings = t.demo_settings()
    for dest, expected in meant(case, t, key, entry["value"]).items():
        assert dest in settings, f"{key} -> --{dest} is not among the demo's settings"
        got = settings[dest]
        if isinstance(expected, float):
            assert got == pytest.approx(expected, rel=1e-12), f"{key}={entry['value']!r} -> {dest}={got!r}"
        else:
            assert got == expected, f"{key}={entry['value']!r} -> {dest}={got!r}, expected {expected!r}"


@pytest.mark.parametrize("case", params(TRANSLATED, aspect="translate"))
def test_applied_values_reach_the_demo(case):
    t = translate(case)
    checked = 0
    for key, entry in t.applied.items():
        if entry["flag"] is None or f"setting:{key}" in case.bugs:
            continue
        check_setting(case, t, key)
        checked += 1
    assert checked >= 3  # every file decides a few of the run's settings


# ----------------------------------------------------------------------------- Hugging Face's "auto"


def hf_trainer_fills(world: int, s: dict) -> dict:
    """What transformers' Trainer writes where a DeepSpeed config says "auto"
    (integrations/deepspeed.py: HfTrainerDeepSpeedConfig.trainer_config_process, then
    trainer_config_finalize), from TrainingArguments `s` (absent: the Trainer's defaults)."""
    accumulation = s.get("accumulation", 1)                     # args.gradient_accumulation_steps
    micro = s["batch_size"] // (world * accumulation)           # args.per_device_train_batch_size
    hidden = s["n_embd"]                                        # model.config.hidden_size
    lr = s.get("lr", 5e-5)                                      # args.learning_rate
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": world * micro * accumulation,       # "train_batch_size (calculated)"
        "gradient_clipping": s.get("clip", 1.0),                # args.max_grad_norm
        "optimizer.params.lr": lr,
        "optimizer.params.betas": [s.get("adam_beta1", 0.9), s.get("adam_beta2", 0.999)],
        "optimizer.params.eps": s.get("adam_eps", 1e-8),        # args.adam_epsilon
        "optimizer.params.weight_decay": s.get("weight_decay", 0.0),
        "scheduler.params.warmup_min_lr": 0,                    # "not a trainer arg"
        "scheduler.params.warmup_max_lr": lr,
        "scheduler.params.warmup_num_steps": s.get("warmup", 0),  # args.get_warmup_steps(): warmup_steps, default 0
        "scheduler.params.total_num_steps": s["steps"],         # num_training_steps
        "fp16.enabled": s.get("precision") == "fp16",           # args.fp16 (default False), amp backend
        "bf16.enabled": s.get("precision") == "bf16",           # args.bf16 (default False)
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        # 0.9 x hidden^2: transformers writes the float, accelerate (PR #2814) int() of it, since DeepSpeed's
        # pydantic config refuses a fraction; with hidden 40 both are 1440
        "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden * hidden,
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
    }


HF_TEMPLATES = [case for case in CORPUS if case.settings is not None]
TRAINER_ARGS = {
    "the brief's": HF_SETTINGS,
    "every argument": {"batch_size": 32, "accumulation": 2, "lr": 5e-5, "warmup": 10, "weight_decay": 0.01, "clip": 0.5,
                       "adam_beta1": 0.85, "adam_beta2": 0.98, "adam_eps": 1e-6, "precision": "bf16", "n_embd": 40,
                       "steps": 100},
}


def auto_paths(case: Case) -> list[str]:
    return [key for key in input_keys(case) if _value_at(json.loads(text(case)), key) == "auto"]


def _value_at(config: dict, path: str):
    for part in path.split("."):
        config = config[part]
    return config


def check_auto(case: Case, settings: dict, path: str) -> None:
    _, filled = resolve_auto(json.loads(text(case)), case.world, settings)
    expected = hf_trainer_fills(case.world, settings)
    assert path in expected, f"{path}: the Trainer does not fill it"
    assert path in filled, f"{path} stays 'auto'; the Trainer writes {expected[path]!r}"
    assert filled[path] == pytest.approx(expected[path], rel=1e-12), path


@pytest.mark.parametrize("settings", list(TRAINER_ARGS.values()), ids=list(TRAINER_ARGS))
@pytest.mark.parametrize("case", params(HF_TEMPLATES))
def test_auto_is_filled_as_the_hugging_face_trainer_fills_it(case, settings):
    paths = auto_paths(case)
    assert len(paths) >= 12  # the batch keys, the optimizer's, the scheduler's, fp16/bf16, the bucket sizes
    for path in paths:
        if f"auto:{path}" in case.bugs and "precision" not in settings:
            continue
        check_auto(case, settings, path)
    t = translate(case, settings=settings)  # and the translation runs with what was filled
    fills = hf_trainer_fills(case.world, settings)
    assert (t.batch_size, t.micro_batch_size, t.accumulation) == (
        fills["train_batch_size"], fills["train_micro_batch_size_per_gpu"], fills["gradient_accumulation_steps"])
    assert (t.lr, t.weight_decay, t.eps, t.clip, t.warmup) == (
        fills["optimizer.params.lr"], fills["optimizer.params.weight_decay"], fills["optimizer.params.eps"],
        fills["gradient_clipping"], fills["scheduler.params.warmup_num_steps"])
    assert list(t.betas) == fills["optimizer.params.betas"]
    left_auto = {key for key, why in t.refused.items() if "'auto'" in why}  # what stayed "auto" is refused, and
    if "precision" in settings:                                            # only what the Trainer could not fill
        assert not left_auto and t.precision == settings["precision"]
    else:
        assert left_auto <= {path for path in paths if f"auto:{path}" in case.bugs} | {"fp16", "bf16"}


# ----------------------------------------------------------------------------- the runs, scaled down

RUNS: dict = {}


@dataclass
class Run:
    returncode: int
    stderr: str
    report: dict | None
    seconds: float


def config_flags(case: Case) -> list[str]:
    return ["--deepspeed-config", case.path] if case.reader == "deepspeed" else ["--megatron-args", text(case)]


def run_demo(case: Case, directory, extra=None) -> Run:
    """`python -m minidist.demo` on the case's config, small, under mpiexec (cached: several
    tests read one run)."""
    flags = list(case.flags if extra is None else extra)
    key = (case.file, tuple(flags))
    if key not in RUNS:
        out = os.path.join(str(directory), case.file + ".run.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        cmd = [find_mpiexec(), "-n", str(case.run), sys.executable, "-m", "minidist.demo", *config_flags(case),
               *SMALL, *flags, "--json", out]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        report = None
        if proc.returncode == 0:
            with open(out) as f:
                report = json.load(f)
        RUNS[key] = Run(proc.returncode, proc.stderr, report, time.perf_counter() - start)
    return RUNS[key]


@pytest.fixture(scope="module")
def run_directory(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus-runs")


DEMO_DEFAULTS = dict(lr=3e-3, warmup=0, weight_decay=0.1, clip=1.0, betas=[0.9, 0.95], eps=1e-8, decay="cosine")
#                   the demo's own choices where a config leaves them to the code (warmup: min(10, steps // 10))


def expected_optimizer(case: Case) -> dict:
    """What the run's optimizer must be: the config's values, the demo's where it gives none
    (min_lr: lr / 10), steps the command line's."""
    expected = {**DEMO_DEFAULTS, **case.optimizer, "steps": STEPS}
    expected.setdefault("min_lr", expected["lr"] / 10)
    return expected


def check_run_field(case: Case, run: Run, name: str) -> None:
    got, want = run.report["optimizer"][name], expected_optimizer(case)[name]
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-12), f"optimizer {name}: {got!r}, the config asks {want!r}"
    else:
        assert got == want, f"optimizer {name}: {got!r}, the config asks {want!r}"


@pytest.mark.parametrize("case", params(CORPUS, run=True))
def test_scaled_down_run(case, run_directory):
    run = run_demo(case, run_directory)
    if case.fails is not None:  # the demo refuses it as the reader does: one line, exit 2, before any work
        flag = "--deepspeed-config" if case.reader == "deepspeed" else "--megatron-args"
        assert run.returncode == 2
        assert run.stderr.strip() == f"error: {flag}: " + case.fails.format(path=case.path)
        return
    assert run.returncode == 0, run.stderr[-2000:]
    report = run.report
    assert report["world_size"] == case.run
    t = translate(case, world=case.run)  # the layout the reader gives on the run's ranks is the one that ran
    assert {axis: report["layout"][axis] for axis in ("dp", "tp", "pp", "zero")} == {
        "dp": t.dp, "tp": t.tp, "pp": t.pp, "zero": t.zero}
    optimizer = expected_optimizer(case)
    for name in ("lr", "min_lr", "warmup", "steps", "weight_decay", "clip", "betas", "eps", "decay",
                 "initial_loss_scale", "loss_scale_window"):
        if name in optimizer and f"run:{name}" not in case.bugs:
            check_run_field(case, run, name)
    ledger = report["framework_config"]
    assert ledger["source"] == ("DeepSpeed" if case.reader == "deepspeed" else "Megatron-LM")
    keys = set(ledger["applied"]) | set(ledger["refused"])
    lost = [key for key in input_keys(case) if not covered(key, keys) and f"covers:{key}" not in case.bugs]
    assert not lost, f"the run's framework_config loses {lost}"
    given = dict(zip(*[iter(SMALL + list(case.flags))] * 2))  # the command line's flags win over the config's
    given = {flag[2:].replace("-", "_"): value for flag, value in given.items()}
    for key, entry in ledger["applied"].items():
        if entry["flag"] in given:
            assert entry["overridden"] and same(entry["used"], given[entry["flag"]]), (key, entry)
        elif entry["flag"] is not None:
            assert not entry["overridden"], (key, entry)


def same(used, text: str) -> bool:
    try:
        return float(used) == float(text)
    except (TypeError, ValueError):
        return str(used) == text


# ----------------------------------------------------------------------------- the readers' known bugs


def check_aspect(case: Case, aspect: str, run_directory) -> None:
    """The right behaviour of one `bugs` aspect of `case` (it fails while the reader is wrong)."""
    kind, _, what = aspect.partition(":")
    if kind == "translate":  # a DeepSpeed config carries no model: its `model` (the demo's flags) gives it
        assert translate(case).layout().world_size == case.world
    elif kind == "covers":
        assert translate(case).covers(what)
    elif kind == "setting":
        check_setting(case, translate(case), what)
    elif kind == "auto":
        check_auto(case, case.settings, what)
    elif kind == "run":
        run = run_demo(case, run_directory)
        assert run.returncode == 0, run.stderr[-2000:]
        check_run_field(case, run, what)
    elif kind == "run-without-lr":  # the demo's lr (or the Trainer's) fills "auto", as --batch-size fills the batch
        run = run_demo(case, run_directory, extra=[f for f in case.flags if f not in ("--lr", "1e-3")])
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.report["optimizer"]["lr"] == 5e-5  # the Trainer's default learning_rate
    else:
        raise AssertionError(f"unknown aspect {aspect}")



@pytest.mark.full
@pytest.mark.parametrize("case", [c for c in CORPUS if c.file.startswith("hf_")], ids=lambda c: c.file)
def test_a_template_runs_without_the_learning_rate_given(case, run_directory):
    """Its "auto" learning rate takes the Trainer's default, 5e-5, as Hugging Face's Trainer would."""
    check_aspect(case, "run-without-lr", run_directory)


# ----------------------------------------------------------------------------- the appendix's table

APPENDIX = os.path.join(ROOT, "chapters", "appendix_framework_keys.md")
TORCHTITAN = [("torchtitan_llama3_8b.toml", 64), ("torchtitan_llama3_70b.toml", 64), ("torchtitan_hsdp_tp.toml", 8)]
APPENDIX_HEAD = """# Appendix: every key of the corpus, applied or refused

Chapter 9's readers (`minidist/frameworks/`) account for every key of a config: applied (its
value reaches the run through the demo's flag named here) or refused with the reason. This table
lists every key that appears in the corpus of real-shaped configurations in
`examples/frameworks/`, with what minidist does with it and in how many files. It is generated
from the readers themselves (`python tests/test_frameworks_corpus.py --write-appendix`), and a
test fails when it differs from what they do, so it cannot go stale.
"""


def treatment(t, key: str) -> str:
    """What translation `t` does with `key`: through the key itself or a block above it."""
    parts = key.split(".")
    owner = next((".".join(parts[:i]) for i in range(len(parts), 0, -1)
                  if ".".join(parts[:i]) in t.applied or ".".join(parts[:i]) in t.refused), key)
    if owner in t.applied:
        flag = t.applied[owner]["flag"]
        return (f"applied: --{flag.replace('_', '-')}" if flag else
                "applied, no flag of its own (it sets the batch split, or it is what minidist does anyway)")
    reason = t.refused[owner]  # without the value it was given, where the reason starts with it
    return "refused: " + (reason.split(": ", 1)[1] if (reason[:1].isdigit() or reason.startswith('"')) and ": "
                          in reason else reason)


def key_table() -> str:
    """The appendix: per reader, each key -> applied (and the demo flag) or refused (and why)."""
    read = [(case.reader, case.file, translate(case), input_keys(case)) for case in TRANSLATED]
    for name, world in TORCHTITAN:  # torchtitan's examples, with the model minidist runs them as
        path = f"{EXAMPLES}/{name}"
        t = fw.from_torchtitan(path, world, settings={"n_layer": 2, "n_embd": 64, "n_head": 8, "block_size": 16})
        read.append(("torchtitan", name, t, list(fw.torchtitan.keys.Keys(fw.torchtitan.keys.read_toml(path), name).flat)))
    seen: dict[str, dict[str, dict[str, set]]] = {}
    for reader, file, t, keys in read:
        for key in keys:
            seen.setdefault(reader, {}).setdefault(key, {}).setdefault(treatment(t, key), set()).add(file)
    lines = [APPENDIX_HEAD]
    for reader, title in (("deepspeed", "DeepSpeed JSON"), ("megatron", "Megatron-LM (and Megatron-DeepSpeed) flags"),
                          ("torchtitan", "torchtitan TOML")):
        lines += [f"\n## {title}\n", "| key | what minidist does | files |", "|---|---|---|"]
        for key in sorted(seen.get(reader, {})):
            for what, files in sorted(seen[reader][key].items()):
                lines.append(f"| `{key}` | {what.replace('|', '/')} | {len(files)} |")
    return "\n".join(lines) + "\n"


def test_the_appendix_lists_every_key_as_the_readers_treat_it():
    with open(APPENDIX, encoding="utf-8") as f:
        assert f.read() == key_table(), "regenerate: python tests/test_frameworks_corpus.py --write-appendix"


if __name__ == "__main__":
    if "--write-appendix" in sys.argv:
        os.chdir(ROOT)
        with open(APPENDIX, "w", encoding="utf-8") as f:
            f.write(key_table())
        print(f"wrote {APPENDIX}")
