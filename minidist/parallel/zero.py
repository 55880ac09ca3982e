"""ZeRO (ZeRO 三阶段显存优化): data parallelism that stops keeping N copies of everything.

Chapter 8. Plain data parallelism (chapter 3) stores the whole model state on every rank:
parameters, gradients and AdamW's two moments, 16 bytes per parameter in mixed precision. ZeRO
(Rajbhandari et al., 2020) notices that a rank only *needs* all of it for a moment, and cuts
each pile into N shards, one per rank — DeepSpeed's three stages.

The partitioner, written by hand in `zero_partition.py`: `FlatUnit` lays a group of parameters
side by side in one flat buffer padded to a multiple of N, so rank r owns the contiguous chunk r
(the chunk the ring `reduce_scatter` hands it); `ShardedAdamW` runs the serial AdamW update on
the owned chunks only. For stage 2 a unit is a gradient bucket; for stage 3 it is what is
gathered at once (FSDP's unit).

The stages, one class each, read in order: each overrides only what its new pile changes, and
`ZeroTrainer(..., stage=S)` builds stage S. One step (B/N rows of the global batch per rank):

    Zero1Trainer  optimizer states partitioned: backward fills a full flat gradient buffer ->
                  reduce_scatter(avg) gives each rank its chunk of the mean gradient -> clip,
                  update own chunk -> all_gather parameters
    Zero2Trainer  ... and gradients: a unit's reduce_scatter starts as soon as backward has
                  completed its gradients (hooks), and its full gradients are dropped at once
    Zero3Trainer  ... and parameters: they live as chunks, a unit gathered while used (fsdp.py)

Gradient accumulation (`accumulation=k`, DeepSpeed's `gradient_accumulation_steps`): a rank's
B/N rows run as k micro-batches of B/(N k), each loss weighted by 1/k, so the k backwards add up
to the gradient of the whole slice and the step is still the serial one. Stage 1 lets them add
up in its full gradient buffers and reduce-scatters once, after the last: its traffic does not
change. Stages 2 and 3 keep no full gradient to add into, so every micro-batch's gradients are
reduce-scattered as they become ready and *added* into the owned chunk (zeroed once per step):
k reduce-scatters per step, and stage 3 gathers the weights again for every micro-batch.

Why stage 1 reduce-scatters rather than all-reduces: a rank updates only its chunk, so only
its chunk of the *averaged* gradient is needed — an all-reduce is a reduce-scatter followed by
an all-gather, and the all-gather that matters here is of the updated parameters. So stages 1
and 2 move exactly what plain data parallelism moves (2(N-1)/N x Ψ per rank); stage 3 gathers
the parameters twice (forward and backward): about 1.5x (`comm.cost.zero_bytes_sent`).

On one machine the only all-reduces here (the clipping norm, the logged loss) go through the
shared-memory window (`algorithm="auto"`, comm/shared_memory.py), while `reduce_scatter` and
`all_gather`, which carry the model's bytes, are always the hand-written rings (comm/collectives.py).
"""
from __future__ import annotations

import numpy as np

from minidist import timeline
from minidist.plan import memory
from minidist.comm import all_gather, all_reduce, reduce_scatter
from minidist.comm.world import World, resolve
from minidist.core.data import accuracy
from minidist.precision.mixed_precision import Precision
from minidist.core.model import GPT, GPTConfig
from minidist.parallel.fsdp import FullyShardedGPT
from minidist.parallel.zero_partition import (FlatUnit, LiveBytes, ShardedAdamW, chunk_state,  # noqa: F401
                                              flat_parameters, load_chunk_state, make_units, master_chunks,
                                              mixed_precision_step)
from minidist.core.tensor import graph_bytes
from minidist.training.reshard import Piece
from minidist.training.train import (OptimSettings, Trainer, generator_state, load_generator_states, load_scaler_state,
                            scaler_state)


# ----------------------------------------------------------------------------- stage 1


