"""Published large-scale training runs whose parallel layout is stated: the planner's test data.

The planner (`python -m minidist.plan`) predicts, from formulas, which data/tensor/pipeline
layout is best for a model on a cluster and how fast it will run. Formulas can agree with each
other and still be wrong about the world, so the planner is checked against the outside: the
runs below were measured by other people, on real clusters, and written down with their layout
(tensor, pipeline, data and context parallel sizes), their batch, their model and the speed they
reached. A test can ask the planner to predict each of them and compare.

Every number is copied from the source cited in its record (`source`: authors, title, arXiv id,
table or section); `notes` says what the source states besides, and which fields are inferred or
could not be confirmed. A few values the sources do not print are filled in by the obvious
arithmetic and say so where they are written (Narayanan's data-parallel sizes, GPUs / (tp·pp);
the tp 8 × pp 12 split of Table 2's model-parallel size 96). Nothing is imported from minidist:
this is data. `tests/test_published.py` checks that the data is consistent with itself (the layout
multiplies out to the GPU count, the batch divides among the replicas, the parameter count
follows from the sizes, the tables' own totals add up).

How to read a record:

- `tflops_per_gpu` is the achieved throughput *as the source counts it*, and sources count
  differently. Narayanan et al. (and the Megatron-Turing NLG paper, which uses the same code)
  count the FLOPs of their equation (3), which includes the extra forward pass of activation
  recomputation; BigScience counts "hardware" FLOPs the same way (factor 4·2 instead of 3·2);
  Llama 3 and Nemotron-4 report model FLOPs (their BF16 MFU column; `reports_mfu`), and Llama 3
  trained its 8K-token stage without activation recomputation.
- `global_batch` is in sequences of `seq` tokens. Where a run ramped its batch up, it is the
  batch at which the throughput was measured.
- `micro_batch` and `virtual_stages` are None where the source does not state them.
- `state_bytes` is (params, grads, optimizer) bytes per parameter where the run's framework
  documents what it keeps (Megatron-LM's fp16 optimizer: 2 + 2 + 16, its fp32 copy of the
  gradients with the optimizer's piles); None means the ZeRO paper's 2 + 2 + 12.
- `ddp` is how the data-parallel gradients were averaged where stated: "torch" (PyTorch's DDP,
  during backward, its buckets a second copy of the gradients) or "local" (Megatron-LM's own,
  after backward); "" where the source does not say.
- `zero`: 0 none, 1 ZeRO-1 / distributed optimizer (optimizer states sharded over data-parallel
  ranks), 2 optimizer states and gradients sharded, 3 ZeRO-3 / FSDP full shard (parameters too).
- `vocab_size` is the size the source gives; the planner pads it as Megatron does.
- `device` names a preset of `minidist/plan/hardware.py`; `inter_bandwidth` replaces the preset's
  network between nodes where the source states another (BLOOM's Jean Zay: four 100 Gb/s Omni-Path
  links for eight GPUs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRun:
    name: str            # "Narayanan 2021 Table 1, 18.4B"
    source: str          # citation: authors, title, arXiv id, table/section
    device: str          # "a100-80gb", "h100-80gb-sxm" or "a100-40gb" (presets of minidist/plan/hardware.py)
    gpus: int
    gpus_per_node: int
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq: int
    global_batch: int    # sequences per optimizer step
    tp: int
    pp: int
    dp: int
    micro_batch: int | None
    zero: int            # 0 none, 1 ZeRO-1/distributed optimizer, 2 + gradients, 3 ZeRO-3/FSDP full shard
    virtual_stages: int | None    # interleaved schedule: model chunks per pipeline rank, when stated
    sequence_parallel: bool
    context_parallel: int         # 1 unless stated
    recompute: str       # "full", "selective" (the attention core only), "none" or "unknown"
    precision: str       # "mixed" (fp16/bf16 mixed precision)
    tflops_per_gpu: float         # achieved, as the source reports it
    parameters: float | None      # as the source states it (e.g. 1.7e9)
    notes: str = ""
    state_bytes: tuple | None = None  # (params, grads, optimizer) bytes per parameter, where documented
    ddp: str = ""                     # "torch", "local" or "" (not stated)
    inter_bandwidth: float | None = None  # bytes/s per GPU between nodes, where the source states a network
                                          # unlike the device preset's (None: the preset's)
    framework: str = ""  # "megatron-lm" where the run's code is Megatron-LM: the planner's search then
                         # keeps to the layouts Megatron-LM runs (frameworks.megatron.why_megatron_refuses)
    n_kv_head: int = 0       # key/value heads of grouped-query attention (0: n_head, plain multi-head)
    ffn_hidden: int = 0      # the MLP's width (0: GPT's 4·n_embd)
    gated_mlp: bool = False  # SwiGLU: gate, up and down matrices instead of GPT's two
    tie_embeddings: bool = True   # the output layer shares the input embedding's matrix (GPT-2, Megatron's default)
    reports_mfu: bool = False     # the source reports MFU (model FLOPs, no recomputation, over the dense
                                  # peak); tflops_per_gpu is then MFU x the device preset's peak
    dropout: bool = True          # the blocks drop out, as GPT-3's and Megatron-LM's defaults (0.1); False where
                                  # the source or the released model code has none
    ends_as_layers: bool = False  # the pipeline's first and last stages hold fewer blocks, the embedding and the
                                  # head counting a layer each, where the source states it


# ----------------------------------------------------------------------------- Narayanan et al. 2021

NARAYANAN_2021 = ("D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti, D. Vainbrand, "
                  "P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia, \"Efficient Large-Scale "
                  "Language Model Training on GPU Clusters Using Megatron-LM\", SC21, arXiv:2104.04473")

_T1_SCRIPT = ("the authors' run script for Table 1, github.com/NVIDIA/Megatron-LM "
              "examples/academic_paper_scripts/sc21/run_table_1.sh with CONFIG.sh (Megatron-LM commit 6985e58)")
# Megatron-LM's fp16 optimizer without the distributed optimizer: 20 bytes per parameter, fp16
# parameters and gradients (2 + 2) and, for the step, fp32 main parameters, Adam's two moments and
# an fp32 copy of the gradients (16): Megatron Core developer guide, "Distributed Optimizer".
MEGATRON_FP16_STATE_BYTES = (2, 2, 16)

_T1_NOTES = ("Selene, DGX A100 nodes (8 x A100 80GB, NVLink/NVSwitch, 8 x 200 Gb/s HDR InfiniBand). fp16 "
             "(--fp16) with full recomputation (--activations-checkpoint-method uniform); micro-batch size, "
             "chunks per device of the interleaved schedule (--num-layers-per-virtual-pipeline-stage) and the "
             "data-parallel implementation (--DDP-impl torch up to 18.4B, local above) from " + _T1_SCRIPT + ". "
             "Throughput is end to end (data loading, optimizer, communication, logging). FLOPs from the "
             "paper's eq. (3), which assumes activation recomputation.")


def _table_1(params_b, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, micro_batch, chunks, ddp):
    return PublishedRun(
        name=f"Narayanan 2021 Table 1, {params_b}B", source=f"{NARAYANAN_2021}, Table 1 and §5.1; {_T1_SCRIPT}",
        device="a100-80gb", gpus=gpus, gpus_per_node=8,
        n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=51200, seq=2048,
        global_batch=batch, tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, zero=0,
        virtual_stages=chunks, sequence_parallel=False, context_parallel=1, recompute="full", precision="mixed",
        tflops_per_gpu=float(tflops), parameters=params_b * 1e9, notes=_T1_NOTES,
        state_bytes=MEGATRON_FP16_STATE_BYTES, ddp=ddp, framework="megatron-lm")


# Table 1: weak scaling, 1.7B to 1T parameters. Columns as in the paper: parameters (billion),
# attention heads, hidden size, layers, tensor-parallel size, pipeline-parallel size, then the
# data-parallel size (not printed in the table: GPUs / (tp * pp)), then GPUs, batch size and
# achieved teraFLOP/s per GPU. Vocabulary 51,200, sequence 2048 (§5.1). The last three from the
# authors' run script: micro-batch size, model chunks per pipeline rank (its layers per stage over
# --num-layers-per-virtual-pipeline-stage; None: plain 1F1B) and --DDP-impl.
NARAYANAN_TABLE_1: tuple[PublishedRun, ...] = (
    _table_1(1.7, 24, 2304, 24, 1, 1, 32, 32, 512, 137, 16, None, "torch"),
    _table_1(3.6, 32, 3072, 30, 2, 1, 32, 64, 512, 138, 16, None, "torch"),
    _table_1(7.5, 32, 4096, 36, 4, 1, 32, 128, 512, 142, 16, None, "torch"),
    _table_1(18.4, 48, 6144, 40, 8, 1, 32, 256, 1024, 135, 8, None, "torch"),
    _table_1(39.1, 64, 8192, 48, 8, 2, 32, 512, 1536, 138, 4, None, "local"),
    _table_1(76.1, 80, 10240, 60, 8, 4, 32, 1024, 1792, 140, 2, 3, "local"),
    _table_1(145.6, 96, 12288, 80, 8, 8, 24, 1536, 2304, 148, 2, 2, "local"),
    _table_1(310.1, 128, 16384, 96, 8, 16, 15, 1920, 2160, 155, 1, 2, "local"),
    _table_1(529.6, 128, 20480, 105, 8, 35, 9, 2520, 2520, 163, 1, 3, "local"),
    _table_1(1008.0, 160, 25600, 128, 8, 64, 6, 3072, 3072, 163, 1, None, "local"),
)

# Table 1's last two columns, keyed by run name: percentage of the A100's 312 teraFLOP/s 16-bit
# peak, and achieved aggregate petaFLOP/s over all GPUs.
NARAYANAN_TABLE_1_PERCENT_OF_PEAK: dict[str, int] = {
    "Narayanan 2021 Table 1, 1.7B": 44,
    "Narayanan 2021 Table 1, 3.6B": 44,
    "Narayanan 2021 Table 1, 7.5B": 46,
    "Narayanan 2021 Table 1, 18.4B": 43,
    "Narayanan 2021 Table 1, 39.1B": 44,
    "Narayanan 2021 Table 1, 76.1B": 45,
    "Narayanan 2021 Table 1, 145.6B": 47,
    "Narayanan 2021 Table 1, 310.1B": 50,
    "Narayanan 2021 Table 1, 529.6B": 52,
    "Narayanan 2021 Table 1, 1008.0B": 52,
}
NARAYANAN_TABLE_1_AGGREGATE_PFLOPS: dict[str, float] = {
    "Narayanan 2021 Table 1, 1.7B": 4.4,
    "Narayanan 2021 Table 1, 3.6B": 8.8,
    "Narayanan 2021 Table 1, 7.5B": 18.2,
    "Narayanan 2021 Table 1, 18.4B": 34.6,
    "Narayanan 2021 Table 1, 39.1B": 70.8,
    "Narayanan 2021 Table 1, 76.1B": 143.8,
    "Narayanan 2021 Table 1, 145.6B": 227.1,
    "Narayanan 2021 Table 1, 310.1B": 297.4,
    "Narayanan 2021 Table 1, 529.6B": 410.2,
    "Narayanan 2021 Table 1, 1008.0B": 502.0,
}
A100_PEAK_TFLOPS_16BIT = 312.0   # Narayanan et al. §5: "peak device throughput of an A100 GPU with 16-bit precision"

# Table 2: PTD parallelism against ZeRO-3 without model parallelism, same global batch as the GPU
# count grows. GPT-3 175B is 96 layers, hidden 12288, 96 heads (§5.3.2; 174.6B with V=51,200);
# the 530B model is Table 1's 529.6B row (105 layers, hidden 20480, 128 heads).
_T2_COMMON = ("Same cluster and code as Table 1 (A100 80GB, fp16 mixed precision, FLOPs from eq. (3), which assumes "
              "activation recomputation). ZeRO from the DeepSpeed library, integrated into Megatron-LM (§5.2).")
_GPT3 = {"n_layer": 96, "n_embd": 12288, "n_head": 96, "parameters": 174.6e9}
_MT530 = {"n_layer": 105, "n_embd": 20480, "n_head": 128, "parameters": 529.6e9}


def _table_2(model, scheme, gpus, batch, micro_batch, tflops, tp, pp, dp, notes=""):
    size = "175B" if model is _GPT3 else "530B"
    zero3 = scheme == "ZeRO-3"
    return PublishedRun(
        name=f"Narayanan 2021 Table 2, {size} {scheme}, {gpus} GPUs", source=f"{NARAYANAN_2021}, Table 2 and §5.2",
        device="a100-80gb", gpus=gpus, gpus_per_node=8, vocab_size=51200, seq=2048,
        global_batch=batch, tp=tp, pp=pp, dp=dp, micro_batch=micro_batch, zero=3 if zero3 else 0,
        virtual_stages=None, sequence_parallel=False, context_parallel=1, recompute="full", precision="mixed",
        tflops_per_gpu=float(tflops), notes=f"{_T2_COMMON} {notes}".strip(),
        # ZeRO-3's model states: DeepSpeed's 2 + 2 + 12 bytes per parameter (state_bytes None)
        state_bytes=None if zero3 else MEGATRON_FP16_STATE_BYTES, framework="megatron-lm", **model)


_PTDP_175 = ("Table 2 states only the model-parallel size, 96; the split tp 8 x pp 12 is inferred from the "
             "paper's rule that tensor parallelism fills one 8-GPU node (§5.4.1) and pipelining covers the rest.")
_PTDP_530 = "Model-parallel size 280 = tp 8 x pp 35, the split Table 1 states for the same 529.6B model."

NARAYANAN_TABLE_2: tuple[PublishedRun, ...] = (
    # model, scheme, GPUs, batch, microbatch, teraFLOP/s per GPU, tp, pp, dp (ZeRO-3: dp = GPUs)
    _table_2(_GPT3, "ZeRO-3", 384, 1536, 4, 144, 1, 1, 384),
    _table_2(_GPT3, "ZeRO-3", 768, 1536, 2, 88, 1, 1, 768),
    _table_2(_GPT3, "ZeRO-3", 1536, 1536, 1, 44, 1, 1, 1536),
    _table_2(_MT530, "ZeRO-3", 640, 2560, 4, 138, 1, 1, 640,
             notes="Marked * in Table 2: did not fit on 560 GPUs at microbatch 4, so run on 640 GPUs with "
                   "global batch 2560 to give a throughput estimate."),
    _table_2(_MT530, "ZeRO-3", 1120, 2240, 2, 98, 1, 1, 1120),
    _table_2(_MT530, "ZeRO-3", 2240, 2240, 1, 48, 1, 1, 2240),
    _table_2(_GPT3, "PTD-P", 384, 1536, 1, 153, 8, 12, 4, notes=_PTDP_175),
    _table_2(_GPT3, "PTD-P", 768, 1536, 1, 149, 8, 12, 8, notes=_PTDP_175),
    _table_2(_GPT3, "PTD-P", 1536, 1536, 1, 141, 8, 12, 16, notes=_PTDP_175),
    _table_2(_MT530, "PTD-P", 560, 2240, 1, 171, 8, 35, 2, notes=_PTDP_530),
    _table_2(_MT530, "PTD-P", 1120, 2240, 1, 167, 8, 35, 4, notes=_PTDP_530),
    _table_2(_MT530, "PTD-P", 2240, 2240, 1, 159, 8, 35, 8, notes=_PTDP_530),
)

# Table 2's other columns, keyed by run name: the model-parallel size as printed (1 for ZeRO-3),
# and the estimated training time for 300B tokens in days.
NARAYANAN_TABLE_2_MODEL_PARALLEL: dict[str, int] = {
    "Narayanan 2021 Table 2, 175B ZeRO-3, 384 GPUs": 1,
    "Narayanan 2021 Table 2, 175B ZeRO-3, 768 GPUs": 1,
    "Narayanan 2021 Table 2, 175B ZeRO-3, 1536 GPUs": 1,
    "Narayanan 2021 Table 2, 530B ZeRO-3, 640 GPUs": 1,
    "Narayanan 2021 Table 2, 530B ZeRO-3, 1120 GPUs": 1,
    "Narayanan 2021 Table 2, 530B ZeRO-3, 2240 GPUs": 1,
    "Narayanan 2021 Table 2, 175B PTD-P, 384 GPUs": 96,
    "Narayanan 2021 Table 2, 175B PTD-P, 768 GPUs": 96,
    "Narayanan 2021 Table 2, 175B PTD-P, 1536 GPUs": 96,
    "Narayanan 2021 Table 2, 530B PTD-P, 560 GPUs": 280,
    "Narayanan 2021 Table 2, 530B PTD-P, 1120 GPUs": 280,
    "Narayanan 2021 Table 2, 530B PTD-P, 2240 GPUs": 280,
}
NARAYANAN_TABLE_2_DAYS_300B_TOKENS: dict[str, int] = {
    "Narayanan 2021 Table 2, 175B ZeRO-3, 384 GPUs": 90,
    "Narayanan 2021 Table 2, 175B ZeRO-3, 768 GPUs": 74,
    "Narayanan 2021 Table 2, 175B ZeRO-3, 1536 GPUs": 74,
    "Narayanan 2021 Table 2, 530B ZeRO-3, 640 GPUs": 169,
    "Narayanan 2021 Table 2, 530B ZeRO-3, 1120 GPUs": 137,
    "Narayanan 2021 Table 2, 530B ZeRO-3, 2240 GPUs": 140,
    "Narayanan 2021 Table 2, 175B PTD-P, 384 GPUs": 84,
    "Narayanan 2021 Table 2, 175B PTD-P, 768 GPUs": 43,
    "Narayanan 2021 Table 2, 175B PTD-P, 1536 GPUs": 23,
    "Narayanan 2021 Table 2, 530B PTD-P, 560 GPUs": 156,
    "Narayanan 2021 Table 2, 530B PTD-P, 1120 GPUs": 80,
    "Narayanan 2021 Table 2, 530B PTD-P, 2240 GPUs": 42,
}

# ----------------------------------------------------------------------------- other production runs

_BLOOM_SOURCE = ("BigScience Workshop, \"BLOOM: A 176B-Parameter Open-Access Multilingual Language Model\", "
                 "arXiv:2211.05100; layout, batch and throughput from the training record, "
                 "github.com/bigscience-workshop/bigscience train/tr11-176B-ml/README.md (\"Replica setup\", "
                 "\"Important checkpoints\", \"Estimated run time\") and tr11-176B-ml.slurm")

_MTNLG_SOURCE = ("S. Smith, M. Patwary, B. Norick, P. LeGresley, S. Rajbhandari, J. Casper et al., \"Using DeepSpeed "
                 "and Megatron to Train Megatron-Turing NLG 530B, A Large-Scale Generative Language Model\", "
                 "arXiv:2201.11990, §2.2-2.4 (system, throughput) and §3.2 (model)")
_MTNLG_NOTES = ("Selene, DGX A100 nodes of 8 x A100 80GB. \"Each 530 billion parameter model replica spans 280 "
                "NVIDIA A100 GPUs, with 8-way tensor-slicing within a node and 35-way pipeline parallelism across "
                "nodes\"; data parallelism (DeepSpeed) over the replicas. Throughput measured at global batch 1920 "
                "(the training run ramped the batch from 32 to 1920). Iteration time {step} s; the TFLOP/s are "
                "Narayanan et al.'s equation (3), which counts recomputation's extra forward: 96·B·s·l·h²·(1 + "
                "s/6h + V/16lh) over the iteration time and the GPUs gives 125.7, 120.4 and 113.5 "
                "(tests/test_published.py). Vocabulary not given by the paper: MT-NLG "
                "uses the GPT-2 BPE tokenizer (50,257), which Megatron pads to 51,200 at tp 8. Not confirmed from "
                "the paper text: the ZeRO stage of its data parallelism (recorded 0; one DeepSpeed summary says "
                "ZeRO-1), whether recomputation was on (recorded unknown), bf16 vs fp16, microbatch size.")


# GPUs: seconds per iteration at global batch 1920 (Smith et al. §2.4), from which the TFLOP/s follow
MTNLG_ITERATION_SECONDS: dict[int, float] = {2240: 60.1, 2800: 50.2, 3360: 44.4}


def _mtnlg(nodes, dp, step_s, tflops):
    gpus = nodes * 8
    return PublishedRun(
        name=f"MT-NLG 530B, {nodes} DGX A100 nodes", source=_MTNLG_SOURCE,
        device="a100-80gb", gpus=gpus, gpus_per_node=8, n_layer=105, n_embd=20480, n_head=128,
        vocab_size=50257, seq=2048, global_batch=1920, tp=8, pp=35, dp=dp, micro_batch=None, zero=0,
        virtual_stages=None, sequence_parallel=False, context_parallel=1, recompute="unknown", precision="mixed",
        tflops_per_gpu=float(tflops), parameters=530e9, notes=_MTNLG_NOTES.format(step=step_s))


_LLAMA3_SOURCE = ("Llama Team, AI @ Meta, \"The Llama 3 Herd of Models\", arXiv:2407.21783 (v3), Table 4 "
                  "(scaling configurations and MFU of Llama 3 405B pre-training), §3.3 and Table 3 (model)")
_LLAMA3_MODEL = ("Llama 3 405B: 126 layers, model dimension 16,384, FFN 53,248 (SwiGLU), 128 attention heads with "
                 "8 key/value heads (GQA), vocabulary 128,000 (Table 3; the released tokenizer has 128,256), RoPE. "
                 "H100 80GB HBM3 at 700 W, 8 GPUs per server, RoCE fabric. No dropout in the blocks (the released "
                 "model code, github.com/meta-llama/llama3 llama/model.py, has none). ")
_LLAMA3_PAR = ("4D parallelism ordered [TP, CP, PP, DP]; DP is FSDP sharding optimizer states and gradients, with "
               "parameters not resharded after the forward pass (recorded zero=2). Interleaved pipeline schedule "
               "with a tunable number of stages per rank (not stated); one Transformer layer fewer on the first and "
               "on the last stage, for the embedding and the output layer (§3.3.2). Tokens per batch 16M. TFLOP/s "
               "are model FLOPs in BF16 (the paper's MFU column). ")


def _llama3(gpus, cp, dp, seq, global_batch, batch_per_dp, tflops, mfu, recompute, extra=""):
    return PublishedRun(
        name=f"Llama 3 405B, {gpus} GPUs, cp {cp}, seq {seq}", source=_LLAMA3_SOURCE,
        device="h100-80gb-sxm", gpus=gpus, gpus_per_node=8, n_layer=126, n_embd=16384, n_head=128,
        vocab_size=128000, seq=seq, global_batch=global_batch, tp=8, pp=16, dp=dp, micro_batch=None, zero=2,
        virtual_stages=None, sequence_parallel=False, context_parallel=cp, recompute=recompute, precision="mixed",
        tflops_per_gpu=float(tflops), parameters=405e9, n_kv_head=8, ffn_hidden=53248, gated_mlp=True,
        tie_embeddings=False, reports_mfu=True, dropout=False, ends_as_layers=True,
        notes=f"{_LLAMA3_MODEL}{_LLAMA3_PAR}Batch size per DP group {batch_per_dp}; BF16 MFU {mfu}%. {extra}".strip())


_NEMOTRON_SOURCE = ("NVIDIA, \"Nemotron-4 340B Technical Report\", arXiv:2406.11704, §2.1 (architecture, Table 1) "
                    "and §2.2 (training: Table 2, batch size ramp-up with iteration time and MFU)")
_NEMOTRON_NOTES = ("Nemotron-4-340B-Base: 96 layers, hidden 18,432, 96 attention heads with 8 key/value heads (GQA), "
                   "MLP 73,728 wide with squared ReLU (two matrices, no gate), no biases, untied input and output "
                   "embeddings, vocabulary 256,000, sequence 4,096, RoPE. 768 DGX H100 nodes (8 x H100 80GB SXM5, "
                   "NVLink/NVSwitch, 8 x 400 Gb/s InfiniBand per node). \"8-way tensor parallelism, 12-way pipeline "
                   "parallelism with interleaving and data parallelism\", with a distributed optimizer sharding the "
                   "optimizer state over the data-parallel replicas (recorded zero=1); chunks per rank, micro-batch "
                   "and recomputation not stated. The batch ramped up in three stages, each a row of Table 2 "
                   "(data-parallel size, GPUs, iteration time, MFU, batch); MFU is model FLOPs over 989 TFLOP/s "
                   "of BF16. The rows are consistent with themselves: the model's FLOPs (attention included) over the "
                   "iteration time give the MFU column within 0.2 points (tests/test_published.py). Iteration "
                   "time {step} s.")

# GPUs: (data-parallel size, batch, seconds per iteration, MFU %), Nemotron-4 340B report Table 2
NEMOTRON_TABLE_2: dict[int, tuple] = {1536: (16, 768, 10.3, 42.4), 3072: (32, 1536, 10.3, 42.3),
                                      6144: (64, 2304, 8.0, 41.0)}


def _nemotron_run(name, source, notes, gpus, dp, batch, mfu, **shape):
    """A row of a Nemotron-4 report's batch ramp-up: H100s, tp 8, the distributed optimizer, MFU in BF16."""
    return PublishedRun(
        name=name, source=source, device="h100-80gb-sxm", gpus=gpus, gpus_per_node=8, vocab_size=256000, seq=4096,
        global_batch=batch, tp=8, dp=dp, micro_batch=None, zero=1, virtual_stages=None, sequence_parallel=False,
        context_parallel=1, recompute="unknown", precision="mixed", tflops_per_gpu=round(mfu / 100 * 989.5, 1),
        framework="megatron-lm", n_kv_head=8, tie_embeddings=False, reports_mfu=True, notes=notes, **shape)


