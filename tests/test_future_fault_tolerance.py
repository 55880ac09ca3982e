"""Failures per day, Young/Daly's checkpoint interval and the work lost (chapter 11)."""
import math

import pytest

from minidist.future.fault_tolerance import (failures_per_day, job_mtbf_seconds, lost_fraction, table,
                                             young_daly_interval)

LLAMA3_GPU_MTBF_H = 16_384 * 54 * 24 / 419  # 419 unexpected interruptions in 54 days on 16,384 GPUs


def test_failures_scale_with_the_devices():
    assert LLAMA3_GPU_MTBF_H == pytest.approx(50_677, abs=0.5)
    assert failures_per_day(16_384, LLAMA3_GPU_MTBF_H) == pytest.approx(419 / 54)
    assert job_mtbf_seconds(16_384, LLAMA3_GPU_MTBF_H) / 3600 == pytest.approx(54 * 24 / 419)
    assert failures_per_day(1, 50_000) * 365 == pytest.approx(0.1752)


def test_young_daly_interval_minimises_the_loss():
    c, r, m = 60.0, 300.0, 3 * 3600.0
    tau = young_daly_interval(c, m)
    assert tau == pytest.approx(math.sqrt(2 * c * m)) and tau == pytest.approx(1138.4, abs=0.1)
    best = lost_fraction(tau, c, r, m)
    assert best == pytest.approx(math.sqrt(2 * c / m) + r / m)
    for other in (0.5 * tau, 0.9 * tau, 1.1 * tau, 2 * tau):
        assert lost_fraction(other, c, r, m) > best


def test_table():
    rows = table([1024, 16_384, 100_000], 50_000, checkpoint_s=60, restart_s=300)
    assert [round(row["failures_per_day"], 2) for row in rows] == [0.49, 7.86, 48.0]
    assert [round(row["job_mtbf_h"], 2) for row in rows] == [48.83, 3.05, 0.5]
    assert [round(row["interval_min"], 1) for row in rows] == [76.5, 19.1, 7.7]
    assert [round(100 * row["lost"], 1) for row in rows] == [2.8, 13.2, 42.5]


def test_refuses_nonsense():
    with pytest.raises(ValueError, match="positive"):
        young_daly_interval(0, 100)
