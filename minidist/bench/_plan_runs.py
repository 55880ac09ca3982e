"""Several recorded `bench plan` runs read as one: each layout's median (chapter 9).

    python -m minidist.bench plan --median-of run1.json run2.json run3.json [--json PATH]

One run of `bench plan` on a shared machine is one sample: a neighbour's job in the minute a
layout ran moves that layout's time, and a yardstick measured in a slow moment moves every
prediction made from it. The planner is judged on the median of three quiet runs: for each
layout the median over the runs of measured / predicted (each run's prediction comes from its
own calibration), and the median of the runs' Spearman correlations. Nothing is measured here;
the files are the JSON that `bench plan --json` wrote.
"""
from __future__ import annotations

import json
import statistics

import numpy as np

WITHIN = 0.25  # a prediction within 25 % of the measured step time counts as a hit


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties share their mean rank)."""
    def ranks(values):
        values = np.asarray(values, dtype=float)
        order = np.argsort(values, kind="stable")
        r = np.empty(len(values))
        r[order] = np.arange(1, len(values) + 1)
        for v in np.unique(values):  # ties: the mean of the ranks they span
            r[values == v] = r[values == v].mean()
        return r

    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman needs two sequences of the same length >= 2, got {len(x)} and {len(y)}")
    a, b = ranks(x), ranks(y)
    a, b = a - a.mean(), b - b.mean()
    denominator = np.sqrt((a @ a) * (b @ b))
    return float(a @ b / denominator) if denominator else float("nan")


def within(measured: float, predicted: float) -> bool:
    return abs(measured / predicted - 1) <= WITHIN


def load_run(path: str) -> dict[str, dict]:
    """A `bench plan --json` file as {layout name: its record}; anything else fails in one line."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable as JSON ({error})") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: not a list of records as `bench plan --json` writes")
    layouts = {e["layout"]: e for e in entries if e.get("kind") == "layout"}
    if not layouts:
        raise ValueError(f"{path}: no layout records (a `bench plan --calibrate` file, or not bench plan's?)")
    for name, e in layouts.items():
        if not (e.get("predicted_step_seconds", 0) > 0 and e.get("measured_step_seconds", 0) > 0):
            raise ValueError(f"{path}: layout {name} lacks a positive predicted and measured step time")
    return layouts


def median_of_runs(runs: list[dict[str, dict]]) -> dict:
    """Each layout run in every one of `runs` (as `load_run` reads them): the median over the runs
    of its measured / predicted ratio, measured and predicted step time, and bubble where it has
    one; and the correlations: each run's Spearman, their median, and the Spearman of the
    per-layout median times."""
    if len(runs) < 2:
        raise ValueError(f"a median needs at least 2 runs, got {len(runs)}")
    names = sorted(set.intersection(*(set(r) for r in runs)), key=lambda n: statistics.median(
        r[n]["predicted_step_seconds"] for r in runs))
    if len(names) < 2:
        raise ValueError(f"the runs share {len(names)} layout(s); a correlation needs 2 (run with the same --ranks?)")
    layouts = []
    for name in names:
        records = [r[name] for r in runs]
        ratios = [e["measured_step_seconds"] / e["predicted_step_seconds"] for e in records]
        row = {"layout": name, "ratios": ratios, "ratio": statistics.median(ratios),
               "predicted_step_seconds": statistics.median(e["predicted_step_seconds"] for e in records),
               "measured_step_seconds": statistics.median(e["measured_step_seconds"] for e in records)}
        bubbles = [e["bubble"] for e in records if e.get("bubble") and e["bubble"].get("measured") is not None]
        if len(bubbles) == len(records):
            row["bubble"] = {key: statistics.median(b[key] for b in bubbles)
                             for key in ("measured", "predicted", "theory")}
        layouts.append(row)
    each = [spearman([r[n]["predicted_step_seconds"] for n in names], [r[n]["measured_step_seconds"] for n in names])
            for r in runs]
    return {"runs": len(runs), "layouts": layouts, "left_out": sorted(set.union(*(set(r) for r in runs)) - set(names)),
            "spearman_each": each, "spearman": statistics.median(each),
            "spearman_of_medians": spearman([row["predicted_step_seconds"] for row in layouts],
                                            [row["measured_step_seconds"] for row in layouts]),
            "within_25_percent": sum(abs(row["ratio"] - 1) <= WITHIN for row in layouts),
            "within_25_percent_each": [sum(within(r[n]["measured_step_seconds"], r[n]["predicted_step_seconds"])
                                           for n in names) for r in runs]}


def print_median(summary: dict) -> None:
    print(f"{'layout':<34} {'measured / predicted, each run':>34} {'median':>7}")
    for row in summary["layouts"]:
        each = " ".join(f"{x:6.2f}" for x in row["ratios"])
        mark = "" if abs(row["ratio"] - 1) <= WITHIN else "  outside 25 %"
        print(f"{row['layout']:<34} {each:>34} {row['ratio']:7.2f}{mark}")
    for row in summary["layouts"]:
        if "bubble" in row:
            b = row["bubble"]
            print(f"  bubble {row['layout']}: median measured {b['measured']:.3f}, predicted {b['predicted']:.3f}, "
                  f"formula {b['theory']:.3f}")
    if summary["left_out"]:
        print(f"left out (not run in every run): {', '.join(summary['left_out'])}")
    n = len(summary["layouts"])
    print(f"{summary['runs']} runs, {n} layouts in each: Spearman "
          + ", ".join(f"{rho:.3f}" for rho in summary["spearman_each"])
          + f" (median {summary['spearman']:.3f}; of the median times {summary['spearman_of_medians']:.3f}); "
          f"within 25 % in each run: {', '.join(str(k) for k in summary['within_25_percent_each'])} of {n}; "
          f"the median ratio within 25 % on {summary['within_25_percent']} of {n}")
