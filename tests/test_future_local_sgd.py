"""Local SGD and DiLoCo (chapter 11): K in-process replicas, averaged every H steps."""
import numpy as np
import pytest

from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.core.optim import SGD
from minidist.core.tensor import default_dtype
from minidist.future.local_sgd import LocalSGD
from minidist.training.train import OptimSettings, SerialTrainer

CONFIG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)


def test_one_local_step_of_sgd_is_data_parallelism():
    """Averaging the weights after one plain SGD step averages the gradients: with H = 1 and SGD,
    local SGD is synchronous data parallelism, which is the serial step on the global batch."""
    settings = OptimSettings(lr=0.1, min_lr=0.1, warmup=0, steps=3, clip=0.0, weight_decay=0.0)
    with default_dtype("float64"):
        task = make_task("sort", 16, seed=0)
        serial = SerialTrainer(CONFIG, settings, task, 8)
        serial.optimizer = SGD(serial.model.parameters(), lr=0.1)
        local = LocalSGD(CONFIG, settings, task, 8, replicas=4, local_steps=1)
        for trainer in local.trainers:
            trainer.optimizer = SGD(trainer.model.parameters(), lr=0.1)
        serial_losses = [serial.step(s)[0] for s in range(3)]
        local_losses = [local.step(s) for s in range(3)]
    np.testing.assert_allclose(local_losses, serial_losses, rtol=1e-12)
    want = serial.state_dict()
    assert max(np.max(np.abs(local.model.state_dict()[n] - w)) for n, w in want.items()) < 1e-12
    assert local.rounds == 3


def test_replicas_drift_and_meet_again():
    with default_dtype("float64"):
        local = LocalSGD(CONFIG, OptimSettings(lr=1e-2, warmup=1, steps=8), make_task("sort", 16, seed=0), 8,
                         replicas=2, local_steps=4)
        losses = []
        for step in range(8):
            losses.append(local.step(step))
            a, b = (t.model.state_dict() for t in local.trainers)
            same = all(np.array_equal(a[n], b[n]) for n in a)
            assert same == ((step + 1) % 4 == 0)  # apart between rounds, equal right after each
    assert local.rounds == 2
    assert [round(x, 4) for x in losses] == [5.4812, 5.272, 5.0512, 4.8109, 4.6535, 4.5087, 4.4139, 4.3619]


def test_diloco_outer_step_is_nesterov_on_the_average():
    with default_dtype("float64"):
        local = LocalSGD(CONFIG, OptimSettings(lr=1e-2, warmup=1, steps=2), make_task("sort", 16, seed=0), 8,
                         replicas=2, local_steps=2, outer_lr=0.7, outer_momentum=0.9)
        start = [w.copy() for w in local.weights]
        for step in range(2):
            for trainer in local.trainers:
                trainer.step(step)
        replicas = [[p.data for p in t.model.parameters()] for t in local.trainers]
        average = [np.mean(arrays, axis=0) for arrays in zip(*replicas)]
        local.synchronise()
    for theta, before, mean, param in zip(local.weights, start, average, local.model.parameters()):
        delta = before - mean  # first round: buffer = delta, update = delta + 0.9 delta
        np.testing.assert_allclose(theta, before - 0.7 * 1.9 * delta, rtol=0, atol=1e-15)
        np.testing.assert_array_equal(param.data, theta)  # every replica starts the next round there


def test_refuses_a_batch_the_replicas_cannot_share():
    with pytest.raises(ValueError, match="divisible by the replicas"):
        LocalSGD(CONFIG, OptimSettings(), make_task("sort", 16), 6, replicas=4, local_steps=2)