def _nemotron(gpus):
    dp, batch, step, mfu = NEMOTRON_TABLE_2[gpus]
    return _nemotron_run(f"Nemotron-4 340B, {gpus} GPUs", _NEMOTRON_SOURCE, _NEMOTRON_NOTES.format(step=step), gpus,
                         dp, batch, mfu, n_layer=96, n_embd=18432, n_head=96, pp=12, parameters=340e9,
                         ffn_hidden=73728)


_NEMOTRON_15B_SOURCE = ("J. Parmar et al. (NVIDIA), \"Nemotron-4 15B Technical Report\", arXiv:2402.16819, Table 1 "
                        "(architecture) and Table 2 (training: batch size ramp-up with MFU)")
_NEMOTRON_15B_NOTES = ("Nemotron-4 15B: 32 layers, hidden 6,144, 48 attention heads with 8 key/value heads (GQA), MLP "
                       "24,576 wide (4h) with squared ReLU, no biases, no dropout, untied input and output embeddings, "
                       "vocabulary 256,000, sequence 4,096, RoPE; 3.2B embedding and 12.5B non-embedding parameters. "
                       "384 DGX H100 nodes (8 x H100 80GB SXM5, NVLink/NVSwitch, 8 x 400 Gb/s InfiniBand per node). "
                       "\"8-way tensor parallelism and data parallelism\" with a distributed optimizer sharding the "
                       "optimizer state over the data-parallel replicas (recorded zero=1); micro-batch and recomputation "
                       "not stated. Three rows of its batch ramp-up (data-parallel size, GPUs, batch, MFU of 989 "
                       "TFLOP/s in BF16). Not confirmed against the report's own text: the data-parallel sizes, GPUs, batches "
                       "and MFU as a published summary of its Table 2 gives them. NVIDIA's NeMo launcher recipe for this "
                       "model (NeMo-Framework-Launcher conf/training/nemotron/nemotron_15b.yaml) runs the distributed "
                       "optimizer with overlap_grad_sync and overlap_param_sync.")

