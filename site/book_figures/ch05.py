"""The figures of chapter 5 (pipeline parallelism)."""
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from minidist.parallel import schedules as S
from book_figures.common import (figure, gantt, INK, KIND, kind_patches, legend_below, lighter, log_ticks,
    RANKS)


@figure(5, "## 2. Schedules as data",
        caption="GPipe and 1F1B for p = 4 stages and m = 8 micro-batches, simulated with ideal timings: the "
                "same step length and the same bubble, in a different order.",
        alt="Two Gantt charts with four rows each. GPipe: each rank runs forwards 0 to 7 in blue, staggered "
            "one slot per rank, then backwards 0 to 7 in orange, staggered back; grey idle at the start of the "
            "lower ranks and the end of the upper ones. 1F1B: rank r runs p − r − 1 forwards, then alternates "
            "one forward and one backward, then the remaining backwards; it ends at the same time as GPipe.")
def ch05_gpipe_and_1f1b():
    p, m = 4, 8
    fig, axes = plt.subplots(2, 1, figsize=(7, 4.6), sharex=True)
    for ax, name in zip(axes, ("gpipe", "1f1b")):
        events = S.simulate(S.all_ranks(name, p, m))
        label = "GPipe" if name == "gpipe" else "1F1B"
        gantt(ax, events, title=f"{label}: bubble {S.bubble_fraction(events):.3f} = (p − 1)/(m + p − 1)")
    axes[-1].set_xlabel("time (forward = 1, backward = 2; numbers are micro-batches)")
    legend_below(fig, kind_patches(["forward", "backward", "wait"]))
    return fig


@figure(5, "## 3. The bubble",
        caption="The bubble against the number of micro-batches, in minidist's definition (idle share of the "
                "step, left) and Megatron-LM's (idle over compute, right); the simulated schedules lie on the "
                "formula.",
        alt="Two line charts against micro-batches m from 1 to 32 on a logarithmic axis, one curve each for "
            "p = 2, 4 and 8 stages. Left: b = (p − 1)/(m + p − 1) falls from (p − 1)/p at m = 1 towards zero, "
            "with dots from simulated 1F1B schedules exactly on the curves. Right: β = (p − 1)/m on a "
            "logarithmic scale, straight falling lines that start above 1 for p = 4 and 8.")
def ch05_bubble():
    ms = np.arange(1, 33)
    dots = [1, 2, 4, 8, 16, 32]
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.3))
    for p, color in zip((2, 4, 8), (RANKS[0], RANKS[1], RANKS[2])):
        b = np.array([S.bubble_theory(p, int(m)) for m in ms])
        left.plot(ms, b, color=color, label=f"p = {p}")
        simulated = [S.bubble_fraction(S.simulate(S.all_ranks("1f1b", p, m))) for m in dots]
        left.plot(dots, simulated, "o", color=color, ms=4)
        right.plot(ms, b / (1 - b), color=color, label=f"p = {p}")
    left.set(xscale="log", xlabel="micro-batches m", ylabel="b = (p − 1)/(m + p − 1)",
             title="idle share of the step (dots: simulated 1F1B)")
    right.set(xscale="log", yscale="log", xlabel="micro-batches m", ylabel="β = b/(1 − b) = (p − 1)/m",
              title="idle time over compute time")
    log_ticks(right.yaxis, [0.03, 0.1, 0.3, 1, 3, 7])
    for ax in (left, right):
        log_ticks(ax.xaxis, dots)
        ax.legend()
    return fig


def _held(events):
    """Micro-batches whose activations a rank holds over time: from a forward's start to its backward's end."""
    changes: dict[float, int] = {}  # a backward ending as the next forward starts: no dip in between
    for name, kind, start, end in events:
        if kind == "forward":
            changes[start] = changes.get(start, 0) + 1
        elif kind == "backward":
            changes[end] = changes.get(end, 0) - 1
    times, held, count = [0.0], [0], 0
    for t in sorted(changes):
        count += changes[t]
        times.append(t)
        held.append(count)
    return times, held


@figure(5, "## 4. Activation memory: where GPipe and 1F1B differ",
        caption="Micro-batches whose activations each stage holds during the step (p = 4, m = 8): GPipe holds "
                "all 8 on every stage, 1F1B at most p − r on stage r.",
        alt="Four small step charts side by side, one per rank, of micro-batches held against time, each with "
            "a dashed GPipe line and a solid 1F1B line. On every rank the GPipe line climbs to 8 during the "
            "forwards and steps back down to 0 during the backwards. The 1F1B line climbs only to 4 on rank 0, "
            "3 on rank 1, 2 on rank 2 and 1 on rank 3, and stays there through the steady state before stepping "
            "down.")
