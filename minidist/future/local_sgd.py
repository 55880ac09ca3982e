"""Local SGD and DiLoCo: replicas that synchronise every H steps instead of every step (chapter 11).

Data parallelism (chapter 3) all-reduces the gradients at every step, so across two sites every
step waits for the slow link. Local SGD lets each of K replicas take H steps on its own rows of
the batch, with its own optimizer, and only then averages the replicas' weights: one
synchronisation every H steps, H times less communication. DiLoCo (Douillard et al. 2023) keeps
that shape and treats the average as a gradient for an *outer* optimizer:

    delta = theta - mean_k(theta_k)          the "outer gradient" of one round
    theta <- theta - outer_lr * (delta + mu * buffer),   buffer <- mu * buffer + delta   (Nesterov)

With outer_lr = 1 and mu = 0 that is the plain average: local SGD. DiLoCo uses AdamW inside
(each replica is a `SerialTrainer`) and Nesterov momentum outside (outer_lr 0.7, mu 0.9).

This runs the K replicas one after another in one process: an illustration of the arithmetic,
not a distributed strategy. On real machines each replica is a data-parallel group of its own
and the average is one all-reduce of the weights per round.
"""
from __future__ import annotations

import numpy as np

from minidist.training.train import OptimSettings, SerialTrainer


class ReplicaRows:
    """Replica k's rows of the global batch: the batch a data-parallel rank k of K would get."""

    def __init__(self, task, replica: int, replicas: int):
        self.task, self.replica, self.replicas = task, replica, replicas

    def get_batch(self, step: int, batch_size: int):
        return self.task.get_batch(step, batch_size * self.replicas, rank=self.replica, world_size=self.replicas)


class LocalSGD:
    """K replicas of the serial trainer, each on its 1/K of every global batch, averaged every H steps.

    `batch_size` is the global batch (K replicas of batch_size / K rows each), as in data
    parallelism, so that `LocalSGD` and `SerialTrainer(batch_size)` see the same rows per step."""

    def __init__(self, config, settings: OptimSettings, task, batch_size: int, replicas: int, local_steps: int,
                 seed: int = 0, outer_lr: float = 1.0, outer_momentum: float = 0.0):
        if replicas < 1 or local_steps < 1 or batch_size % replicas:
            raise ValueError(f"LocalSGD needs replicas >= 1, local_steps >= 1 and a global batch divisible by the "
                             f"replicas; got replicas={replicas}, local_steps={local_steps}, batch_size={batch_size}")
        self.replicas, self.local_steps = replicas, local_steps
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.trainers = [SerialTrainer(config, settings, ReplicaRows(task, k, replicas), batch_size // replicas, seed)
                         for k in range(replicas)]  # the same seed: every replica starts from the same weights
        self.weights = [p.data.copy() for p in self.trainers[0].model.parameters()]  # theta, the shared weights
        self.buffers = [np.zeros_like(w) for w in self.weights]
        self.rounds = 0  # synchronisations so far: each is one all-reduce of the weights

    def step(self, step: int) -> float:
        """One local step on every replica; every `local_steps` steps, one outer step. Returns the
        replicas' mean loss (the mean over the global batch's rows, as data parallelism reports)."""
        loss = float(np.mean([trainer.step(step)[0] for trainer in self.trainers]))
        if (step + 1) % self.local_steps == 0:
            self.synchronise()
        return loss

    def synchronise(self) -> None:
        params = [list(trainer.model.parameters()) for trainer in self.trainers]
        for i, (theta, buffer) in enumerate(zip(self.weights, self.buffers)):
            delta = theta - np.mean([replica[i].data for replica in params], axis=0)
            buffer *= self.outer_momentum
            buffer += delta
            theta -= self.outer_lr * (delta + self.outer_momentum * buffer)  # Nesterov; mu = 0: the average
            for replica in params:
                replica[i].data[...] = theta
        self.rounds += 1

    @property
    def model(self):
        """The shared model (replica 0's copy; all agree right after a synchronisation)."""
        return self.trainers[0].model