# GPUs: (data-parallel size, batch, MFU %), Nemotron-4 15B report Table 2
NEMOTRON_15B_TABLE_2: dict[int, tuple] = {768: (96, 384, 34.3), 1536: (192, 768, 33.3), 2304: (288, 1152, 30.5)}


def _nemotron_15b(gpus):
    dp, batch, mfu = NEMOTRON_15B_TABLE_2[gpus]
    return _nemotron_run(f"Nemotron-4 15B, {gpus} GPUs", _NEMOTRON_15B_SOURCE, _NEMOTRON_15B_NOTES, gpus, dp, batch,
                         mfu, n_layer=32, n_embd=6144, n_head=48, pp=1, parameters=15.7e9, ffn_hidden=24576,
                         dropout=False)


# ----------------------------------------------------------------------------- Korthikanti et al. 2022

_KORTHIKANTI_SOURCE = ("V. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, B. Catanzaro, "
                       "\"Reducing Activation Recomputation in Large Transformer Models\", MLSys 2023, "
                       "arXiv:2205.05198: Table 3 (configurations) and Table 5 (end-to-end iteration time)")
_KORTHIKANTI_NOTES = ("Selene, DGX A100 80GB nodes, Megatron-LM, mixed precision, one data-parallel replica. "
                      "{mode}. "
                      "Iteration time {seconds} s (Table 5); the TFLOP/s are the model's FLOPs, 72·B·s·L·h²·(1 + "
                      "s/(6h) + V/(12·L·h)), over that time and the GPUs, the paper's MFU column times 312 (its 175B, "
                      "530B and 1T rows print 51.4, 56.0 and 56.3 % for the present work). The paper does not print "
                      "the interleaved schedule's depth; 3 chunks for 175B and 530B, plain 1F1B for 1T, are the "
                      "settings of Calculon's reproduction of this table (Isaev et al., SC23, github.com/calculon-ai/"
                      "calculon validation/seqsel/tab5).")

