"""The figures of chapter 6 (tensor parallelism)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from minidist.comm import cost
from minidist.core import functional as F
from minidist.core.model import GPT
from minidist.core.tensor import default_dtype, Tensor
from minidist.parallel.tensor_layers import divide
from minidist.plan import memory
from book_figures.common import (AXES_COLORS, DEMO, figure, INK, legend_below, lighter, MB, PILES, RANKS,
    SUBSCRIPT, SUM)


@figure(6, "## 1. Two ways to cut a matrix product",
        caption="The Megatron MLP on t = 2 ranks at the demo's width: W₁ is cut by output features and W₂ by "
                "input features, so each rank's slice of H feeds its slice of W₂ directly and only the partial "
                "outputs need adding up.",
        alt="A diagram of matrices drawn to scale from left to right: the input X, replicated, in grey; W₁ "
            "transposed, C by 4C, split into two vertical halves coloured for rank 0 and rank 1; the hidden "
            "activation H, also split into two vertical halves by rank, after GELU; W₂ transposed, 4C by C, "
            "split into two horizontal halves by rank; and two partial outputs Y₀ and Y₁, one per rank, joined "
            "by an all-reduce into the output Y.")
def ch06_column_row_split():
    t, c = 2, DEMO.n_embd
    hidden = 4 * c
    share = divide(hidden, t, "MLP features")
    unit = 1 / 64  # drawing units per feature
    tokens = 128 * unit
    fig, ax = plt.subplots(figsize=(7, 3.0))
    ax.set_axis_off()
    mid = hidden * unit / 2

    def box(x, w, h, color, label=None, below=None):
        ax.add_patch(Rectangle((x, mid - h / 2), w, h, facecolor=color, edgecolor=INK, linewidth=0.8))
        if label:
            ax.text(x + w / 2, mid, label, ha="center", va="center", fontsize=8)
        if below:
            ax.text(x + w / 2, mid - h / 2 - 0.25, below, ha="center", va="top", fontsize=7.5)

    def sign(x, text):
        ax.text(x, mid, text, ha="center", va="center", fontsize=11)

    x = 0.0
    box(x, c * unit, tokens, "#e0e0e0", "X", f"X\n(B·T × {c})\nreplicated")
    x += c * unit + 0.5
    sign(x, "·")
    x += 0.5
    for r in range(t):  # W1ᵀ: columns r·share .. (r+1)·share
        ax.add_patch(Rectangle((x + r * share * unit, mid - c * unit / 2), share * unit, c * unit,
                               facecolor=RANKS[r], edgecolor=INK, linewidth=0.8))
        ax.text(x + (r + 0.5) * share * unit, mid, f"W₁,{str(r).translate(SUBSCRIPT)}ᵀ", ha="center", va="center",
                fontsize=8)
    ax.text(x + hidden * unit / 2, mid - c * unit / 2 - 0.25, f"W₁ᵀ ({c} × {hidden}):\ncolumn-parallel",
            ha="center", va="top", fontsize=7.5)
    x += hidden * unit + 0.9
    sign(x, "→")
    ax.text(x, mid + 0.4, "GELU", ha="center", va="bottom", fontsize=7.5)
    x += 0.9
    for r in range(t):  # H: the same columns, on rank r
        ax.add_patch(Rectangle((x + r * share * unit, mid - tokens / 2), share * unit, tokens,
                               facecolor=RANKS[r], edgecolor=INK, linewidth=0.8))
        ax.text(x + (r + 0.5) * share * unit, mid, f"H{str(r).translate(SUBSCRIPT)}", ha="center", va="center",
                fontsize=8)
    ax.text(x + hidden * unit / 2, mid - tokens / 2 - 0.25, f"H (B·T × {hidden}):\nrank r holds {share} features",
            ha="center", va="top", fontsize=7.5)
    x += hidden * unit + 0.5
    sign(x, "·")
    x += 0.5
    for r in range(t):  # W2ᵀ: rows r·share .. (r+1)·share
        ax.add_patch(Rectangle((x, mid + hidden * unit / 2 - (r + 1) * share * unit), c * unit, share * unit,
                               facecolor=RANKS[r], edgecolor=INK, linewidth=0.8))
        ax.text(x + c * unit / 2, mid + hidden * unit / 2 - (r + 0.5) * share * unit,
                f"W₂,{str(r).translate(SUBSCRIPT)}ᵀ",
                ha="center", va="center", fontsize=8)
    ax.text(x + c * unit / 2, mid - hidden * unit / 2 - 0.25, f"W₂ᵀ ({hidden} × {c}):\nrow-parallel",
            ha="center", va="top", fontsize=7.5)
    x += c * unit + 0.5
    sign(x, "=")
    x += 0.5
    for r in range(t):
        y = mid + (0.5 - r) * (tokens + 0.5) - tokens / 2
        ax.add_patch(Rectangle((x, y), c * unit, tokens, facecolor=RANKS[r], edgecolor=INK, linewidth=0.8))
        ax.text(x + c * unit / 2, y + tokens / 2, f"Y{str(r).translate(SUBSCRIPT)}", ha="center", va="center",
                fontsize=8)
    ax.text(x + c * unit / 2, mid - tokens - 0.5, "partial sums", ha="center", va="top", fontsize=7.5)
    x += c * unit + 0.3
    ax.add_patch(FancyArrowPatch((x, mid), (x + 2.0, mid), arrowstyle="-|>", mutation_scale=10, color=INK))
    ax.text(x + 1.0, mid - 0.2, "g:\nall-reduce", ha="center", va="top", fontsize=7.5)
    x += 2.2
    box(x, c * unit, tokens, SUM, "Y", "Y = Y₀ + Y₁\n+ bias")
    x += c * unit
    ax.set_xlim(-0.2, x + 0.2)
    ax.set_ylim(mid - hidden * unit / 2 - 1.3, mid + hidden * unit / 2 + 0.2)
    ax.set_aspect("equal")
    ax.set_title(f"Y = GELU(X W₁ᵀ) W₂ᵀ on t = {t} ranks (demo width C = {c})", loc="left")
    legend_below(fig, [Patch(color=RANKS[r], label=f"held by rank {r}") for r in range(t)]
                 + [Patch(color="#e0e0e0", label="replicated"), Patch(color=SUM, label="summed over ranks")])
    return fig


@figure(6, "## 2. f and g: why they are conjugate",
        caption="The demo GPT's first MLP cut over 2 ranks, run through minidist's autograd: forward, the "
                "ranks' partial outputs add up to the serial output (g); backward, their partial input "
                "gradients add up to the serial gradient (f).",
        alt="Two rows of four heat maps of six tokens by the first 24 features. Top row, forward: rank 0's "
            "partial output and rank 1's partial output look different from each other; their sum plus the "
            "bias and the serial output look identical. Bottom row, backward: rank 0's and rank 1's gradients "
            "with respect to the input differ; their sum and the serial input gradient look identical. The "
            "largest difference from the serial result is printed under each row's last map, at the level of "
            "rounding or zero.")
def ch06_f_and_g():
    t, tokens, shown = 2, 6, 24
    with default_dtype("float64"):
        mlp = GPT(DEMO, seed=0).h[0].mlp
        rng = np.random.default_rng(0)
        X, G = rng.normal(size=(tokens, DEMO.n_embd)), rng.normal(size=(tokens, DEMO.n_embd))
        x = Tensor(X.copy(), requires_grad=True)
        y = mlp(x)
        (y * Tensor(G)).sum().backward()
        serial_y, serial_dx = y.data, x.grad
        w1, b1 = mlp.c_fc.weight.data, mlp.c_fc.bias.data
        w2, b2 = mlp.c_proj.weight.data, mlp.c_proj.bias.data
        share = divide(w1.shape[0], t, "MLP features")
        partial_y, partial_dx = [], []
        for r in range(t):
            cols = slice(r * share, (r + 1) * share)
            xr = Tensor(X.copy(), requires_grad=True)  # f forward: every rank gets the same x
            h = F.gelu(F.linear(xr, Tensor(np.ascontiguousarray(w1[cols])), Tensor(b1[cols].copy())))
            yr = F.linear(h, Tensor(np.ascontiguousarray(w2[:, cols])))  # partial sum; the bias after the sum
            (yr * Tensor(G)).sum().backward()  # g backward: every rank receives the same dL/dY
            partial_y.append(yr.data)
            partial_dx.append(xr.grad)
    total_y, total_dx = sum(partial_y) + b2, sum(partial_dx)
    rows = [("forward: Y", partial_y, total_y, serial_y, "Y₀ + Y₁ + bias (g)"),
            ("backward: dL/dX", partial_dx, total_dx, serial_dx, "dX₀ + dX₁ (f)")]
    fig, axes = plt.subplots(2, 4, figsize=(7, 3.3))
    for row, (label, parts, total, serial, summed) in zip(axes, rows):
        scale = np.max(np.abs(serial[:, :shown]))
        names = ("Y₀", "Y₁") if label.startswith("forward") else ("dX₀", "dX₁")
        panels = [(parts[0], f"rank 0: {names[0]}"), (parts[1], f"rank 1: {names[1]}"), (total, summed),
                  (serial, "serial")]
        for ax, (values, title) in zip(row, panels):
            ax.imshow(values[:, :shown], cmap="RdBu_r", vmin=-scale, vmax=scale, aspect="auto")
            ax.set_title(title, fontsize=8.5)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
        diff = np.max(np.abs(total - serial)) / np.max(np.abs(serial))
        row[0].set_ylabel(label, fontsize=8.5)
        row[3].set_xlabel(f"largest difference {diff:.1g}", fontsize=7.5)
    fig.suptitle(f"One MLP of the demo GPT on t = {t} ranks, float64 ({tokens} tokens, first {shown} features)",
                 fontsize=9.5, x=0.02, ha="left")
    return fig


@figure(6, "## 6. Traffic, measured",
        caption="Bytes each rank sends per step, demo GPT: tensor parallelism moves activations, which grow "
                "with the batch; data parallelism moves the gradients once, whatever the batch.",
        alt="Two charts. Left, grouped bars for t = 1, 2 and 4 ranks: tensor parallelism sends about 9.5 MB "
            "at t = 2 and 14 MB at t = 4 per rank, data parallelism's gradient all-reduce about 3.3 and 5 MB. "
            "Right, lines against the batch from 1 to 64 sequences at two ranks: tensor parallelism's bytes "
            "rise in a straight line, data parallelism's stay flat, and the tensor-parallel line crosses above "
            "it at a batch of about 6.")
def ch06_traffic():
    grads = 4 * memory.param_count(DEMO)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.2))
    degrees = [1, 2, 4]
    tp = [cost.tensor_parallel_traffic_per_step(DEMO, 16, t, one_machine=True)["bytes_sent"] / MB for t in degrees]
    dp = [cost.terms("all_reduce", "ring", t, grads)[1] / MB for t in degrees]
    x = np.arange(len(degrees))
    left.bar(x - 0.19, tp, 0.38, color=AXES_COLORS["tp"], label="tensor parallel (activations)")
    left.bar(x + 0.19, dp, 0.38, color=AXES_COLORS["dp"], label="data parallel (gradients)")
    left.set_xticks(x, [f"t = {t}" for t in degrees])
    left.set(ylabel="MB per rank per step", title="batch 16, by the number of ranks")
    left.grid(False, axis="x")
    left.legend(loc="upper left")
    batches = np.arange(1, 65)
    right.plot(batches, [cost.tensor_parallel_traffic_per_step(DEMO, int(b), 2, one_machine=True)["bytes_sent"] / MB
                         for b in batches], color=AXES_COLORS["tp"], label="tensor parallel, t = 2")
    right.axhline(cost.terms("all_reduce", "ring", 2, grads)[1] / MB, color=AXES_COLORS["dp"],
                  label="data parallel, dp = 2")
    right.set(xlabel="batch (sequences of 64 tokens)", ylabel="MB per rank per step", title="2 ranks, by the batch")
    right.legend(loc="upper left")
    fig.suptitle("Demo GPT, float32 (cost.tensor_parallel_traffic_per_step, ring all-reduce)", fontsize=9.5,
                 x=0.02, ha="left")
    return fig


@figure(6, "## 8. Sequence parallelism (序列并行)",
        caption="Activations per rank in the region between g and f, demo GPT: tensor parallelism keeps it "
                "whole on every rank, sequence parallelism keeps 1/t of it plus the gathered inputs of the "
                "column-parallel layers.",
        alt="A grouped bar chart for t = 1, 2 and 4. Each group has a tensor-parallel bar of the same height, "
            "about 23 MB, and a sequence-parallel bar made of two stacked parts: the region divided by t, and "
            "a small gathered-inputs part on top. The sequence-parallel bar is lower by the saving written above "
            "it, about 7 MB at t = 2 and 13 MB at t = 4.")
def ch06_sequence_parallel():
    batch, degrees = 16, [1, 2, 4]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, t in enumerate(degrees):
        sp = memory.sequence_parallel_activation_bytes(DEMO, batch, t)
        region, kept, gathered = sp["region"] / MB, sp["region"] / t / MB, sp["gathered"] / MB
        ax.bar(i - 0.19, region, 0.38, color=AXES_COLORS["tp"])
        ax.bar(i + 0.19, kept, 0.38, color=lighter(AXES_COLORS["tp"], 0.4))
        ax.bar(i + 0.19, gathered, 0.38, bottom=kept, color=PILES["activations"])
        if t > 1:
            ax.text(i + 0.19, kept + gathered + 0.4, f"saves {sp['saved'] / MB:.1f} MB", ha="center", fontsize=7.5)
    ax.set_xticks(range(len(degrees)), [f"t = {t}" for t in degrees])
    ax.set(ylabel="MB per rank", title="Demo GPT, batch 16, float32 (memory.sequence_parallel_activation_bytes)",
           ylim=(0, memory.sequence_parallel_activation_bytes(DEMO, batch, 1)["region"] / MB * 1.12))
    ax.grid(False, axis="x")
    legend_below(fig, [Patch(color=AXES_COLORS["tp"], label="tensor parallel: the region, whole"),
                       Patch(color=lighter(AXES_COLORS["tp"], 0.4), label="sequence parallel: region / t"),
                       Patch(color=PILES["activations"], label="+ gathered inputs")], ncols=3)
    return fig