class Zero1Trainer(Trainer):
    """ZeRO stage 1: the serial training step with AdamW's moments cut into chunks.

        trainer = Zero1Trainer(config, settings, task, batch_size, group=world, accumulation=1)
        loss, acc = trainer.step(step)      # same numbers on every rank, = the serial run's
        trainer.memory()                    # this rank's live bytes by pile, and the peak
        trainer.state_dict()                # full weights, serial keys (collective: all ranks call)
        trainer.global_state()              # this rank's chunks as pieces of the serial arrays

    `param_buffers`, `grad_buffers`: what this rank keeps between steps, one per unit — here
    full flat buffers (parameters and `.grad`s are views into them), so `.model` is the full GPT,
    for sampling. Later stages keep chunks in the same two lists.
    """

    stage, name = 1, "zero1"

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, precision: str = "fp32", accumulation: int = 1):
        world = resolve(group)
        check_batch(batch_size, world.size, accumulation)
        self.task, self.batch_size, self.settings, self.config = task, batch_size, settings, config
        self.accumulation = accumulation  # micro-batches per optimizer step
        self.live = LiveBytes()  # gradient buckets and gathered units, for memory()
        self.activation_bytes = 0
        # Every rank builds the full model from the seed (same numbers as the serial run), then
        # keeps only what its stage needs. Real ZeRO-3 avoids ever materialising it (meta device).
        self.module = model = self.build_model(config, seed)
        self.amp = Precision(precision, settings)  # chapter 10: the format, the masters, the scaler
        self.precision, self.scaler = self.amp.name, self.amp.scaler
        # chapter 10: 16-bit weights (so 16-bit units and gradients), fp32 masters of my chunks
        masters = self.amp.cast(model)
        self.units = make_units(model, world.size, world.rank)
        # chapter 8: ranks that cut the same units from the same weights make matching calls
        # every step, so the group is checked once here and each collective below is one line
        self.group = world.verify("the ZeRO units", [
            self.stage, bool(settings.clip), accumulation,
            [(u.name, u.padded, np.dtype(u.dtype).str) for u in self.units],
            [float(np.sum(p.data, dtype=np.float64)) for p in model.parameters()]])
        params = self._shard_parameters(model)
        grads = self._shard_gradients(model)
        self.optimizer = ShardedAdamW(self.units, params, grads, settings.weight_decay, master_chunks(self.units, masters),
                                      settings.betas, settings.eps)

    def build_model(self, config: GPTConfig, seed: int):
        """The module each rank runs: the whole GPT (a DP x TP mesh gives each its tp shard)."""
        return GPT(config, seed=seed)

    # -- what this stage keeps (each returns the owned chunks the optimizer updates)
    def _shard_parameters(self, model) -> list[np.ndarray]:
        """Full weights, as views into one flat buffer per unit; the owned chunk is updated."""
        self.model = model
        self.param_buffers = flat_parameters(self.units)
        return [flat[u.lo:u.hi] for u, flat in zip(self.units, self.param_buffers)]

    def _shard_gradients(self, model) -> list[np.ndarray]:
        """Full flat gradient buffers, kept: backward accumulates into views of them."""
        self.grad_buffers = [np.zeros(u.padded, dtype=u.dtype) for u in self.units]
        return [flat[u.lo:u.hi] for u, flat in zip(self.units, self.grad_buffers)]

    # -- the pieces of a step
    def _zero_grad(self) -> None:
        for unit, flat in zip(self.units, self.grad_buffers):
            flat[...] = 0.0
            for p, view in zip(unit.params, unit.views(flat)):
                p.grad = view  # backward's `+=` lands in the flat buffer: no copy needed

    def _forward(self, x, y):
        return self.module(x, y)

    def _finish_backward(self) -> None:
        """After each micro-batch's backward. Stage 1: nothing, its gradients add up in place."""

    def complete_partial_gradients(self, params: list) -> None:
        """Gradients that other ranks of the replica hold parts of are summed here (nothing to do
        for a whole model; a tensor-parallel shard's sequence-parallel parameters, zero_tensor.py)."""

    def _finish_gradients(self) -> None:
        """Each rank needs only its chunk of the mean gradient: one reduce-scatter per unit."""
        self.complete_partial_gradients([p for unit in self.units for p in unit.params])
        ### BEGIN SOLUTION assignment=zero1_partition
        for unit, flat in zip(self.units, self.grad_buffers):
            chunk = reduce_scatter(flat, op="avg", group=self.group)  # a chunk-sized temporary
            self.live.add(chunk.nbytes)
            flat[unit.lo:unit.hi] = chunk  # the owned part of the buffer now holds the mean
            self.live.sub(chunk.nbytes)
        ### END SOLUTION

    def all_gather_parameters(self) -> None:
        """Every rank needs every updated weight for the next forward: gather the chunks."""
        ### BEGIN SOLUTION assignment=zero1_partition
        for flat, shard in zip(self.param_buffers, self.optimizer.params):
            all_gather(shard, group=self.group, out=flat)
        ### END SOLUTION

    def step(self, step: int):
        """One optimizer step on the global batch; returns (global mean loss, accuracy)."""
        x, y = self.task.get_batch(step, self.batch_size, self.group.rank, self.group.size)
        self._zero_grad()  # once per step: the micro-batches' gradients add up
        loss_sum = acc_sum = 0.0
        for mx, my in zip(np.array_split(x, self.accumulation), np.array_split(y, self.accumulation)):
            share = len(mx) / len(x)  # 1/k: the micro-batch's part of this rank's mean loss
            with timeline.span("forward", "forward"), self.amp.autocast():  # fp32: nothing changes
                logits, loss = self._forward(mx, my)
            if not self.activation_bytes:  # one micro-batch's graph, the same every time: measure it once
                self.activation_bytes = graph_bytes(loss)
            self.amp.scale(loss * share).backward()  # fp16: x the loss scale, once per micro-batch
            self._finish_backward()
            loss_sum += loss.item() * share
            acc_sum += self.accuracy(logits.data, my) * share
        self._finish_gradients()
        with timeline.span("optimizer", "optimizer"):  # a trace's span (chapter 5)
            if not self.amp.low:  # the sharded AdamW's own step; in 16 bits on the fp32 master chunks
                if self.settings.clip:
                    self.optimizer.clip_grad_norm_(self.settings.clip, *self.norm_groups())
                self.optimizer.step(self.settings.lr_at(step))
            else:
                self.mixed_precision_step(step)
        self.all_gather_parameters()
        stats = np.array([loss_sum, acc_sum])  # equal rows per rank: the mean of means is the mean
        all_reduce(stats, op="avg", group=self.group)
        return float(stats[0]), float(stats[1])

    def mixed_precision_step(self, step: int) -> None:
        """Chapter 10: the update of the fp32 master chunks (`zero_partition.mixed_precision_step`)."""
        mixed_precision_step(self.optimizer, self.scaler, self.settings, step, self.everyone(), *self.norm_groups())

    def everyone(self) -> World:
        """Every rank that holds a piece of the gradients: the dp group (a mesh: its world)."""
        return self.group

    def report(self) -> dict:
        return self.amp.report()

    def norm_groups(self) -> tuple[list, list | None]:
        """(groups, weights) for `ShardedAdamW.grad_norm`: the chunks of the whole model are
        spread over this group, every element counted once."""
        return [self.group], None

    def accuracy(self, logits: np.ndarray, targets) -> float:
        return accuracy(np.asarray(logits, dtype=np.float32), targets)

    # -- measurements and state
    def memory(self) -> dict:
        """This rank's bytes by pile. `params` and `grads` are what stays allocated between steps;
        `transient` is the most that gathered units and gradient buckets ever held at once;
        `peak` adds everything, as pessimistic as memory.ledger."""
        piles = {"params": sum(a.nbytes for a in self.param_buffers), "grads": sum(a.nbytes for a in self.grad_buffers),
                 "optimizer": self.optimizer.nbytes(), "activations": int(self.activation_bytes),
                 "transient": self.live.peak}
        piles["peak"] = sum(piles.values())
        return memory.with_masters_apart(piles, self.optimizer.master_nbytes())

    def num_parameters(self) -> int:
        return sum(u.numel for u in self.units)

    def state_dict(self) -> dict:
        """Full weights keyed like the serial model's."""
        return self.module.state_dict()

    tp_rank = 0  # where this rank's shards sit in the serial arrays (a DP x TP mesh: its tp rank)

    def global_state(self) -> dict[str, Piece]:
        """This rank's chunks as pieces of the serial arrays (`chunk_state`), its generators and
        the loss scale: the one checkpoint format, which any layout can load. No messages."""
        return {**chunk_state(self.units, self.optimizer, self.tp_rank), **scaler_state(self.scaler),
                **generator_state(self.module)}

    def load_global_state(self, read) -> None:
        """This rank's chunks cut from the whole arrays (stages 1-2 take their full weights the
        same way, so nothing is gathered). No messages."""
        load_chunk_state(self.units, self.optimizer, self.param_buffers, read, self.tp_rank)
        load_scaler_state(self.scaler, read)
        load_generator_states(self.module, read)


