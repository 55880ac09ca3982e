"""The figures of chapter 1 (why distributed training)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minidist.core.data import make_task
from minidist.core.model import GPT, GPTConfig
from minidist.core.optim import AdamW
from minidist.core.tensor import graph_bytes
from minidist.plan import memory
from minidist.plan.hardware import PRESETS as DEVICES
from book_figures.common import (DEMO, figure, GB, GPT3, INK, KIND, legend_below, log_ticks, MB, PILE_NAMES,
    PILES)


def _measured_activations(model, batch: int, seq: int) -> int:
    ids = np.zeros((batch, seq), dtype=np.int64)
    _, loss = model(ids, ids)
    return graph_bytes(loss)


@figure(1, "### Activations, derived for this implementation",
        caption="Activation memory grows linearly with the batch and faster than linearly with the sequence, "
                "where the attention weights' a·b·s² term takes over; the measured points lie on the formula.",
        alt="Two line charts of activation memory in megabytes for the demo GPT. Left: against the batch size "
            "from 1 to 32 sequences of 64 tokens, a straight line through the origin, with four measured dots "
            "on it. Right: against the sequence length from 16 to 512 tokens at batch 1, an upward-bending "
            "curve, with a dashed curve for the attention weights alone that grows quadratically and is "
            "already over a third of the total at 512 tokens, and four measured dots on the total.")
def ch01_activation_growth():
    config, long = DEMO, GPTConfig(block_size=512)
    batches, seqs = np.arange(1, 33), np.arange(16, 513, 16)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.2))
    left.plot(batches, [memory.activation_bytes(config, int(b))["total"] / MB for b in batches],
              color=PILES["activations"], label="formula (memory.activation_bytes)")
    model = GPT(config, seed=0)
    dots = [1, 2, 4, 8]
    left.plot(dots, [_measured_activations(model, b, 64) / MB for b in dots], "o", color=INK, ms=4,
              label="measured (graph_bytes)")
    left.set(xlabel="batch (sequences of 64 tokens)", ylabel="activation memory (MB)", title="linear in the batch")
    left.legend(loc="upper left")
    h, a = config.n_embd, config.n_head
    right.plot(seqs, [memory.activation_bytes(long, 1, int(s))["total"] / MB for s in seqs],
               color=PILES["activations"], label="formula, all")
    attention = [config.n_layer * 4 * (memory.layer_activation_elements(1, int(s), h, a)
                                       - memory.layer_activation_elements(1, int(s), h, 0)) / MB for s in seqs]
    right.plot(seqs, attention, "--", color=PILES["activations"], label="of which attention weights (a·b·s²)")
    model = GPT(long, seed=0)
    dots = [64, 128, 256, 512]
    right.plot(dots, [_measured_activations(model, 1, s) / MB for s in dots], "o", color=INK, ms=4,
               label="measured")
    right.set(xlabel="sequence length (tokens, batch 1)", ylabel="activation memory (MB)",
              title="faster than linear in the sequence")
    right.legend(loc="upper left")
    return fig


@figure(1, "## 2. The demo model, measured",
        caption="The four piles of one training step of the demo GPT, as the formulas predict them and as the "
                "memory ledger measures them: the same bytes, and activations are most of them.",
        alt="Two horizontal stacked bars of equal length, labelled formula and measured, each split into "
            "four coloured segments: parameters, gradients and optimizer states, small at the left, and a long "
            "activations segment that takes about four fifths of the bar. Each segment is labelled with its "
            "size in megabytes.")
def ch01_demo_piles():
    config, batch = DEMO, 16
    model = GPT(config, seed=0)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    x, y = make_task("sort", config.block_size, seed=0).get_batch(0, batch)
    _, loss = model(x, y)
    activations = graph_bytes(loss)
    loss.backward()
    optimizer.step()
    measured = memory.ledger(model, optimizer, activations)
    psi = memory.param_count(config)
    predicted = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi,
                 "activations": memory.activation_bytes(config, batch)["total"]}
    fig, ax = plt.subplots(figsize=(7, 2.6))
    for row, piles in enumerate((predicted, measured)):
        left = 0.0
        for key, color in PILES.items():
            width = piles[key] / MB
            ax.barh(row, width, left=left, color=color, edgecolor="white", height=0.6)
            ax.text(left + width / 2, row, f"{width:.1f}", ha="center", va="center", fontsize=7.5, color="white")
            left += width
        ax.text(left + 0.8, row, f"{left:.1f} MB", va="center")
    ax.set_yticks([0, 1], ["formula", "measured\n(memory.ledger)"])
    ax.set_ylim(1.5, -0.5)
    ax.set_xlim(0, sum(predicted.values()) / MB * 1.13)
    share = measured["activations"] / measured["peak"]
    ax.set(xlabel="MB", title=f"Demo GPT, one step of {batch} × {config.block_size} tokens, float32 AdamW: "
                              f"activations {share:.0%}")
    ax.grid(False, axis="y")
    legend_below(fig, [Patch(color=c, label=PILE_NAMES[k]) for k, c in PILES.items()])
    return fig


LARGE_MODELS = {"1B": (1e9, GPTConfig(n_layer=20, n_embd=2048, n_head=16, block_size=2048)),
                "7.5B": (7.5e9, GPTConfig(n_layer=36, n_embd=4096, n_head=32, block_size=2048)),
                "175B (GPT-3)": (175e9, GPT3)}


@figure(1, "## 3. Scaling up: where one device runs out",
        caption="Training memory of three model sizes, pile by pile, beside one 80 GB device: beyond a few "
                "billion parameters the model states alone overflow it.",
        alt="Three stacked bar charts side by side, one per model (1B, 7.5B and 175B parameters), each with "
            "its own vertical scale in gigabytes and a dashed line at 80 GB. The 1B bar, about 26 GB, stays "
            "below the line; the 7.5B bar, about 154 GB, is twice the line, its optimizer states alone above "
            "it; the 175B bar is about 3.1 TB, some forty times the line. In every bar the optimizer states "
            "are the largest pile.")
def ch01_model_sizes():
    device = DEVICES["a100-80gb"].memory
    fig, axes = plt.subplots(1, 3, figsize=(7, 3.4))
    for ax, (name, (psi, config)) in zip(axes, LARGE_MODELS.items()):
        piles = memory.model_state_bytes(psi)
        piles["activations"] = config.n_layer * memory.megatron_activation_bytes(1, config.block_size,
                                                                                 config.n_embd, config.n_head)
        bottom = 0.0
        for key, color in PILES.items():
            ax.bar(0, piles[key] / GB, bottom=bottom, width=0.55, color=color, edgecolor="white")
            bottom += piles[key] / GB
        ax.axhline(device / GB, color=INK, ls="--", lw=1)
        ax.text(0.33, device / GB, "80 GB", va="bottom", ha="center", fontsize=7.5)
        total = f"{bottom / 1e3:.1f} TB" if bottom > 1e3 else f"{bottom:.0f} GB"
        ax.set(title=f"{name}\ntotal {total}", xticks=[], xlim=(-0.5, 0.55), ylim=(0, 1.12 * max(bottom, device / GB)))
        ax.grid(False, axis="x")
    axes[0].set_ylabel("GB")
    fig.suptitle("Mixed-precision Adam, micro-batch 1, sequence 2048", fontsize=9.5, x=0.02, ha="left")
    legend_below(fig, [Patch(color=c, label=PILE_NAMES[k]) for k, c in PILES.items()])
    return fig


@figure(1, "## 4. Time: 6 × parameters × tokens",
        caption="Days to train GPT-3 (6 · Ψ · D FLOPs) against the number of A100s at 40% of their peak: "
                "one device would take decades, 1024 take about a month.",
        alt="A log-log line chart: training time in days falls along a straight line from tens of thousands "
            "of days on one GPU to a few days on ten thousand GPUs. Horizontal dotted lines mark one day, "
            "one month and one year; a dot at 1024 GPUs sits near the one-month line.")
def ch01_training_time():
    psi, tokens, mfu = 175e9, 300e9, 0.4
    peak = DEVICES["a100-80gb"].flops("bf16")
    flops = 6 * psi * tokens
    gpus = 2.0 ** np.arange(0, 15)
    days = flops / (gpus * mfu * peak) / 86400
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.loglog(gpus, days, "-", color=KIND["compute"], label=f"GPT-3: 6 · 175e9 · 300e9 = {flops:.2e} FLOPs")
    for value, label in ((1, "one day"), (30, "one month"), (365, "one year")):
        ax.axhline(value, color=INK, ls=":", lw=0.8)
        ax.text(gpus[-1], value, label, ha="right", va="bottom", fontsize=7.5)
    at = flops / (1024 * mfu * peak) / 86400
    ax.plot([1024], [at], "o", color=INK)
    ax.annotate(f"1024 GPUs: {at:.0f} days", (1024, at), xytext=(12, 12), textcoords="offset points")
    ax.set(xlabel="A100 GPUs (each 40% of 312 TFLOP/s)", ylabel="days", title="Time to train GPT-3 on 300B tokens")
    log_ticks(ax.xaxis, [1, 4, 16, 64, 256, 1024, 4096, 16384])
    log_ticks(ax.yaxis, [1, 10, 100, 1000, 10000], ["1", "10", "100", "1,000", "10,000"])
    ax.legend(loc="lower left")
    return fig
