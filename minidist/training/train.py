"""One training step, serially: the reference run every parallel strategy must reproduce.

Chapter 1 (and the yardstick of chapters 3-8). A step is: take the batch for this step, run
forward and backward, clip the global gradient norm, set the learning rate from the schedule,
and let AdamW update the weights. Every strategy in `minidist/parallel/` does the same step
with the work spread over ranks, and its tests compare its losses and final weights with
`SerialTrainer`'s.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from minidist.plan import memory
from minidist.core.data import accuracy
from minidist.precision.loss_scale import DynamicLossScaler
from minidist.precision.mixed_precision import MixedPrecisionAdamW, Precision
from minidist.core.model import GPT, GPTConfig
from minidist.core.moe import MoEConfig, MoEGPT, merge_moe_stats, moe_report
from minidist.core.optim import AdamW, lr_at, weight_decay_groups
from minidist.training.reshard import Piece, box_of, checked, cut, global_shape, whole
from minidist.core.tensor import graph_bytes


@dataclass
class OptimSettings:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 10
    steps: int = 300
    weight_decay: float = 0.1
    clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    initial_loss_scale: float = 2.0**16  # fp16's dynamic loss scale (chapter 10): where it starts,
    loss_scale_window: int = 2000        # and how many clean steps it waits before it doubles
    betas: tuple = (0.9, 0.95)           # AdamW's moment decays (GPT-3's, Megatron-LM's usual)
    eps: float = 1e-8
    decay: str = "cosine"                # after warm-up: "cosine", "linear" or "constant" to min_lr

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.lr, self.warmup, self.steps, self.min_lr, self.decay)


def make_optimizer(model, settings: OptimSettings, masters: dict | None = None) -> AdamW:
    """AdamW over the model's parameters; with `masters` (fp32 copies of low-precision weights,
    `mixed_precision.to_low_precision`), the mixed-precision AdamW that updates them (chapter 10)."""
    groups = weight_decay_groups(model, settings.weight_decay)
    if masters is not None:
        return MixedPrecisionAdamW(groups, masters, lr=settings.lr, betas=tuple(settings.betas), eps=settings.eps)
    return AdamW(groups, lr=settings.lr, betas=tuple(settings.betas), eps=settings.eps)


def make_scaler(precision: str, settings: OptimSettings | None = None) -> DynamicLossScaler:
    """The loss scaler of a precision: dynamic for fp16; none (disabled) for fp32 and bf16, whose
    8-bit exponent reaches as low as fp32's (chapter 10)."""
    return Precision(precision, settings or OptimSettings()).scaler


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

    Checkpoints (minidist/training/reshard.py): `global_state()` is *this rank's pieces* of the serial
    run's training state, {global name: `Piece`} (its weights, AdamW moments and masters where its
    shard sits in the serial arrays, the step count, the loss scale; and, `local`, every random
    generator it holds: dropout masks repeat), no messages; `load_global_state(read)` takes it back
    from `read(name)`, the whole global array, cutting this rank's piece as the trainer cut the
    serial model at initialisation (any layout loads any other's), and its own generators from
    `read.local(name)` (None when another layout saved them), no messages either; it refuses a
    piece of the wrong shape or dtype (a cut array must never load by broadcasting). The data
    position is not in it: a batch is a function of (seed, step), and the step is the checkpoint's.

    A strategy states that it is a Trainer by subclassing it, and inherits the defaults of the
    last two."""

    name: str
    model = None

    def step(self, step: int) -> tuple[float, float]: ...

    def memory(self) -> dict: ...

    def state_dict(self) -> dict | None: ...

    def num_parameters(self) -> int: ...

    def global_state(self) -> dict[str, Piece]: ...

    def load_global_state(self, read) -> None: ...

    def report(self) -> dict:
        return {}


class SerialTrainer(Trainer):
    """The whole model on one process: the reference run."""

    name = "serial"

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 precision: str = "fp32", scaler: DynamicLossScaler | None = None):
        self.task, self.batch_size = task, batch_size
        self.model = self.build_model(config, seed)
        self.settings, self.amp = settings, Precision(precision, settings)  # chapter 10: format, masters, scaler
        if scaler is not None:
            self.amp.scaler = scaler
        self.precision, self.scaler = self.amp.name, self.amp.scaler
        self.optimizer = make_optimizer(self.model, settings, self.amp.cast(self.model))
        self.activation_bytes = 0

    def build_model(self, config: GPTConfig, seed: int):
        """The model trained (the mixture-of-experts trainer builds its own, core/moe.py)."""
        return GPT(config, seed=seed)

    def step(self, step: int):
        """One optimizer step on this step's batch; returns (loss, accuracy)."""
        x, y = self.task.get_batch(step, self.batch_size)
        with self.amp.autocast():  # fp32: nothing changes
            logits, loss = self.model(x, y)
        if not self.activation_bytes:  # every step builds the same graph: measure it once
            self.activation_bytes = graph_bytes(loss)
        self.optimizer.zero_grad()  # the optimizer's list of the parameters: no walk of the modules
        self.amp.scale(loss).backward()  # fp32 and bf16: the loss itself
        self.amp.step(self.optimizer, step)  # clip, schedule, AdamW (16 bits: on the masters, or skip)
        return loss.item(), accuracy(np.asarray(logits.data, dtype=np.float32), y)

    def report(self) -> dict:
        return self.amp.report()

    def memory(self) -> dict:
        return memory.ledger(self.model, self.optimizer, self.activation_bytes)

    def num_parameters(self) -> int:
        return self.model.num_parameters()

    def state_dict(self) -> dict:
        """The full model's weights by name (every trainer has this; for sharded strategies it
        is collective and returns the consolidated dict on rank 0)."""
        return self.model.state_dict()

    def global_state(self) -> dict[str, Piece]:
        return training_state(self.model, self.optimizer, self.scaler)

    def load_global_state(self, read) -> None:
        load_training_state(self.model, self.optimizer, read, self.scaler)


# ----------------------------------------------------------------------------- the training state


def training_state(module, optimizer, scaler=None, tp_rank: int = 0, copies=()) -> dict[str, Piece]:
    """Everything a step changes, as pieces of the serial run's arrays (minidist/training/reshard.py):
    `param.<name>`, `exp_avg.<name>` and `exp_avg_sq.<name>` (zeros before a parameter's first
    update, as AdamW starts them), `master.<name>` (the fp32 weight of a 16-bit one, chapter 10),
    `step`, the loss scaler's `scaler.<key>`, and every generator as a local `rng.<module>.<attribute>`.
    `module` holds whole parameters or tensor-parallel shards (at `tp_rank`, chapter 6), under the
    serial names; `copies` are parameters another rank writes (a pipeline's second tied embedding)."""
    names = {id(p): name for name, p in module.named_parameters()}
    state = {}
    for p, moments in zip(optimizer.params(), optimizer.state):
        if any(p is copy for copy in copies):
            continue
        name, box, shape = names[id(p)], box_of(p, p.shape, tp_rank), global_shape(p, p.shape)
        master = moments.get("master")  # mixed precision: the fp32 weight the update continues from
        updated = p.data if master is None else master
        arrays = {"param": p.data, "exp_avg": moments.get("exp_avg", np.zeros_like(updated)),
                  "exp_avg_sq": moments.get("exp_avg_sq", np.zeros_like(updated)), "master": master}
        state.update({f"{kind}.{name}": Piece(a, shape, box) for kind, a in arrays.items() if a is not None})
    state["step"] = whole(np.array(optimizer.step_count))
    return {**state, **scaler_state(scaler), **generator_state(module)}


def load_training_state(module, optimizer, read, scaler=None, tp_rank: int = 0) -> None:
    """Put `training_state` back from `read(name)` (the whole global array): each parameter cuts
    its piece (its tensor-parallel box at `tp_rank`); shapes and dtypes must match exactly."""
    names = {id(p): name for name, p in module.named_parameters()}
    for i, p in enumerate(optimizer.params()):
        name, box = names[id(p)], box_of(p, p.shape, tp_rank)

        def mine(kind: str, like: np.ndarray) -> np.ndarray:
            return checked(cut(read(f"{kind}.{name}"), box), like, f"{kind}.{name}")

        p.data[...] = mine("param", p.data)
        master = optimizer.state[i].get("master")
        updated = p.data if master is None else master
        moments = {key: mine(key, updated).copy() for key in ("exp_avg", "exp_avg_sq")}
        optimizer.state[i] = moments if master is None else {**moments, "master": mine("master", master).copy()}
    optimizer.step_count = int(read("step"))
    load_scaler_state(scaler, read)
    load_generator_states(module, read)


def scaler_state(scaler) -> dict[str, Piece]:
    """The fp16 loss scaler's state as `scaler.<key>` (none when it is disabled, or absent)."""
    if scaler is None or not scaler.enabled:
        return {}
    return {f"scaler.{k}": whole(v) for k, v in scaler.state_dict().items()}


def load_scaler_state(scaler, read) -> None:
    if scaler is not None and scaler.enabled:
        scaler.load_state_dict({k: read(f"scaler.{k}") for k in scaler.state_dict()})


def generators(module):
    """(`rng.<module>.<attribute>`, generator) for every np.random.Generator in the module tree:
    Dropout's masks, attention's dropout; a strategy's own layers are found the same way."""
    for module_name, sub in module.named_modules():
        for attribute, value in vars(sub).items():
            if isinstance(value, np.random.Generator):
                yield ".".join(filter(None, ("rng", module_name, attribute))), value


def generator_states(module) -> dict[str, np.ndarray]:
    """Each generator's state as the bytes of its JSON (PCG64's state is a 128-bit integer)."""
    return {key: np.frombuffer(json.dumps(g.bit_generator.state).encode(), dtype=np.uint8).copy()
            for key, g in generators(module)}


def generator_state(module) -> dict[str, Piece]:
    """The generators as this rank's own (local) pieces: they belong to its layout."""
    return {key: whole(state, local=True) for key, state in generator_states(module).items()}


def load_generator_states(module, read) -> None:
    """Each generator back from `read.local`: saved by this rank of this layout, else left as seeded."""
    for key, g in generators(module):
        state = read.local(key)
        if state is not None:
            g.bit_generator.state = json.loads(bytes(state).decode())


class MoETrainer(SerialTrainer):
    """SerialTrainer's step on the MoE GPT: the reference run of expert parallelism (in fp32,
    float64, or 16 bits: the router's softmax runs in fp32, as autocast's policy says).

    With `microbatches=m` the step is m forward/backward passes over consecutive rows of the
    batch, each routed on its own: capacity, dropped tokens and the balance loss follow the
    micro-batch, not the batch. This is the reference of a pipeline (or accumulation) of MoE
    layers, which routes each micro-batch as it passes (chapter 11)."""

    name = "moe"

    def __init__(self, config: MoEConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 precision: str = "fp32", microbatches: int = 1):
        if batch_size % microbatches:
            raise ValueError(f"MoETrainer: global batch {batch_size} does not split into {microbatches} micro-batches")
        self.config, self.history, self.microbatches = config, [], microbatches
        super().__init__(config, settings, task, batch_size, seed, precision)

    def build_model(self, config: MoEConfig, seed: int):
        return MoEGPT(config, seed=seed)

    def step(self, step: int):
        if self.microbatches == 1:
            result = super().step(step)
            self.history.append(self.model.moe_stats())
            return result
        m = self.microbatches
        x, y = self.task.get_batch(step, self.batch_size)
        self.optimizer.zero_grad()
        losses, accuracies, stats = [], [], []
        for xs, ys in zip(np.split(x, m), np.split(y, m)):
            with self.amp.autocast():
                logits, loss = self.model(xs, ys)
            self.amp.scale(loss * (1.0 / m)).backward()  # the mean over micro-batches, summed as it goes
            losses.append(loss.item())
            accuracies.append(accuracy(np.asarray(logits.data, dtype=np.float32), ys))
            stats.append(self.model.moe_stats())
        self.amp.step(self.optimizer, step)
        self.history.append(merge_moe_stats(stats))
        return sum(losses) / m, sum(accuracies) / m

    def report(self) -> dict:
        return moe_report(self.config, self.history)
