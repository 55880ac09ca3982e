"""The figures of chapter 2 (core concepts)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from minidist.comm import algorithms as alg, cost, sim
from minidist.plan import memory
from book_figures.common import (ALGORITHMS, DEMO, figure, INK, KIND, log_ticks, MB, RANKS, SUM)


def _cells(ax, values, colors, title: str = ""):
    """A table of ranks (rows) by elements (columns); NaN cells are left empty."""
    n_rows, n_cols = values.shape
    for i in range(n_rows):
        for j in range(n_cols):
            v = values[i, j]
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor="white" if np.isnan(v) else colors[i][j],
                                   edgecolor="#999999", linewidth=0.6))
            if not np.isnan(v):
                ax.text(j + 0.5, i + 0.5, f"{v:g}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)
    ax.set_xticks([])
    ax.set_yticks(np.arange(n_rows) + 0.5, [f"rank {r}" for r in range(n_rows)])
    ax.tick_params(length=0)
    ax.grid(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title)
    ax.set_aspect("equal")


@figure(2, "## Three collectives and what they cost (a primer)",
        caption="All-reduce, reduce-scatter and all-gather on 4 ranks, run rank by rank in the simulated "
                "world: every rank gets the whole sum, or its one chunk of it, or every rank's chunk.",
        alt="Six small tables of four rows (ranks 0 to 3) by four columns. Top row of tables, before: for "
            "all-reduce and reduce-scatter each rank holds (r+1) times 1, 2, 3, 4, coloured by rank; for "
            "all-gather rank r holds only the value 10r in column r. Bottom row, after: all-reduce gives every "
            "rank 10, 20, 30, 40; reduce-scatter leaves rank r only the sum in column r, so the diagonal reads "
            "10, 20, 30, 40; all-gather gives every rank 0, 10, 20, 30, each column in the colour of the rank it "
            "came from.")
def ch02_three_collectives():
    n = 4
    xs = [(r + 1) * np.array([1.0, 2.0, 3.0, 4.0]) for r in range(n)]
    all_reduced = sim.simulate(alg.all_reduce_ring, [x.copy() for x in xs], np.add)[-1]
    bounds = alg.chunk_bounds(4, n)
    outs = [np.empty(b - a) for a, b in bounds]
    sim.simulate(lambda ctx, x: alg.reduce_scatter_ring(ctx, x, np.add, outs[ctx.rank]), [x.copy() for x in xs])
    scattered = np.full((n, 4), np.nan)
    for r, (a, b) in enumerate(bounds):
        scattered[r, a:b] = outs[r]
    chunks = [np.full(4, np.nan) for _ in range(n)]
    for r, (a, b) in enumerate(bounds):
        chunks[r][a:b] = 10.0 * r
    gathered = sim.simulate(lambda ctx, out: alg.all_gather_ring(ctx, out, bounds), chunks)
    by_rank = [[RANKS[r]] * 4 for r in range(n)]
    by_origin = [[RANKS[j] for j in range(4)] for _ in range(n)]
    summed = [[SUM] * 4 for _ in range(n)]
    fig, axes = plt.subplots(2, 3, figsize=(7, 4.6))
    _cells(axes[0, 0], np.array(xs), by_rank, "all-reduce")
    _cells(axes[0, 1], np.array(xs), by_rank, "reduce-scatter")
    _cells(axes[0, 2], np.array(gathered[0]), by_origin, "all-gather")
    _cells(axes[1, 0], np.array(all_reduced), summed, "every rank: the sum")
    _cells(axes[1, 1], scattered, summed, "rank r: chunk r of the sum")
    _cells(axes[1, 2], np.array(gathered[-1]), by_origin, "every rank: every chunk")
    axes[0, 0].set_ylabel("before", fontsize=9)
    axes[1, 0].set_ylabel("after", fontsize=9)
    for ax in axes[:, 1:].ravel():
        ax.set_yticks([])
    return fig


@figure(2, "## Parameter servers versus all-reduce (参数服务器与 All-Reduce)",
        caption="Bytes each rank sends in one all-reduce, counted in the simulated world: the naive root, "
                "a parameter server, sends (N−1)·S, while every rank of the ring sends less than 2S.",
        alt="A line chart of bytes sent divided by the array size S against the number of ranks from 2 to 8. "
            "The naive all-reduce's root rises in a straight line from 1 to 7; the other naive ranks stay flat "
            "at 1; the ring's busiest rank rises slowly from 1 to 1.75 and lies exactly on a dashed curve "
            "2(N−1)/N that stays below 2.")
def ch02_server_vs_ring():
    count, ranks = 840, np.arange(2, 9)
    size = count * 8
    root, others, ring = [], [], []
    for n in ranks:
        sim.simulate(alg.all_reduce_naive, [np.ones(count) for _ in range(n)], np.add)
        sent = sim.simulate.last_traffic["bytes_sent"]
        root.append(sent[0] / size)
        others.append(max(sent[1:]) / size)
        sim.simulate(alg.all_reduce_ring, [np.ones(count) for _ in range(n)], np.add)
        ring.append(max(sim.simulate.last_traffic["bytes_sent"]) / size)
    fig, ax = plt.subplots(figsize=(7, 3.3))
    ax.plot(ranks, root, "o-", color=ALGORITHMS["naive"], label="naive: the root (a parameter server)")
    ax.plot(ranks, others, "o:", color=ALGORITHMS["naive"], label="naive: every other rank")
    ax.plot(ranks, ring, "s-", color=ALGORITHMS["ring"], label="ring: every rank")
    fine = np.linspace(2, 8, 100)
    ax.plot(fine, 2 * (fine - 1) / fine, "--", color=INK, lw=0.8, label="2(N−1)/N")
    ax.set(xlabel="ranks N", ylabel="bytes sent per rank / S",
           title="One all-reduce of S bytes, simulated rank by rank (comm.sim)")
    ax.legend(loc="upper left")
    return fig


@figure(2, "## Speed-up and scaling efficiency (加速比与扩展效率)",
        caption="Strong-scaling efficiency of data parallelism, E(N) = T_c / (T_c + N·T_ring(N)), for the "
                "demo GPT's gradient: the less compute a step has to hide the all-reduce behind, the sooner "
                "the efficiency falls.",
        alt="A line chart of scaling efficiency in percent against the number of ranks from 1 to 64 on a "
            "logarithmic axis, three falling curves for a serial step of 10 ms, 100 ms and 1 s. The 1 s curve "
            "stays above 70 percent; the 100 ms curve falls to about 20 percent at 64 ranks; the 10 ms curve "
            "falls below 50 percent already at 4 ranks.")
def ch02_scaling_efficiency():
    nbytes = 4 * memory.param_count(DEMO)
    ranks = np.arange(1, 65)
    fig, ax = plt.subplots(figsize=(7, 3.3))
    for compute, color in ((1.0, KIND["compute"]), (0.1, KIND["comm"]), (0.01, ALGORITHMS["naive"])):
        ring = np.array([cost.predict("all_reduce", "ring", int(n), nbytes, **cost.AUTO_COST) for n in ranks])
        ax.plot(ranks, 100 * compute / (compute + ranks * ring), color=color,
                label=f"T_c = {compute * 1e3:g} ms of compute on one rank")
    ax.set_xscale("log", base=2)
    log_ticks(ax.xaxis, [1, 2, 4, 8, 16, 32, 64])
    ax.set(xlabel="ranks N", ylabel="efficiency E(N) (%)", ylim=(0, 103),
           title=f"Demo GPT gradient ({nbytes / MB:.2f} MB), ring all-reduce, α = 20 µs, β = 0.5 ns/B")
    ax.legend(loc="lower left")
    return fig
