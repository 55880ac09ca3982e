"""The figures of chapter 11 (future trends)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from minidist.core import moe
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.core.tensor import default_dtype
from minidist.parallel.context_parallel import ring_attention_traffic, SequenceSplit
from minidist.parallel.ulysses import ulysses_traffic
from minidist.plan import memory, recompute_cost
from minidist.plan.hardware import PRESETS as DEVICES
from minidist.plan.step_time import layer_gemms
from book_figures.common import (ALGORITHMS, DEMO, figure, GB, GPT3, INK, KIND, legend_below, log_ticks, MB,
    PILES, RANKS)


@figure(11, "## 1. What backward keeps",
        caption="Activations of all 96 layers of GPT-3 175B at micro-batch 1, Megatron-LM's count, against "
                "the sequence length: the attention weights' quadratic term dominates, selective recomputation "
                "removes exactly it, full recomputation keeps only each layer's input.",
        alt="A log-log line chart of gigabytes against sequence length from 512 to 32768 tokens, with a dashed "
            "line at 80 GB. No recomputation rises steeply, quadratically for long sequences, passing 80 GB "
            "before 1024 tokens and reaching 275 GB at 2048, marked with a dot. Selective recomputation rises "
            "linearly and stays about three times lower at 2048. Full recomputation rises linearly from about "
            "1 GB, far below.")
def ch11_activation_ledger():
    L, h, a = GPT3.n_layer, GPT3.n_embd, GPT3.n_head
    seqs = 2 ** np.arange(9, 16)
    none = np.array([L * memory.megatron_activation_bytes(1, int(s), h, a) for s in seqs])
    core = np.array([L * 5 * a * int(s) ** 2 for s in seqs])  # the softmax, its mask and output: 5as²b bytes
    full = np.array([L * 2 * int(s) * h for s in seqs])        # each layer's 16-bit input
    fig, ax = plt.subplots(figsize=(7, 3.3))
    ax.loglog(seqs, none / GB, "o-", ms=3, color=PILES["activations"], label="no recomputation: sbh(34 + 5as/h)")
    ax.loglog(seqs, (none - core) / GB, "o-", ms=3, color=KIND["backward"], label="selective: 34 sbh")
    ax.loglog(seqs, full / GB, "o-", ms=3, color=KIND["forward"], label="full: 2 sbh (one input per layer)")
    ax.axhline(DEVICES["a100-80gb"].memory / GB, color=INK, ls="--", lw=0.8)
    ax.text(seqs[0], 80 * 1.15, "80 GB", fontsize=7.5)
    at = L * memory.megatron_activation_bytes(1, 2048, h, a) / GB
    ax.plot([2048], [at], "o", color=INK)
    ax.annotate(f"{at:.0f} GB at 2048", (2048, at), xytext=(10, -4), textcoords="offset points", fontsize=8)
    log_ticks(ax.xaxis, seqs)
    log_ticks(ax.yaxis, [1, 10, 100, 1000, 10000], ["1", "10", "100", "1,000", "10,000"])
    ax.set(xlabel="sequence length s", ylabel="GB, all 96 layers",
           title="GPT-3 175B, micro-batch 1, fp16 (memory.megatron_activation_bytes)")
    ax.legend(loc="upper left")
    return fig


def _step_flops(config, batch: int) -> tuple[float, float]:
    """(forward FLOPs of the blocks, of which the attention cores), from the planner's GEMM list."""
    gemms = layer_gemms(batch, config.block_size, config.n_embd, config.n_head, 1)
    layer = sum(2 * count * m * n * k for count, m, n, k in gemms)
    core = sum(2 * count * m * n * k for count, m, n, k in gemms[1:3])  # scores and weighted values
    return config.n_layer * layer, config.n_layer * core


@figure(11, "## 2. Full recomputation: how many segments",
        caption="Full recomputation's memory against its number of segments k (left), and memory against "
                "extra compute for every setting of the demo GPT (right): one block per segment keeps the "
                "least, for about a third more compute.",
        alt="Two charts. Left, for an 8-layer GPT, megabytes against segments k from 1 to 8: kept after forward "
            "rises slowly from 0.7 to 0.9 MB; the peak falls from above the no-recomputation line at k = 1 to "
            "its lowest at k = 8, with a plateau for k from 4 to 7. Right, for the demo GPT, a scatter of peak "
            "activation megabytes against extra compute in percent: no recomputation at 0 percent and the "
            "highest memory, selective a few percent and slightly lower, full with 1, 2 and 4 segments at about "
            "32 percent with decreasing memory.")
