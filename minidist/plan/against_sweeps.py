"""The planner against the trade-offs Narayanan et al. measured (chapter 9): does it choose as they found?

`python -m minidist.plan.against_sweeps` prints every claim and the planner's side of it.

Each sweep of `published_sweeps.py` turns one knob on one model; the paper states in a sentence
what its bars showed. `predictions` runs each point through `predict`, set up exactly as
`against_published` sets up the paper's Table 1 (Megatron-LM's fp16 states, its own data
parallelism after backward, full recomputation unless the point turns it off), and `claims` splits
each sentence into the orderings it asserts, each checked against the predictions:

    Claim(figure="Figure 13", says="peak at tp = 8 (one node) at every batch", holds=True,
          planner="batch 32: tp 2 99, 4 134, 8 157, 16 85, 32 47 TFLOP/s, best tp 8; batch 128: ...")

A claim that does not hold is a place where the planner's landscape differs from the measured
one; chapter 9 explains each.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from minidist.plan.against_published import cluster_of, stated_layout, workload_of
from minidist.plan.predict import predict
from minidist.plan.published import MEGATRON_FP16_STATE_BYTES, PublishedRun
from minidist.plan.published_sweeps import (FIGURE_11, FIGURE_12, FIGURE_13, FIGURE_14, FIGURE_15, FIGURE_16,
                                            FIGURE_17, SWEEPS, PublishedSweep, SweepPoint)


@dataclass(frozen=True)
class Claim:
    figure: str     # "Figure 13"
    says: str       # one ordering the paper's sentence asserts, in minidist's words
    holds: bool     # do the planner's predictions show it?
    planner: str    # what the planner predicts, in numbers


def as_run(sweep: PublishedSweep, point: SweepPoint) -> PublishedRun:
    """A point as a run of `published.py`, so that it is set up for the planner as Table 1 is (its
    speed, which the figure does not print as a number, left at 0)."""
    return PublishedRun(
        name=f"{sweep.name}, tp {point.tp} pp {point.pp} dp {point.dp}, batch {point.global_batch}",
        source=sweep.source, device="a100-80gb", gpus=point.gpus, gpus_per_node=8,
        n_layer=point.n_layer or sweep.n_layer, n_embd=sweep.n_embd, n_head=sweep.n_head, vocab_size=51200,
        seq=2048, global_batch=point.global_batch, tp=point.tp, pp=point.pp, dp=point.dp,
        micro_batch=point.micro_batch, zero=0, virtual_stages=point.virtual_stages, sequence_parallel=False,
        context_parallel=1, recompute="full" if point.recompute else "none", precision="mixed",
        tflops_per_gpu=0.0, parameters=None, state_bytes=MEGATRON_FP16_STATE_BYTES, ddp="local")


def predictions(sweep: PublishedSweep, **changes) -> dict[SweepPoint, dict]:
    """Each point's prediction (`predict`), with `sequences_per_second` added. `changes` replace
    fields of the cluster (a what-if: `rails=8`, `memory=70e9`)."""
    out = {}
    for point in sweep.points:
        run = as_run(sweep, point)
        p = predict(workload_of(run), stated_layout(run), dataclasses.replace(cluster_of(run), **changes))
        out[point] = {**p, "sequences_per_second": point.global_batch / p["step_seconds"]}
    return out


def _by_batch(predicted: dict, key=lambda point: point) -> dict[int, dict]:
    """{batch: {key(point): TFLOP/s per GPU}} over the points that fit."""
    table: dict[int, dict] = {}
    for point, p in predicted.items():
        if p["fits"]:
            table.setdefault(point.global_batch, {})[key(point)] = p["tflops_per_device"]
    return {b: dict(sorted(row.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))) for b, row in table.items()}


def _falls(values: list[float]) -> bool:
    return all(a > b for a, b in zip(values, values[1:]))


def _row(speeds: dict) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in speeds.items())


def figure_11(predicted) -> list[Claim]:
    by = _by_batch(predicted, key=lambda point: point.pp)
    small, large = by[8], by[128]
    kept = {b: row[8] / row[1] for b, row in by.items()}  # throughput kept from 1 to 8 stages
    shown = "; ".join(f"batch {b}: pp {_row(row)} TFLOP/s" for b, row in by.items())
    return [Claim("Figure 11", "batch 128 faster than batch 8 at every pipeline size",
                  all(large[p] > small[p] for p in small), shown),
            Claim("Figure 11", "batch 128 scales better: keeps more of its speed from 1 to 8 stages",
                  kept[128] > kept[8], f"8 stages keep {kept[8]:.0%} (batch 8) and {kept[128]:.0%} (batch 128)")]


def figure_12(predicted) -> list[Claim]:
    by = _by_batch(predicted, key=lambda point: point.virtual_stages)
    gain = {b: row[4] / row[None] for b, row in by.items()}
    shown = ", ".join(f"batch {b}: {g:.2f}x" for b, g in gain.items())
    return [Claim("Figure 12", "interleaved faster than 1F1B at every batch", all(g > 1 for g in gain.values()),
                  f"interleaved / 1F1B: {shown}"),
            Claim("Figure 12", "the gap closes as the batch grows", _falls(list(gain.values())), shown)]


def _peaks_at(figure: str, predicted, knob: str, expected: int, says: str) -> Claim:
    """At every batch of the sweep, the fastest value of `knob` (a SweepPoint field) is `expected`."""
    by = _by_batch(predicted, key=lambda point: getattr(point, knob))
    name = knob.replace("_", "-")
    best = {b: max(row, key=row.get) for b, row in by.items()}
    return Claim(figure, says, all(v == expected for v in best.values()),
                 "; ".join(f"batch {b}: {name} {_row(row)} TFLOP/s, best {name} {best[b]}" for b, row in by.items()))


def _falls_with(figure: str, predicted, knob: str, says: str) -> Claim:
    """At every batch of the sweep, each larger value of `knob` is slower."""
    by = _by_batch(predicted, key=lambda point: getattr(point, knob))
    return Claim(figure, says, all(_falls(list(row.values())) for row in by.values()),
                 "; ".join(f"batch {b}: {knob} {_row(row)} TFLOP/s" for b, row in by.items()))


def figure_13(predicted) -> list[Claim]:
    return [_peaks_at("Figure 13", predicted, "tp", 8, "peak at tp = 8 (one node) at every batch")]


def figure_14(predicted) -> list[Claim]:
    return [_falls_with("Figure 14", predicted, "pp", "at every batch, slower as the pipeline deepens (pp 2 to 32)")]


def figure_15(predicted) -> list[Claim]:
    by = _by_batch(predicted, key=lambda point: point.tp)
    across = all(max(row[16], row[32]) < min(v for t, v in row.items() if t <= 8) for row in by.values())
    grows = _falls_with("Figure 15", predicted, "tp", "at every batch, slower as tp grows (tp 2 to 32)")
    return [Claim("Figure 15", "tp across nodes (16, 32) slower than every tp inside one at every batch", across,
                  grows.planner), grows]


def figure_16(predicted) -> list[Claim]:
    return [_peaks_at("Figure 16", predicted, "micro_batch", 2, "micro-batch 2 the fastest at batch 128 and 512")]


def figure_17(predicted) -> list[Claim]:
    rate = {(point.global_batch, point.recompute): p["sequences_per_second"] if p["fits"] else None
            for point, p in predicted.items()}
    batches = sorted({b for b, _ in rate})
    both = [b for b in batches if rate[b, True] and rate[b, False]]
    cost = [1 - rate[b, True] / rate[b, False] for b in both]
    without = [rate[b, False] for b in batches if rate[b, False]]
    unfit = [b for b in batches if rate[b, False] is None]
    ratio = max(r for (b, keep), r in rate.items() if keep and r) / max(without)
    largest = max((point for point in predicted if not point.recompute), key=lambda point: point.global_batch)
    largest = predicted[largest]["memory"]["peak"]  # without recomputation, at the largest batch
    return [Claim("Figure 17", "where both fit, recomputation costs a fifth to a third of the sequences/s",
                  bool(cost) and all(0.20 <= c <= 0.34 for c in cost),
                  f"{min(cost):.0%}" + ("" if f"{min(cost):.0%}" == f"{max(cost):.0%}" else f" to {max(cost):.0%}")
                  + f" at every batch from {both[0]} to {both[-1]}"),
            Claim("Figure 17", "without recomputation the larger batches do not fit in memory",
                  bool(unfit) and all(rate[b, True] for b in unfit),
                  f"without recomputation batches {unfit} do not fit" if unfit else
                  f"without recomputation every batch fits (batch {batches[-1]}: {largest / 1e9:.1f} GB)"),
            Claim("Figure 17", "the best with recomputation about 2x (1.7-2.3x) the best without",
                  1.7 <= ratio <= 2.3, f"{ratio:.2f}x")]


CHECKS = {FIGURE_11: figure_11, FIGURE_12: figure_12, FIGURE_13: figure_13, FIGURE_14: figure_14,
          FIGURE_15: figure_15, FIGURE_16: figure_16, FIGURE_17: figure_17}


def claims(sweeps=SWEEPS, **changes) -> list[Claim]:
    """Every claim of every sweep, checked against the planner's predictions (about a second);
    `changes` as in `predictions`."""
    return [claim for sweep in sweeps for claim in CHECKS[sweep](predictions(sweep, **changes))]


def table(found: list[Claim]) -> str:
    lines = [f"{'figure':<10}{'holds':<7}{'the paper found':<76}the planner predicts"]
    lines += [f"{c.figure:<10}{'yes' if c.holds else 'NO':<7}{c.says:<76}{c.planner}" for c in found]
    lines.append(f"{sum(c.holds for c in found)} of {len(found)} claims hold")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print("usage: python -m minidist.plan.against_sweeps (no options)", file=sys.stderr)
        return 2
    print(table(claims()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