# Table 5: (model, heads, hidden, layers, tp, pp, GPUs, batch, micro-batch, chunks) and the iteration
# time with full recomputation, then with sequence parallelism and selective recomputation (seconds)
KORTHIKANTI_TABLE_5: dict[str, tuple] = {
    "22B": ((64, 6144, 48, 8, 1, 8, 4, 4, None), 1.42, 1.10),
    "175B": ((96, 12288, 96, 8, 8, 64, 64, 1, 3), 18.13, 13.75),
    "530B": ((128, 20480, 105, 8, 35, 280, 280, 1, 3), 49.05, 37.83),
    "1T": ((160, 25600, 128, 8, 64, 512, 512, 1, None), 94.42, 71.49),
}


def _korthikanti(model: str, selective: bool) -> PublishedRun:
    (heads, hidden, layers, tp, pp, gpus, batch, micro, chunks), full_s, selective_s = KORTHIKANTI_TABLE_5[model]
    seconds, seq, vocab = (selective_s if selective else full_s), 2048, 51200
    model_flops = 72 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    mode = ("sequence parallelism and selective recomputation (the attention core)" if selective
            else "full recomputation, no sequence parallelism")
    return PublishedRun(
        name=f"Korthikanti 2022 Table 5, {model}, {'selective' if selective else 'full'}", source=_KORTHIKANTI_SOURCE,
        device="a100-80gb", gpus=gpus, gpus_per_node=8, n_layer=layers, n_embd=hidden, n_head=heads,
        vocab_size=vocab, seq=seq, global_batch=batch, tp=tp, pp=pp, dp=gpus // (tp * pp), micro_batch=micro, zero=0,
        virtual_stages=chunks, sequence_parallel=selective, context_parallel=1,
        recompute="selective" if selective else "full", precision="mixed",
        tflops_per_gpu=round(model_flops / (seconds * gpus) / 1e12, 1), parameters=None, reports_mfu=True,
        state_bytes=MEGATRON_FP16_STATE_BYTES, framework="megatron-lm",
        notes=_KORTHIKANTI_NOTES.format(mode=mode[0].upper() + mode[1:], seconds=seconds))