def ch11_recompute_tradeoff():
    curve = GPTConfig(vocab_size=256, block_size=32, n_layer=8, n_head=4, n_embd=32)
    ks = np.arange(1, 9)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.3))
    full = [recompute_cost.predicted_activation_bytes(curve, 8, "full", int(k)) for k in ks]
    left.plot(ks, [f["peak"] / MB for f in full], "o-", ms=4, color=PILES["activations"],
              label="peak: kept + one rebuilt segment")
    left.plot(ks, [f["kept"] / MB for f in full], "s-", ms=4, color=KIND["forward"], label="kept after forward")
    left.axhline(recompute_cost.predicted_activation_bytes(curve, 8)["peak"] / MB, color=INK, ls="--", lw=0.8,
                 label="no recomputation")
    left.set(xlabel="segments k", ylabel="MB", title="8 blocks of width 32, batch 8", ylim=(0, None))
    left.legend(loc="center right", fontsize=7)
    batch = 16
    blocks, cores = _step_flops(DEMO, batch)
    head = 2 * batch * DEMO.block_size * DEMO.n_embd * DEMO.vocab_size
    step = 3 * (blocks + head)  # forward, and a backward of twice its FLOPs
    settings = [("none", None, 0.0), ("selective", None, cores), ("full, k = 1", 1, blocks),
                ("full, k = 2", 2, blocks), ("full, k = 4", 4, blocks)]
    for label, k, extra in settings:
        mode = label.split(",")[0]
        peak = recompute_cost.predicted_activation_bytes(DEMO, batch, mode, k)["peak"] / MB
        color = {"none": PILES["activations"], "selective": KIND["backward"], "full": KIND["forward"]}[mode]
        right.plot(100 * extra / step, peak, "o", color=color, ms=6)
        right.annotate(label, (100 * extra / step, peak), xytext=(6, -11 if mode == "selective" else 3),
                       textcoords="offset points", fontsize=7.5)
    right.set(xlabel="extra compute (% of the step's FLOPs)", ylabel="peak activations (MB)",
              title="demo GPT, batch 16", xlim=(-3, 45), ylim=(0, None))
    return fig


@figure(11, "## 5. Context parallelism, and the causal mask's uneven work",
        caption="Which rank computes which query rows of causal attention, T = 64 on 4 ranks: contiguous "
                "pieces leave rank 3 with nearly seven times rank 0's scores, the zigzag split gives every rank "
                "the same.",
        alt="Two triangular pictures of the causal mask, 64 query rows by 64 key columns, with the visible lower "
            "triangle coloured by the rank that holds each query row, and a bar chart. Contiguous: four "
            "horizontal bands from top to bottom for ranks 0 to 3, the lowest band much wider in area. Zigzag: "
            "eight bands in the order 0, 1, 2, 3, 3, 2, 1, 0, so every rank has one narrow top band and one wide "
            "bottom band. Bars of unmasked scores per rank: contiguous 136, 392, 648 and 904; zigzag 520 each.")
def ch11_causal_split():
    T, n = 64, 4
    splits = {kind: SequenceSplit(T, n, kind) for kind in ("contiguous", "zigzag")}
    fig, axes = plt.subplots(1, 3, figsize=(7, 2.9), width_ratios=[1, 1, 1.15])
    cmap = ListedColormap(RANKS[:n])
    visible = np.tril(np.ones((T, T), dtype=bool))
    for ax, (kind, split) in zip(axes, splits.items()):
        owner = np.empty(T)
        for r in range(n):
            owner[split.positions(r)] = r
        image = np.where(visible, owner[:, None], np.nan)
        ax.imshow(image, cmap=cmap, vmin=-0.5, vmax=n - 0.5, interpolation="nearest")
        ax.set(title=kind, xlabel="key position", ylabel="query position")
        ax.grid(False)
    x = np.arange(n)
    for offset, (kind, split) in zip((-0.19, 0.19), splits.items()):
        scores = [split.unmasked_scores(r) for r in range(n)]
        axes[2].bar(x + offset, scores, 0.38, color=RANKS[:n], edgecolor=INK,
                    hatch="" if kind == "contiguous" else "///", linewidth=0.5)
    axes[2].axhline(T * (T + 1) / 2 / n, color=INK, ls="--", lw=0.8)
    axes[2].set_xticks(x, [f"rank {r}" for r in range(n)])
    axes[2].set(ylabel="unmasked scores", title="per sequence and head")
    axes[2].grid(False, axis="x")
    legend_below(fig, [Patch(facecolor="white", edgecolor=INK, label="contiguous"),
                       Patch(facecolor="white", edgecolor=INK, hatch="///", label="zigzag"),
                       Line2D([], [], color=INK, ls="--", label="fair share T(T+1)/2N")])
    return fig


