"""The machine-speed probe beside bench plan's runs (minidist/bench/_machine_speed.py): its workers
step a real serial model and end with it; the slowdown is the probes' mean over their median while the yardsticks were measured."""
import pytest

from minidist.bench._machine_speed import SpeedProbe, slowdown
from minidist.core.model import GPTConfig


def test_slowdown_is_the_mean_of_the_two_probes_over_the_calibrated():
    assert slowdown(0.040, 0.040, 0.040) == 1.0
    assert slowdown(0.050, 0.070, 0.040) == pytest.approx(1.5)  # (0.05 + 0.07) / 2 / 0.04
    with pytest.raises(ValueError, match="must be positive"):
        slowdown(0.05, 0.05, 0.0)


def test_the_probe_steps_a_model_in_each_worker_and_ends_with_them():
    config = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    with SpeedProbe(config, batch=2, workers=2) as probe:
        assert len(probe.processes) == 2 and all(p.is_alive() for p in probe.processes)
        times = [probe.seconds() for _ in range(3)]
        assert all(0 < t < 5 for t in times)  # a step of this model takes milliseconds; 5 s: it never came back
    assert not any(p.is_alive() for p in probe.processes)