KORTHIKANTI_RUNS: tuple[PublishedRun, ...] = tuple(_korthikanti(model, selective) for model in KORTHIKANTI_TABLE_5
                                                   for selective in (False, True))


OTHER_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        name="BLOOM 176B", source=_BLOOM_SOURCE,
        device="a100-80gb", gpus=384, gpus_per_node=8, n_layer=70, n_embd=14336, n_head=112,
        vocab_size=250880, seq=2048, global_batch=2048, tp=4, pp=12, dp=8, micro_batch=2, zero=1,
        virtual_stages=None, sequence_parallel=False, context_parallel=1, recompute="full", precision="mixed",
        tflops_per_gpu=150.0, parameters=176.247e9, inter_bandwidth=4 * 100e9 / 8 / 8,
        notes="Jean Zay, 48 nodes of 8 x A100 80GB (4 NVLink, 4 x 100 Gb/s Omni-Path per node, BLOOM paper p. 18: "
              "6.25 GB/s per GPU between nodes, a quarter of the A100 preset's 25); Megatron-DeepSpeed, "
              "bf16. TP=4, PP=12, DP=8, MBS=2 (MBS=1 until the batch ramp-up reached GBS 784). ZeRO-1: DeepSpeed "
              "stage 0 with the BF16 optimizer, which \"implements its own zero stage 1\". Activation checkpointing "
              "on. Throughput in hardware TFLOPs (counting recomputation): \"~150 TFLOPs per GPU\"; the logged "
              "iteration 85376 at GBS 2048 shows 149.77 TFLOPs, 104.70 s per iteration. Tokenizer vocabulary "
              "250,680, padded to 250,880. ALiBi positions (no position embedding) and an embedding LayerNorm. "
              "176,247M parameters."),
    _mtnlg(280, 8, MTNLG_ITERATION_SECONDS[2240], 126),
    _mtnlg(350, 10, MTNLG_ITERATION_SECONDS[2800], 121),
    _mtnlg(420, 12, MTNLG_ITERATION_SECONDS[3360], 113),
    # GPUs, cp, dp, sequence, global batch (= batch size per DP group x DP), batch per DP group, TFLOP/s, MFU
    _llama3(8192, 1, 64, 8192, 2048, 32, 430, 43, "none",
            "\"Llama 3 could be pre-trained on sequences of 8K tokens without activation checkpointing\" (§3.3.2)."),
    _llama3(16384, 1, 128, 8192, 2048, 16, 400, 41, "none",
            "\"Llama 3 could be pre-trained on sequences of 8K tokens without activation checkpointing\" (§3.3.2); "
            "MFU drops from 43% because the batch per DP group halves."),
    _llama3(16384, 16, 8, 131072, 128, 16, 380, 38, "unknown",
            "Long-context stage. arXiv v3 prints DP 8 (8 x 16 x 16 x 8 = 16,384); other copies of the paper print "
            "DP 4, which does not multiply out to 16,384 GPUs. All-gather based context parallelism."),
    _nemotron(1536), _nemotron(3072), _nemotron(6144),
    _nemotron_15b(768), _nemotron_15b(1536), _nemotron_15b(2304),
)

ALL_RUNS: tuple[PublishedRun, ...] = NARAYANAN_TABLE_1 + NARAYANAN_TABLE_2 + OTHER_RUNS + KORTHIKANTI_RUNS
