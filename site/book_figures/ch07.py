"""The figures of chapter 7 (communication primitives)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from minidist.comm import algorithms as alg, cost, sim
from minidist.plan.hardware import PRESETS as DEVICES
from book_figures.common import (ALGORITHM_NAMES, ALGORITHMS, figure, GB, INK, legend_below, log_ticks,
    size_label)


@figure(7, "## All-reduce, five ways",
        caption="The ring all-reduce on 4 ranks, step by step in the simulated world, each rank starting with "
                "2^r: a cell's binary value lists the ranks it contains, and after step 3 rank r owns the full "
                "chunk r, after step 6 everyone owns everything.",
        alt="Seven small four-by-four tables, rows ranks 0 to 3 and columns chunks 0 to 3, each cell showing "
            "a 4-bit binary number and shaded by how many ranks it contains. The top row of tables, the "
            "reduce-scatter, shows the start and steps 1 to 3: at the start every cell of rank r holds the one "
            "bit of rank r; step by step cells gain bits along diagonals until each rank's own chunk reads 1111. "
            "The bottom row, the all-gather, shows steps 4 to 6: the complete 1111 values spread until every "
            "cell is 1111 and darkest.")
def ch07_ring_steps():
    n = 4
    snapshots = sim.simulate(alg.all_reduce_ring, [np.full(n, 2 ** r, dtype=np.int64) for r in range(n)], np.add)
    cmap = ListedColormap(["#edf8e9", "#bae4b3", "#74c476", "#238b45"])
    rows = [(range(0, n), "reduce-scatter: each chunk collects one rank per step"),
            (range(n, 2 * n - 1), "all-gather: the complete chunks go round")]
    fig, axes = plt.subplots(2, 1, figsize=(7, 4.4))
    gap = n + 1.2
    for ax, (steps, label) in zip(axes, rows):
        ax.set_axis_off()
        for i, k in enumerate(steps):
            for r, array in enumerate(snapshots[k]):
                for c, value in enumerate(array):
                    bits = bin(int(value)).count("1")
                    ax.add_patch(Rectangle((i * gap + c, r), 1, 1, facecolor=cmap(bits - 1), edgecolor="white", lw=1.2))
                    ax.text(i * gap + c + 0.5, r + 0.5, f"{int(value):04b}", ha="center", va="center", fontsize=7,
                            color="white" if bits == 4 else INK)
            ax.text(i * gap + n / 2, -0.25, "start" if k == 0 else f"after step {k}", ha="center", va="bottom",
                    fontsize=8.5)
            for c in range(n):
                ax.text(i * gap + c + 0.5, n + 0.08, str(c), ha="center", va="top", fontsize=6.5, color="#666666")
        for r in range(n):
            ax.text(-0.15, r + 0.5, f"rank {r}", ha="right", va="center", fontsize=7.5)
        ax.text(-0.15, n + 0.08, "chunk", ha="right", va="top", fontsize=6.5, color="#666666")
        ax.text(-1.6, -0.9, label, ha="left", va="bottom", fontsize=9)
        ax.set_xlim(-1.6, n * gap)
        ax.set_ylim(n + 0.8, -1.1)
        ax.set_aspect("equal")
    legend_below(fig, [Patch(color=cmap(b), label=f"{b + 1} rank{'s' if b else ''} summed") for b in range(4)])
    return fig


COLLECTIVE_ALGORITHMS = {"naive": alg.all_reduce_naive, "tree": alg.all_reduce_tree,
                         "recursive_doubling": alg.all_reduce_recursive_doubling,
                         "halving_doubling": alg.all_reduce_halving_doubling, "ring": alg.all_reduce_ring}


@figure(7, "### Why the ring sends 2(N-1)/N · S per rank, and why that is optimal",
        caption="Bytes sent by the busiest rank in one all-reduce of S bytes, counted in the simulated world "
                "for 2 to 8 ranks: only the ring (and halving-doubling, when N is a power of two) reaches the "
                "lower bound 2(N−1)/N.",
        alt="A line chart of the busiest rank's bytes sent divided by S against the number of ranks from 2 to "
            "8, one line per algorithm. Naive climbs straight from 1 to 7. Tree and recursive doubling coincide, "
            "stepping up with log2 of N from 1 to 3. Halving-doubling touches the dashed lower bound at 2, 4 and 8 "
            "ranks and rises above it in between. The ring lies on the dashed bound 2(N−1)/N everywhere.")
def ch07_bytes_per_rank():
    count, ranks = 840, np.arange(2, 9)
    size = count * 8
    fig, ax = plt.subplots(figsize=(7, 3.4))
    styles = {"tree": dict(lw=4, alpha=0.6), "recursive_doubling": dict(ls="--")}  # the two coincide
    for name, function in COLLECTIVE_ALGORITHMS.items():
        busiest = []
        for n in ranks:
            sim.simulate(function, [np.ones(count) for _ in range(n)], np.add)
            busiest.append(max(sim.simulate.last_traffic["bytes_sent"]) / size)
        ax.plot(ranks, busiest, marker="o", color=ALGORITHMS[name], label=ALGORITHM_NAMES[name], ms=4,
                **styles.get(name, {}))
    fine = np.linspace(2, 8, 100)
    ax.plot(fine, 2 * (fine - 1) / fine, "--", color=INK, lw=0.9, label="lower bound 2(N−1)/N")
    ax.set(xlabel="ranks N", ylabel="busiest rank's bytes sent / S",
           title="One all-reduce of S bytes, simulated rank by rank (comm.sim)")
    ax.legend(loc="upper left", ncols=2)
    return fig


@figure(7, "## The α-β cost model",
        caption="Every all-reduce algorithm's predicted time relative to the fastest, over array sizes from a "
                "byte to a gigabyte: fewest steps wins small arrays, fewest bytes wins large ones.",
        alt="Two line charts for 4 and 32 ranks of predicted time divided by the fastest algorithm's, against "
            "the array size from 1 byte to 1 GB on a logarithmic axis. For small arrays recursive doubling is "
            "at 1 and the ring and naive are several times slower; for large arrays halving-doubling and the "
            "ring reach 1 while recursive doubling, the tree and naive are from 1.5 to about 30 times slower. A "
            "dotted vertical line marks where halving-doubling overtakes recursive doubling.")
def ch07_alpha_beta():
    sizes = np.logspace(0, 9, 200)
    fig, axes = plt.subplots(1, 2, figsize=(7, 3.4), sharey=True)
    for ax, n in zip(axes, (4, 32)):
        times = {name: np.array([cost.predict("all_reduce", name, n, s, **cost.AUTO_COST) for s in sizes])
                 for name in COLLECTIVE_ALGORITHMS}
        best = np.min(np.stack(list(times.values())), axis=0)
        for name, t in times.items():
            ax.plot(sizes, t / best, color=ALGORITHMS[name], label=ALGORITHM_NAMES[name])
        at = cost.crossover("all_reduce", "halving_doubling", "recursive_doubling", n, **cost.AUTO_COST)
        ax.axvline(at, color=INK, ls=":", lw=0.8)
        ax.text(at * 1.3, 40, f"{at / 1e3:.0f} KB", fontsize=7.5)
        ax.set(xscale="log", yscale="log", xlabel="array size S", title=f"N = {n} ranks", ylim=(0.9, 100))
        log_ticks(ax.xaxis, [1, 1e3, 1e6, 1e9], ["1 B", "1 KB", "1 MB", "1 GB"])
        log_ticks(ax.yaxis, [1, 2, 5, 10, 20, 50, 100])
    axes[0].set_ylabel("time / fastest algorithm's")
    fig.suptitle("Predicted by cost.predict with cost.AUTO_COST: α = 20 µs, β = 0.5 ns/B, γ = 0.1 ns/B",
                 fontsize=9.5, x=0.02, ha="left")
    legend_below(fig, [Line2D([], [], color=ALGORITHMS[k], label=ALGORITHM_NAMES[k]) for k in COLLECTIVE_ALGORITHMS])
    return fig


@figure(7, "### Its cost on two levels",
        caption="The flat ring against the hierarchical all-reduce on machines of 8 A100s (NVLink inside, the "
                "network between): the hierarchy pays the network's latency 2(L−1) times instead of 2(N−1), "
                "which decides small and medium arrays; for large ones the two meet.",
        alt="Two log-log line charts of predicted time. Left, against the array size from 1 KB to 10 GB on 4 "
            "machines of 8 GPUs: the hierarchical all-reduce is several times faster up to about a megabyte, "
            "and the two lines merge above about 100 MB. Right, against the number of machines from 2 to 64 for "
            "a 1 MB array: the flat ring's time grows steadily with the number of GPUs, the hierarchical one "
            "much more slowly.")
def ch07_two_level():
    device = DEVICES["a100-80gb"]
    per_node = device.gpus_per_node
    links = dict(alpha_inside=device.intra_latency, beta_inside=1 / device.intra_bandwidth,
                 alpha_between=device.inter_latency, beta_between=1 / device.inter_bandwidth)
    names = {"ring": "flat ring", "hierarchical": "hierarchical"}
    sizes = np.logspace(3, 10, 120)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.3))
    for name, label in names.items():
        left.plot(sizes, [cost.predict_two_level(name, per_node, 4, s, **links) for s in sizes],
                  color=ALGORITHMS[name], label=label)
    left.set(xscale="log", yscale="log", xlabel="array size S", ylabel="predicted time",
             title=f"4 machines × {per_node} GPUs, by the size")
    log_ticks(left.xaxis, [1e3, 1e5, 1e7, 1e9], [size_label(x) for x in (1e3, 1e5, 1e7, 1e9)])
    seconds = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1]
    labels = ["10 µs", "0.1 ms", "1 ms", "10 ms", "0.1 s", "1 s"]
    log_ticks(left.yaxis, seconds, labels)
    left.legend()
    machines = 2 ** np.arange(1, 7)
    for name, label in names.items():
        right.plot(machines, [cost.predict_two_level(name, per_node, int(L), 1e6, **links) for L in machines], "o-",
                   ms=4, color=ALGORITHMS[name], label=label)
    right.set(xscale="log", yscale="log", xlabel=f"machines L ({per_node} GPUs each)", ylabel="predicted time",
              title="1 MB, by the number of machines")
    log_ticks(right.xaxis, machines)
    log_ticks(right.yaxis, seconds[:4], labels[:4])
    right.legend()
    fig.suptitle(f"{device.name}: {device.intra_bandwidth / GB:.0f} GB/s inside a machine, "
                 f"{device.inter_bandwidth / GB:.0f} GB/s between (cost.predict_two_level)", fontsize=9.5,
                 x=0.02, ha="left")
    return fig