def ch05_in_flight():
    p, m = 4, 8
    runs = {name: (S.all_ranks(name, p, m), S.simulate(S.all_ranks(name, p, m))) for name in ("gpipe", "1f1b")}
    fig, axes = plt.subplots(1, p, figsize=(7, 2.8), sharey=True, sharex=True)
    for rank, ax in enumerate(axes):
        peaks = []
        for name, style in (("gpipe", "--"), ("1f1b", "-")):
            schedules, events = runs[name]
            times, held = _held(events[rank])
            ax.step(times, held, where="post", ls=style, lw=1.6, color=INK if name == "gpipe" else RANKS[rank])
            peaks.append(S.peak_in_flight(schedules[rank]))
        ax.set_title(f"rank {rank}: {peaks[0]} vs {peaks[1]}", fontsize=8.5)
        ax.set_xlabel("time")
    axes[0].set_ylabel("micro-batches held")
    axes[0].set_ylim(0, m + 0.8)
    legend_below(fig, [Line2D([], [], color=INK, ls="--", label="GPipe"),
                       Line2D([], [], color=RANKS[0], label="1F1B (forward = 1, backward = 2)")])
    return fig


@figure(5, "## 5. Why the warm-up is p − rank − 1",
        caption="1F1B with one warm-up forward fewer, the right number, and one more (p = 4, m = 8): fewer "
                "leaves stages waiting for their first gradient, more only holds more activations.",
        alt="Three Gantt charts of four ranks. With warm-up p − r − 2 the ranks show long grey idle gaps in "
            "the middle of the step and it ends far later. With p − r − 1 the steady state alternates forward "
            "and backward with idle time only at the start and end. With p − r the chart ends at the same time "
            "as the middle one, each rank having run one more forward before its first backward.")
def ch05_warmup():
    p, m = 4, 8
    fig, axes = plt.subplots(3, 1, figsize=(7, 6.0), sharex=True)
    warmups = ((-1, "p − r − 2 (one fewer)"), (0, "p − r − 1"), (1, "p − r (one more)"))
    for ax, (delta, label) in zip(axes, warmups):
        schedules = [list(S.one_f_one_b(r, p, m, warmup=max(0, p - r - 1 + delta))) for r in range(p)]
        events = S.simulate(schedules)
        held = ", ".join(str(S.peak_in_flight(s)) for s in schedules)
        gantt(ax, events, title=f"warm-up {label}: bubble {S.bubble_fraction(events):.3f}, micro-batches held {held}")
    axes[-1].set_xlabel("time (forward = 1, backward = 2)")
    legend_below(fig, kind_patches(["forward", "backward", "wait"]))
    return fig


@figure(5, "## 7. Interleaved 1F1B: virtual stages (虚拟流水线阶段)",
        caption="1F1B against interleaved 1F1B with v = 2 chunks per rank (p = 4, m = 8): each rank does the "
                "same work in half-size slots, and the idle stretches at the start and the end are halved.",
        alt="Two Gantt charts of four ranks on one time axis. The 1F1B chart has stage-sized blue and orange "
            "bars with grey idle wedges at the start and end. The interleaved chart has bars half as long, the "
            "second chunk's bars in lighter shades, weaving forwards and backwards of both chunks; its idle "
            "wedges are half as wide and the whole step ends earlier.")
def ch05_interleaved():
    p, m, v = 4, 8, 2
    runs = {"1F1B": S.simulate(S.all_ranks("1f1b", p, m)),
            f"interleaved, v = {v}": S.simulate(S.all_ranks("interleaved", p, m, v), forward=1 / v, backward=2 / v)}
    fig, axes = plt.subplots(2, 1, figsize=(7, 4.6), sharex=True)
    for ax, (label, events) in zip(axes, runs.items()):
        gantt(ax, events, title=f"{label}: bubble {S.bubble_fraction(events):.3f} = "
                                f"(p − 1)/(v·m + p − 1)")
    axes[-1].set_xlabel("time (a whole stage's forward = 1, backward = 2; a chunk's take 1/v)")
    legend_below(fig, kind_patches(["forward", "backward", "wait"])
                 + [Patch(color=lighter(KIND["forward"], 0.45), label="chunk 1 (lighter)")])
    return fig


@figure(5, "## 7. Interleaved 1F1B: virtual stages (虚拟流水线阶段)",
        caption="The interleaved bubble (p − 1)/(v·m + p − 1) for p = 4: v chunks per rank act like v times as "
                "many micro-batches, and the simulated schedules give exactly the formula.",
        alt="A line chart of the bubble against micro-batches m = 4 to 32 for p = 4 stages, three falling "
            "curves for v = 1, 2 and 3 chunks per rank, each lower than the one before, with dots from simulated "
            "schedules exactly on them.")
def ch05_interleaved_bubble():
    p = 4
    ms = np.arange(p, 33, p)
    fig, ax = plt.subplots(figsize=(7, 3.1))
    for v, color in zip((1, 2, 3), (RANKS[0], RANKS[1], RANKS[2])):
        name = "1f1b" if v == 1 else "interleaved"
        ax.plot(ms, [S.bubble_theory(p, int(m), v) for m in ms], color=color,
                label="1F1B (v = 1)" if v == 1 else f"interleaved, v = {v}")
        simulated = [S.bubble_fraction(S.simulate(S.all_ranks(name, p, int(m), v), forward=1 / v, backward=2 / v))
                     for m in ms]
        ax.plot(ms, simulated, "o", color=color, ms=4)
    ax.set(xlabel="micro-batches m (a multiple of p)", ylabel="bubble (idle share of the step)",
           title=f"p = {p}: formula (lines) and simulated schedules (dots)", ylim=(0, None))
    ax.set_xticks(ms)
    ax.legend()
    return fig
