"""One training step, serially: the reference run every parallel strategy must reproduce.

Chapter 1 (and the yardstick of chapters 3-8). A step is: take the batch for this step, run
forward and backward, clip the global gradient norm, set the learning rate from the schedule,
and let AdamW update the weights. Every strategy in `minidist/parallel/` does the same step
with the work spread over ranks, and its tests compare its losses and final weights with
`SerialTrainer`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from minidist import memory
from minidist.data import accuracy
from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW, clip_grad_norm_, lr_at, set_lr, weight_decay_groups
from minidist.tensor import graph_bytes


@dataclass
class OptimSettings:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 10
    steps: int = 300
    weight_decay: float = 0.1
    clip: float = 1.0  # max global gradient norm; 0 turns clipping off

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.lr, self.warmup, self.steps, self.min_lr)


def make_optimizer(model, settings: OptimSettings) -> AdamW:
    return AdamW(weight_decay_groups(model, settings.weight_decay), lr=settings.lr, betas=(0.9, 0.95))


def clip_and_step(optimizer, params, settings: OptimSettings, step: int, total_norm: float | None = None) -> float:
    """The end of every step, shared by all strategies: clip, schedule, update. Returns the norm.

    `total_norm`: the whole model's gradient norm, for strategies whose gradients are sharded."""
    norm = clip_grad_norm_(params, settings.clip, total_norm) if settings.clip else float("nan")
    set_lr(optimizer, settings.lr_at(step))
    optimizer.step()
    return norm


@runtime_checkable
class Trainer(Protocol):
    """The face every strategy has, serial or parallel, so one training loop runs them all.

    `step(step)` does one optimizer step on that step's global batch and returns (loss,
    accuracy), the same numbers on every rank; `memory()` is this rank's ledger (bytes of
    params, grads, optimizer, activations, peak); `state_dict()` the whole model's weights by
    the serial model's names (collective for sharded strategies: rank 0 receives them, others
    None); `num_parameters()` the whole model's count; `report()` what the strategy measured
    beyond that (a pipeline's bubble, a balanced split), keyed as in the demo's --json; and
    `model` the whole model when this rank holds it (to sample from), else None.

    A strategy states that it is a Trainer by subclassing it, and inherits the defaults of the
    last two."""

    name: str
    model = None

    def step(self, step: int) -> tuple[float, float]: ...

    def memory(self) -> dict: ...

    def state_dict(self) -> dict | None: ...

    def num_parameters(self) -> int: ...

    def report(self) -> dict:
        return {}


class SerialTrainer(Trainer):
    """The whole model on one process: the reference run."""

    name = "serial"

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0):
        self.task, self.batch_size = task, batch_size
        self.model = GPT(config, seed=seed)
        self.settings = settings
        self.optimizer = make_optimizer(self.model, settings)
        self.activation_bytes = 0

    def step(self, step: int):
        """One optimizer step on this step's batch; returns (loss, accuracy)."""
        x, y = self.task.get_batch(step, self.batch_size)
        logits, loss = self.model(x, y)
        if not self.activation_bytes:  # every step builds the same graph: measure it once
            self.activation_bytes = graph_bytes(loss)
        self.optimizer.zero_grad()  # the optimizer's list of the parameters: no walk of the modules
        loss.backward()
        clip_and_step(self.optimizer, self.optimizer.params(), self.settings, step)
        return loss.item(), accuracy(logits.data, y)

    def memory(self) -> dict:
        return memory.ledger(self.model, self.optimizer, self.activation_bytes)

    def num_parameters(self) -> int:
        return self.model.num_parameters()

    def state_dict(self) -> dict:
        """The full model's weights by name (every trainer has this; for sharded strategies it
        is collective and returns the consolidated dict on rank 0)."""
        return self.model.state_dict()
