"""The trade-offs Narayanan et al. 2021 measured: the planner's test data for *choosing*, not speed.

`published.py` holds runs with the speed each reached; a planner can predict every one of them
within a few percent and still choose badly, if its landscape is flat where the real one is not.
Section 5 of Narayanan et al. ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC21, arXiv:2104.04473) measured exactly that landscape: one model on a fixed
number of A100s, one knob turned (tensor against pipeline size, pipeline against data size, micro-
batch size, the interleaved schedule, recomputation), and wrote down in words what the bars show.
The bars' heights are not printed, so the test data here is each sweep's settings, copied from the
authors' run script for that figure, and the paper's own sentence about what it found
(`finding`, quoted). `minidist/plan/against_sweeps.py` predicts every point and checks the planner
against the sentence. Nothing is imported from minidist: this is data.

Common to every sweep (§5 and the scripts' CONFIG.sh): Selene's DGX A100 nodes (8 x A100 80GB,
NVSwitch, 8 x 200 Gb/s HDR InfiniBand), fp16, sequence 2048, vocabulary 51,200, Megatron-LM's own
data parallelism (--DDP-impl local), full recomputation unless a point says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

NARAYANAN_2021 = ("D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti, D. Vainbrand, "
                  "P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia, \"Efficient Large-Scale "
                  "Language Model Training on GPU Clusters Using Megatron-LM\", SC21, arXiv:2104.04473")
_SCRIPTS = "github.com/NVIDIA/Megatron-LM examples/academic_paper_scripts/sc21/{} (Megatron-LM commit 6985e58)"


@dataclass(frozen=True)
class SweepPoint:
    """One bar of a figure: a layout of the sweep's model at one batch."""
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int = 1
    virtual_stages: int | None = None   # interleaved schedule: model chunks per pipeline rank
    recompute: bool = True
    n_layer: int | None = None          # where the sweep grows the model with the pipeline (Figure 11)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


@dataclass(frozen=True)
class PublishedSweep:
    name: str        # "Narayanan 2021 Figure 13"
    source: str      # the paper's section and figure, the run script
    finding: str     # the paper's sentence about the figure, quoted
    n_layer: int
    n_embd: int
    n_head: int
    points: tuple[SweepPoint, ...]


def _grid(batches, layouts, **common) -> tuple[SweepPoint, ...]:
    """Every (tp, pp, gpus) of `layouts` at every batch, batch by batch."""
    return tuple(SweepPoint(tp, pp, gpus, batch, **common) for batch in batches for tp, pp, gpus in layouts)


def _source(section: str, figure: int) -> str:
    return f"{NARAYANAN_2021}, {section} and Figure {figure}; {_SCRIPTS.format(f'run_figure_{figure}.sh')}"


# Figure 11: weak scaling of the pipeline, tp 8, three layers per stage (hidden 20480, 128 heads),
# 8 GPUs per stage, batch 8 or 128, micro-batch 1.
FIGURE_11 = PublishedSweep(
    "Narayanan 2021 Figure 11", _source("§5.3.1", 11),
    "Figure 11 shows throughput per GPU for two different batch sizes to illustrate the impact of the pipeline "
    "bubble, which behaves as (p-1)/m (§2.2.1). As expected, the higher batch size scales better since the "
    "pipeline bubble is amortized over more microbatches.",
    n_layer=3, n_embd=20480, n_head=128,
    points=tuple(SweepPoint(8, p, 8 * p, batch, n_layer=3 * p) for batch in (8, 128) for p in (1, 2, 4, 8)))

# Figure 12: GPT-3 175B on 96 GPUs, tp 8 x pp 12, batch 12 to 60; interleaved with two layers per
# virtual stage (8 layers per stage: 4 chunks) against plain 1F1B.
FIGURE_12 = PublishedSweep(
    "Narayanan 2021 Figure 12", _source("§5.3.2", 12),
    "The interleaved schedule with the scatter/gather communication optimization has higher computational "
    "performance than the non-interleaved (default) schedule. This gap closes as the batch size increases",
    n_layer=96, n_embd=12288, n_head=96,
    points=tuple(SweepPoint(8, 12, 96, batch, virtual_stages=v) for batch in (12, 24, 36, 48, 60)
                 for v in (None, 4)))

