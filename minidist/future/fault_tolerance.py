"""Failures at thousands of GPUs, and how often to checkpoint (chapter 11).

A synchronous job stops when any one of its devices fails, so its mean time between failures is
a device's divided by their number: with G devices, each failing on average once in M_gpu hours,

    failures per day = 24 G / M_gpu,        M_job = M_gpu / G.

The job writes a checkpoint every tau seconds of work, each costing C seconds; a failure costs a
restart R and the work since the last checkpoint, on average tau / 2. Per second of progress the
share lost is then, to first order (tau, C, R small against M_job),

    lost(tau) = C / tau + (tau / 2 + R) / M_job,

smallest where its derivative -C / tau^2 + 1 / (2 M_job) is zero (Young 1974; Daly 2006 adds
higher-order terms):

    tau* = sqrt(2 C M_job),        lost(tau*) = sqrt(2 C / M_job) + R / M_job.

These are formulas and a table, evaluated in one process; minidist's own checkpoints
(minidist/training/checkpoint.py) are written atomically and reload on any layout, which is what
an elastic restart on fewer devices needs.
"""
from __future__ import annotations

import math

HOUR, DAY = 3600.0, 86400.0


def failures_per_day(gpus: int, gpu_mtbf_hours: float) -> float:
    """Expected failures of the whole job per day: G devices, each failing once in M_gpu hours."""
    return gpus * 24.0 / gpu_mtbf_hours


def job_mtbf_seconds(gpus: int, gpu_mtbf_hours: float) -> float:
    """The job's mean time between failures: any one device stops it."""
    return gpu_mtbf_hours * HOUR / gpus


def young_daly_interval(checkpoint_s: float, job_mtbf_s: float) -> float:
    """Seconds of work between checkpoints that lose the least: sqrt(2 C M_job)."""
    if checkpoint_s <= 0 or job_mtbf_s <= 0:
        raise ValueError(f"checkpoint cost and MTBF must be positive; got C={checkpoint_s}, M={job_mtbf_s}")
    return math.sqrt(2.0 * checkpoint_s * job_mtbf_s)


def lost_fraction(interval_s: float, checkpoint_s: float, restart_s: float, job_mtbf_s: float) -> float:
    """First-order share of the time lost: checkpoints C / tau, and per failure (tau / 2 + R) / M_job."""
    return checkpoint_s / interval_s + (interval_s / 2.0 + restart_s) / job_mtbf_s


def table(gpu_counts, gpu_mtbf_hours: float, checkpoint_s: float, restart_s: float) -> list[dict]:
    """One row per job size: failures per day, the job's MTBF, the best interval and what is lost."""
    rows = []
    for gpus in gpu_counts:
        mtbf = job_mtbf_seconds(gpus, gpu_mtbf_hours)
        tau = young_daly_interval(checkpoint_s, mtbf)
        rows.append({"gpus": gpus, "failures_per_day": failures_per_day(gpus, gpu_mtbf_hours),
                     "job_mtbf_h": mtbf / HOUR, "interval_min": tau / 60.0,
                     "lost": lost_fraction(tau, checkpoint_s, restart_s, mtbf)})
    return rows