# ----------------------------------------------------------------------------- stage 2


class Zero2Trainer(Zero1Trainer):
    """ZeRO stage 2: stage 1, and the gradients cut into chunks as well.

    `grad_buffers` holds only this rank's chunk of each unit's mean gradient. A gradient hook
    (`register_post_accumulate_grad_hook`, as in chapter 3's buckets) notices when backward has
    completed a unit's gradients; the unit is reduce-scattered at once and its full gradients
    dropped, so at most a unit's worth of full gradients exists at a time. With accumulation
    that happens in every micro-batch, each adding its mean gradient into the chunk.
    """

    stage, name = 2, "zero2"

    def _shard_gradients(self, model) -> list[np.ndarray]:
        self.grad_buffers = [np.zeros(u.chunk, dtype=u.dtype) for u in self.units]
        self._unit_of = {id(p): i for i, u in enumerate(self.units) for p in u.params}
        self._pending = [len(u.params) for u in self.units]  # gradients each unit still awaits
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._grad_ready)
        return self.grad_buffers

    def _zero_grad(self) -> None:
        self._pending = [len(u.params) for u in self.units]
        for grad in self.grad_buffers:
            grad[...] = 0.0  # once per step: each micro-batch adds its share (_reduce_unit)

    def _grad_ready(self, p) -> None:
        """A parameter's gradient is complete; when its unit's all are, reduce the unit."""
        self.live.add(p.grad.nbytes)  # the full gradient exists until its unit is reduced
        index = self._unit_of[id(p)]
        self._pending[index] -= 1
        if self._pending[index] == 0:
            self._reduce_unit(index)

    def _reduce_unit(self, index: int) -> None:
        """Copy the unit's gradients into a flat bucket, reduce_scatter(avg) it so that this rank
        receives this micro-batch's mean gradient of its chunk, add that into the chunk, and drop
        the full gradients at once."""
        unit = self.units[index]
        self.complete_partial_gradients(unit.params)
        bucket = unit.flatten([p.grad for p in unit.params])
        # one micro-batch: straight into the chunk; several: each adds a chunk-sized temporary
        temporary = 0 if self.accumulation == 1 else unit.chunk * bucket.itemsize
        self.live.add(bucket.nbytes + temporary)
        if temporary:
            self.grad_buffers[index] += reduce_scatter(bucket, op="avg", group=self.group)
        else:
            reduce_scatter(bucket, op="avg", group=self.group, out=self.grad_buffers[index])
        self.live.sub(bucket.nbytes + temporary + sum(p.grad.nbytes for p in unit.params if p.grad is not None))
        for p in unit.params:
            p.grad = None
        self._pending[index] = 0

    def _finish_backward(self) -> None:
        """Reduce any unit some of whose parameters got no gradient (the hooks never completed
        it), and wait for every unit again in the next micro-batch."""
        for index, pending in enumerate(self._pending):
            if pending:
                self._reduce_unit(index)
        self._pending = [len(u.params) for u in self.units]

    def _finish_gradients(self) -> None:
        """Nothing left: each micro-batch has already added its mean gradient into the chunks."""