# Figure 13: a 162.2B model (32 layers, hidden 20480, 128 heads) on 64 GPUs, tp x pp = 64, batch 32 or 128.
FIGURE_13 = PublishedSweep(
    "Narayanan 2021 Figure 13", _source("§5.4.1", 13),
    "Consequently, we see peak performance when the tensor-parallel size is equal to the number of GPUs in a "
    "single node (8 with DGX A100 nodes).",
    n_layer=32, n_embd=20480, n_head=128,
    points=_grid((32, 128), [(64 // p, p, 64) for p in (2, 4, 8, 16, 32)]))

# Figure 14: a 5.9B model (32 layers, hidden 3840, 32 heads) on 64 GPUs, tp 1, pp x dp = 64.
FIGURE_14 = PublishedSweep(
    "Narayanan 2021 Figure 14", _source("§5.4.2", 14),
    "We see that for each batch size, the throughput decreases as the pipeline-parallel size increases, "
    "matching our analytical model from §3.3.",
    n_layer=32, n_embd=3840, n_head=32,
    points=_grid((32, 512), [(1, p, 64) for p in (2, 4, 8, 16, 32)]))

# Figure 15: the same 5.9B model, pp 1, tp x dp = 64, batch 32, 128 or 512.
FIGURE_15 = PublishedSweep(
    "Narayanan 2021 Figure 15", _source("§5.4.3", 15),
    "This all-to-all communication with tensor model parallelism dominates end-to-end training time, especially "
    "when communication needs to be performed across multi-GPU nodes. Additionally, as the tensor-model-parallel "
    "size increases, we perform smaller matrix multiplications on every GPU, decreasing utilization on each GPU.",
    n_layer=32, n_embd=3840, n_head=32,
    points=_grid((32, 128, 512), [(t, 1, 64) for t in (2, 4, 8, 16, 32)]))

# Figure 16: a 91B model (32 layers, hidden 15360, 128 heads), tp 8 x pp 8 on 64 GPUs, micro-batch
# 1, 2, 4 or 8 at batch 128 or 512.
FIGURE_16 = PublishedSweep(
    "Narayanan 2021 Figure 16", _source("§5.5", 16),
    "We see that the best microbatch size is 2 for this model; the optimal microbatch size is different for "
    "other models (not shown in Figure) and model-dependent.",
    n_layer=32, n_embd=15360, n_head=128,
    points=tuple(SweepPoint(8, 8, 64, batch, micro_batch=b) for batch in (128, 512) for b in (1, 2, 4, 8)))

# Figure 17: a 145B model (80 layers, hidden 12288, 96 heads), tp 8 x pp 16 on 128 GPUs, batch 1 to
# 256, with and without recomputation.
FIGURE_17 = PublishedSweep(
    "Narayanan 2021 Figure 17", _source("§5.6", 17),
    "For small batch sizes, activation recomputation leads to up to 33% lower throughput (in sequences per "
    "second) due to the extra forward pass that needs to be executed during the backward pass. However, "
    "activation recomputation is needed to support larger batch sizes. Throughput at large batch sizes with "
    "activation recomputation is up to 2× higher than the best throughput achieved without activation "
    "recomputation (for a smaller batch size) due to a smaller pipeline bubble.",
    n_layer=80, n_embd=12288, n_head=96,
    points=tuple(SweepPoint(8, 16, 128, 2 ** k, recompute=r) for k in range(9) for r in (True, False)))

SWEEPS: tuple[PublishedSweep, ...] = (FIGURE_11, FIGURE_12, FIGURE_13, FIGURE_14, FIGURE_15, FIGURE_16, FIGURE_17)