@figure(11, "## 8. Which algorithm, and how many ranks",
        caption="Bytes each rank sends per attention layer for one 4096-token sequence with 16 heads of 64 in "
                "bf16: ring attention's grow towards 6·B·H·T·D, Ulysses' fall as ranks are added, until N "
                "reaches the number of heads.",
        alt="A line chart of megabytes per rank against context-parallel ranks N from 2 to 64 on a logarithmic "
            "axis. Ring attention rises from about 25 MB at N = 2 and levels off near 50 MB. Ulysses falls from "
            "about 17 MB at N = 2 to about 4 MB at N = 16, where its line stops because N cannot exceed the 16 "
            "heads.")
def ch11_ring_vs_ulysses():
    batch, heads, length, head_dim, itemsize = 1, 16, 4096, 64, 2
    ring_ranks = 2 ** np.arange(1, 7)
    ulysses_ranks = ring_ranks[ring_ranks <= heads]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(ring_ranks, [ring_attention_traffic(batch, heads, length, head_dim, int(n), itemsize)["bytes"] / MB
                         for n in ring_ranks], "o-", color=ALGORITHMS["ring"], label="ring attention")
    ax.plot(ulysses_ranks, [ulysses_traffic(batch, heads, length, head_dim, int(n), itemsize)["bytes"] / MB
                            for n in ulysses_ranks], "s-", color=ALGORITHMS["halving_doubling"],
            label="DeepSpeed-Ulysses (N ≤ H)")
    ax.axhline(6 * batch * heads * length * head_dim * itemsize / MB, color=INK, ls=":", lw=0.8,
               label="6·B·H·T·D elements")
    ax.set_xscale("log", base=2)
    log_ticks(ax.xaxis, ring_ranks)
    ax.set(xlabel="context-parallel ranks N", ylabel="MB per rank and attention",
           title="T = 4096, 16 heads of 64, bf16, forward + backward (ring_attention_traffic, ulysses_traffic)",
           ylim=(0, 60))
    ax.legend(loc="center right")
    return fig


MOE_CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, num_experts=8)


def _dropped(probs: np.ndarray, k: int, capacity_factor: float) -> int:
    """Choices the first-come, first-served rule drops at this capacity factor (the layer's own routing code)."""
    experts = moe.top_k_experts(probs, k)
    counts = moe.choice_counts(experts, probs.shape[1])[None]  # one slice: (1, k, E)
    capacity = moe.expert_capacity(probs.shape[0], probs.shape[1], k, capacity_factor)
    kept = np.clip(capacity - moe.queue_starts(counts), 0, counts)
    return int(counts.sum() - kept.sum())


@figure(11, "## 9. Mixture of experts",
        caption="Routing of an untrained 8-expert MoE GPT, first layer, 256 tokens: how many tokens choose "
                "each expert against its capacity (left), and how many choices are dropped as the capacity "
                "factor grows (right).",
        alt="Two charts. Left, bars of tokens per expert for experts 0 to 7 with top-1 routing, uneven between "
            "about 19 and 41, with dashed horizontal lines at the capacity for factors 1.0 (32 tokens) and 1.25 "
            "(40 tokens); the bars above a line are the dropped tokens. Right, dropped choices against the "
            "capacity factor from 0.5 to 3 for top-1 and top-2 routing: both fall steeply, top-1 from 128 to 0 "
            "by a factor of 1.5, top-2 from 256 to 0 by 2.0.")
def ch11_moe_capacity():
    batch = 16
    x, y = make_task("sort", MOE_CONFIG["block_size"], seed=0).get_batch(0, batch)
    probs = {}
    with default_dtype("float64"):
        for k in (1, 2):
            model = moe.MoEGPT(moe.MoEConfig(**MOE_CONFIG, top_k=k), seed=0)
            model(x, y)
            probs[k] = model.h[0].mlp.routing.probs
    experts = MOE_CONFIG["num_experts"]
    tokens = probs[1].shape[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.3))
    counts = moe.choice_counts(moe.top_k_experts(probs[1], 1), experts)[0]
    left.bar(range(experts), counts, color=RANKS[2], width=0.6)
    for factor, style in ((1.0, "--"), (1.25, ":")):
        capacity = moe.expert_capacity(tokens, experts, 1, factor)
        left.axhline(capacity, color=INK, ls=style, lw=0.9, label=f"capacity at C = {factor}: {capacity}")
    left.set(xlabel="expert", ylabel="tokens (first choices)", title=f"top-1, {tokens} tokens",
             ylim=(0, max(counts) * 1.3))
    left.set_xticks(range(experts))
    left.grid(False, axis="x")
    left.legend(loc="upper left", fontsize=7)
    factors = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
    for k, color in ((1, RANKS[2]), (2, RANKS[1])):
        right.plot(factors, [_dropped(probs[k], k, c) for c in factors], "o-", color=color,
                   label=f"top-{k} (of {k * tokens} choices)")
    right.set(xlabel="capacity factor C", ylabel="dropped choices",
              title="⌈k·N/E·C⌉ per expert, first come first served")
    right.legend()
    return fig