# ----------------------------------------------------------------------------- stage 3


class Zero3Trainer(Zero2Trainer):
    """ZeRO stage 3: stage 2, and the parameters cut into chunks too (FSDP, fsdp.py).

    `param_buffers` holds only this rank's chunk of each unit's weights. `FullyShardedGPT` runs
    the model, gathering a unit just before its forward and its backward and releasing it after;
    no rank ever holds every weight between steps, so `.model` is None and `state_dict()` is
    collective. `memory()` adds `gathered`: the most full weights alive at once (root + a block).
    """

    stage, name = 3, "zero3"

    def _shard_parameters(self, model) -> list[np.ndarray]:
        self.model = None
        self.param_buffers = [u.flatten([p.data for p in u.params])[u.lo:u.hi].copy() for u in self.units]
        self.gathered = LiveBytes()  # full weights alive at once, for memory()
        self.fsdp = FullyShardedGPT(model, self.units, self.param_buffers, self.group, (self.live, self.gathered))
        return self.param_buffers

    def _forward(self, x, y):
        return self.fsdp(x, y)

    def _finish_backward(self) -> None:
        super()._finish_backward()
        self.fsdp.finish_backward()  # the root unit is kept gathered until each backward is over

    def all_gather_parameters(self) -> None:
        """Nothing to gather: stage 3 keeps only the chunks; units are gathered when used."""

    def memory(self) -> dict:
        return dict(super().memory(), gathered=self.gathered.peak)

    def state_dict(self) -> dict:
        """Full weights keyed like the serial model's. Collective: call it on every rank."""
        return self.fsdp.full_state_dict()


STAGES = {1: Zero1Trainer, 2: Zero2Trainer, 3: Zero3Trainer}


def check_batch(batch_size: int, dp: int, accumulation: int = 1) -> None:
    """Chapter 8: every rank runs `accumulation` equal micro-batches of its equal slice, or none
    starts (pure arithmetic: every rank reaches the same verdict before any message)."""
    if not isinstance(accumulation, int) or isinstance(accumulation, bool) or accumulation < 1:
        raise ValueError(f"accumulation must be an integer >= 1 (micro-batches per step), got {accumulation!r}")
    if batch_size % (dp * accumulation):
        raise ValueError(f"global batch {batch_size} is not divisible by dp={dp}" if accumulation == 1 else
                         f"global batch {batch_size} is not divisible by dp={dp} x accumulation steps="
                         f"{accumulation} = {dp * accumulation}")


def ZeroTrainer(config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                group: World | None = None, stage: int = 1, precision: str = "fp32",
                accumulation: int = 1) -> Zero1Trainer:
    """The trainer of ZeRO stage `stage` (1, 2 or 3): `ZeroTrainer(..., stage=2)` is a Zero2Trainer."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r} (stage 0 is plain data parallelism)")
    return STAGES[stage](config, settings, task, batch_size, seed=seed, group=group, precision=precision,
                         accumulation=accumulation)
