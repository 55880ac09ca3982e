"""The figures of chapter 3 (data parallelism)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from minidist.comm import cost
from minidist.core.data import make_task
from minidist.core.model import GPT, GPTConfig
from minidist.core.tensor import default_dtype
from minidist.parallel.balance import balanced_split
from minidist.parallel.data_parallel import make_buckets
from minidist.plan import memory
from book_figures.common import (ALGORITHMS, DEMO, figure, gantt, INK, KIND, kind_patches, legend_below,
    log_ticks, MB, PILE_NAMES, PILES, power, RANKS)


TINY = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


@figure(3, "### Why the update equals the serial one",
        caption="The average of the slice gradients against the whole batch's gradient, small GPT in float64: "
                "equal slices agree to rounding, an unequal split agrees only when weighted by its rows.",
        alt="A bar chart on a logarithmic scale of the largest difference from the whole batch's gradient, "
            "relative to its largest entry, for four ways of combining slice gradients. Two equal slices, four "
            "equal slices and a 12 and 4 row split weighted 12/16 and 4/16 all sit near 1e-16; the same 12 and "
            "4 row split averaged plainly is off by about 0.1, fifteen orders of magnitude higher.")
def ch03_averaged_gradient():
    with default_dtype("float64"):
        model = GPT(TINY, seed=0)
        x, y = make_task("sort", TINY.block_size, seed=0).get_batch(0, 16)

        def gradient(rows):
            model.zero_grad()
            _, loss = model(x[rows], y[rows])
            loss.backward()
            return np.concatenate([p.grad.ravel() for p in model.parameters()])

        whole = gradient(slice(0, 16))
        halves = [gradient(slice(8 * i, 8 * i + 8)) for i in range(2)]
        quarters = [gradient(slice(4 * i, 4 * i + 4)) for i in range(4)]
        big, small = gradient(slice(0, 12)), gradient(slice(12, 16))
    cases = {"2 equal slices\nplain mean": np.mean(halves, axis=0),
             "4 equal slices\nplain mean": np.mean(quarters, axis=0),
             "12 + 4 rows\nplain mean": (big + small) / 2,
             "12 + 4 rows\nweighted 12/16, 4/16": 0.75 * big + 0.25 * small}
    errors = [float(np.max(np.abs(g - whole)) / np.max(np.abs(whole))) for g in cases.values()]
    shown = [max(e, 1e-18) for e in errors]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    colors = [KIND["comm"] if e < 1e-12 else ALGORITHMS["naive"] for e in errors]
    ax.bar(range(len(cases)), shown, color=colors, width=0.55)
    for i, e in enumerate(errors):
        ax.text(i, shown[i] * 2, "0 (exact)" if e == 0 else f"{e:.1e}", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(1e-18, 10)
    log_ticks(ax.yaxis, [10.0 ** k for k in range(-18, 1, 3)], [power(10, k) for k in range(-18, 1, 3)])
    ax.set_xticks(range(len(cases)), list(cases))
    ax.set(ylabel="max |ḡ − g| / max |g|",
           title="Averaged slice gradients vs the whole batch's gradient (global batch 16, float64)")
    ax.grid(False, axis="x")
    return fig


DDP_FLOPS = 30e9       # useful FLOP/s of a training step on this kind of machine (chapter 1: about 25-35)
DDP_ALPHA, DDP_BETA = cost.AUTO_COST["alpha"], 5e-9  # a link of 200 MB/s: slow enough for the overlap to show


def _ddp_step(params, cap_bytes: int | None, ranks: int = 2, tokens: int = 8 * 64):
    """A modelled data-parallel step of one rank (every rank alike): forward 2 and backward 4 FLOPs per
    parameter and token, gradients ready in reverse parameter order, each all-reduce a ring priced by
    `cost.predict` on one link, one at a time. cap_bytes=None: the naive wrapper (one all-reduce per
    parameter after backward); else `make_buckets`' buckets, each started as soon as it is complete.
    Returns the events, the end of backward and the end of communication."""
    numel = sum(p.size for p in params)
    forward = 2 * numel * tokens / DDP_FLOPS
    events = [("forward", "forward", 0.0, forward)]
    clock, ready = forward, {}
    for p in reversed(params):
        clock += 4 * p.size * tokens / DDP_FLOPS
        ready[id(p)] = clock
    events.append(("backward", "backward", forward, clock))
    backward_end = clock
    if cap_bytes is None:
        groups, ready_at = [[p] for p in params], (lambda group: backward_end)
    else:
        groups = [bucket.params for bucket in make_buckets(params, cap_bytes)]
        ready_at = (lambda group: max(ready[id(p)] for p in group))
    link = 0.0
    for group in groups:
        start = max(ready_at(group), link)
        link = start + cost.predict("all_reduce", "ring", ranks, sum(p.data.nbytes for p in group), DDP_ALPHA, DDP_BETA)
        events.append(("all-reduce", "comm", start, link))
    return events, backward_end, max(link, backward_end)


@figure(3, "## 3. Bucketing and overlap (梯度分桶与通信重叠)",
        caption="One data-parallel step of the demo GPT on 2 ranks, modelled: the naive wrapper starts its "
                "all-reduces after backward, the bucketed one during it, leaving only the last bucket exposed.",
        alt="A Gantt chart with two rows, naive and bucketed, on a time axis in milliseconds. Each row has a "
            "blue forward bar and a longer orange backward bar. In the naive row a run of thin green "
            "communication bars starts only when backward ends and continues well past it. In the bucketed row "
            "four green bars start while backward is still running; only a short one sticks out after "
            "backward ends. A bracket marks the exposed communication of each row.")
def ch03_bucket_timeline():
    params = GPT(DEMO, seed=0).parameters()
    cap = 1 << 20
    runs = {"naive": _ddp_step(params, None), f"bucketed ({cap >> 20} MiB)": _ddp_step(params, cap)}
    fig, ax = plt.subplots(figsize=(7, 2.9))
    gantt(ax, [[(n, k, s * 1e3, e * 1e3) for n, k, s, e in events] for events, _, _ in runs.values()],
          rows=list(runs), labels=False, unit="time (ms)")
    for row, (events, backward_end, comm_end) in enumerate(runs.values()):
        exposed = (comm_end - backward_end) * 1e3
        ax.annotate("", (backward_end * 1e3, row + 0.47), (comm_end * 1e3, row + 0.47),
                    arrowprops=dict(arrowstyle="|-|", color=INK, lw=0.8, shrinkA=0, shrinkB=0,
                                    mutation_scale=3))
        ax.text(comm_end * 1e3 + 1, row + 0.45, f"exposed {exposed:.1f} ms", va="center", fontsize=7.5)
    ax.set_xlim(0, max(end for _, _, end in runs.values()) * 1e3 * 1.18)
    ax.set_title(f"Model: {DDP_FLOPS / 1e9:.0f} GFLOP/s, ring all-reduce with α = {DDP_ALPHA * 1e6:.0f} µs "
                 f"and {1 / DDP_BETA / MB:.0f} MB/s, dp = 2, demo GPT", loc="left")
    legend_below(fig, kind_patches(["forward", "backward", "comm"]))
    return fig


@figure(3, "### The bucket size",
        caption="The same model over bucket caps from 16 KiB to 16 MiB: the smaller the cap, the more calls, "
                "each paying the latency α; the larger, the more of the gradients wait in a last bucket that "
                "starts only when backward ends.",
        alt="Two line charts against the bucket cap on a logarithmic axis from 16 KiB to 16 MiB. Left: the "
            "number of buckets, that is of all-reduce calls, falls from about fifty to one. Right: the "
            "communication left exposed after backward, in milliseconds, stays around a millisecond up to caps "
            "of a few hundred KiB and climbs for larger caps to about 17 ms, near the naive wrapper's level, "
            "drawn as a dashed line.")
def ch03_bucket_cap():
    params = GPT(DEMO, seed=0).parameters()
    caps = [1 << k for k in range(14, 25)]
    buckets = [len(make_buckets(params, cap)) for cap in caps]
    exposed = [(end - backward) * 1e3 for _, backward, end in (_ddp_step(params, cap) for cap in caps)]
    _, backward, end = _ddp_step(params, None)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.1))
    kib = [cap / 1024 for cap in caps]
    left.plot(kib, buckets, "o-", color=KIND["comm"])
    left.set(xscale="log", yscale="log", xlabel="bucket cap (KiB)", ylabel="buckets = all-reduce calls",
             title="make_buckets, demo GPT")
    log_ticks(left.yaxis, [1, 2, 5, 10, 20, 50])
    right.plot(kib, exposed, "o-", color=KIND["comm"], label="bucketed")
    right.axhline((end - backward) * 1e3, color=ALGORITHMS["naive"], ls="--", label="naive")
    right.set(xscale="log", xlabel="bucket cap (KiB)", ylabel="exposed communication (ms)",
              title="after the end of backward (model)", ylim=(0, None))
    right.legend(loc="center left")
    for ax in (left, right):
        log_ticks(ax.xaxis, [16, 64, 256, 1024, 4096, 16384], ["16", "64", "256", "1Mi", "4Mi", "16Mi"])
    return fig


@figure(3, "## 6. Memory per rank: what data parallelism does not save",
        caption="Memory per rank of the demo GPT at a global batch of 16: only the activations divide by dp; "
                "parameters, gradients and optimizer states are replicated on every rank.",
        alt="A stacked bar chart with four bars for dp = 1, 2, 4 and 8. Each bar has the same three small "
            "bottom segments, parameters, gradients and optimizer states, about 13 MB together; the brown "
            "activations segment on top halves from bar to bar, from about 61 MB to about 8 MB.")
def ch03_memory_per_rank():
    psi, batch = memory.param_count(DEMO), 16
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ranks = [1, 2, 4, 8]
    for i, dp in enumerate(ranks):
        piles = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi,
                 "activations": memory.activation_bytes(DEMO, batch // dp)["total"]}
        bottom = 0.0
        for key, color in PILES.items():
            ax.bar(i, piles[key] / MB, bottom=bottom, color=color, width=0.55, edgecolor="white")
            bottom += piles[key] / MB
        ax.text(i, bottom + 1, f"{bottom:.1f} MB", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(ranks)), [f"dp = {dp}\n{batch // dp} rows per rank" for dp in ranks])
    ax.set(ylabel="MB per rank", title="Demo GPT, float32 AdamW, global batch 16 (memory formulas)")
    ax.grid(False, axis="x")
    legend_below(fig, [Patch(color=c, label=PILE_NAMES[k]) for k, c in PILES.items()])
    return fig


@figure(3, "### Choosing the split",
        caption="The balancer's split of a 16-row batch when rank 1 is (1 + s) times slower, beside "
                "n₁ = B/(2 + s), and the step it buys against the even split.",
        alt="Two line charts against the slowdown s from 0 to 4. Left: rows given to the slow rank by "
            "balanced_split, a staircase falling from 8 to 3, following a dashed curve 16/(2 + s). Right: step "
            "time in row-times of the fast rank; the even split rises in a straight line from 8 to 40, the "
            "balanced split much more slowly, from 8 to about 14.")
def ch03_straggler_split():
    batch = 16
    slowdowns = np.arange(0, 4.001, 0.125)
    rows = [balanced_split(batch, [1.0, 1.0 + s], [0.0, 0.0])[1] for s in slowdowns]
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.1))
    left.step(slowdowns, rows, where="mid", color=RANKS[1], label="balanced_split")
    left.plot(slowdowns, batch / (2 + slowdowns), "--", color=INK, lw=0.8, label="B/(2 + s)")
    left.set(xlabel="rank 1 is (1 + s) times slower: s", ylabel="rows on rank 1", title="the split (B = 16)")
    left.legend()
    even = (batch / 2) * (1 + slowdowns)
    balanced = [max(batch - n, n * (1 + s)) for n, s in zip(rows, slowdowns)]
    right.plot(slowdowns, even, color=ALGORITHMS["naive"], label="even split, 8 + 8")
    right.plot(slowdowns, balanced, color=KIND["comm"], label="balanced split")
    right.set(xlabel="s", ylabel="step time (row-times of rank 0)", title="the slowest rank sets the pace")
    right.legend()
    return fig
