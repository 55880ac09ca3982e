"""ZeRO (ZeRO 三阶段显存优化): data parallelism that stops keeping N copies of everything.

Chapter 8. Plain data parallelism (chapter 3) stores the whole model state on every rank:
parameters, gradients and AdamW's two moments, 16 bytes per parameter in mixed precision. ZeRO
(Rajbhandari et al., 2020) notices that a rank only *needs* all of it for a moment, and cuts
each pile into N shards, one per rank — DeepSpeed's three stages:

    stage 1  optimizer states partitioned          each rank updates only the weights it owns
    stage 2  ... and gradients                     reduce-scatter instead of all-reduce
    stage 3  ... and parameters                    gather a layer's weights just before use (FSDP)

The partitioner, written here by hand:

- `FlatUnit`: a group of parameters laid side by side in one flat buffer, padded to a multiple
  of N, so rank r owns the contiguous chunk r (`lo:hi`) — exactly the chunk that the ring
  `reduce_scatter` hands rank r and that `all_gather` collects from it. A model is a few units:
  the "root" (embeddings, final LayerNorm, the tied head) and one per transformer block. For
  stage 2 a unit is a gradient bucket; for stage 3 it is what is gathered at once (FSDP's unit).
- `ShardedAdamW`: the serial AdamW update (`optim.adamw_update`, shared code) applied to the
  owned chunk only, with weight decay decided per element by which parameter it belongs to.
- `ZeroTrainer`: the serial step (`train.SerialTrainer`) with the work and memory spread out.

One step, per stage (B/N rows of the global batch on each rank):

    stage 1: backward fills a full flat gradient buffer -> reduce_scatter(avg) gives each rank
             its chunk of the mean gradient -> clip, update own chunk -> all_gather parameters
    stage 2: a unit's reduce_scatter starts as soon as backward completes its gradients (hooks),
             and its full gradients are dropped at once: only the chunk is kept
    stage 3: as stage 2, and the parameters themselves live as chunks: see fsdp.py

Why stage 1 reduce-scatters rather than all-reduces: a rank updates only its chunk, so only
its chunk of the *averaged* gradient is needed — an all-reduce is a reduce-scatter followed by
an all-gather, and the all-gather that matters here is of the updated parameters. So stages 1
and 2 move exactly what plain data parallelism moves (2(N-1)/N x Ψ per rank); stage 3 gathers
the parameters twice (forward and backward): about 1.5x.
"""
from __future__ import annotations

import math

import numpy as np

from minidist.data import accuracy
from minidist.comm import all_gather, all_reduce, collectives, reduce_scatter, unchecked
from minidist.comm.world import World, resolve
from minidist.model import GPT, GPTConfig
from minidist.optim import adamw_update
from minidist.tensor import graph_bytes
from minidist.train import OptimSettings

BETAS, EPS = (0.9, 0.95), 1e-8  # as train.make_optimizer builds the serial AdamW


# ----------------------------------------------------------------------------- the partitioner


class FlatUnit:
    """Parameters flattened side by side, padded to a multiple of N; rank r owns chunk r.

        names    ['h.0.ln_1.weight', 'h.0.ln_1.bias', ...]   offsets[i]:offsets[i+1] in the unit
        numel    elements of the real parameters; padded = numel rounded up to a multiple of N
        lo, hi   this rank's chunk: padded // N elements (the padding's zeros live in the last)
    """

    def __init__(self, name: str, named_params: list, world_size: int, rank: int):
        self.name = name
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [p.shape for p in self.params]
        self.dtype = self.params[0].dtype
        self.offsets = np.concatenate([[0], np.cumsum([p.size for p in self.params])]).astype(int)
        self.numel = int(self.offsets[-1])
        self.padded = -(-self.numel // world_size) * world_size
        self.chunk = self.padded // world_size
        self.lo, self.hi = rank * self.chunk, (rank + 1) * self.chunk
        self.ready = 0  # gradients completed this backward (stages 2-3)

    def flatten(self, arrays) -> np.ndarray:
        """One padded flat buffer holding `arrays` (one per parameter; None counts as zeros)."""
        flat = np.zeros(self.padded, dtype=self.dtype)
        for i, a in enumerate(arrays):
            if a is not None:
                flat[self.offsets[i]:self.offsets[i + 1]] = a.ravel()
        return flat

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Each parameter's slot in a padded flat buffer, shaped like the parameter (no copy)."""
        return [flat[self.offsets[i]:self.offsets[i + 1]].reshape(s) for i, s in enumerate(self.shapes)]

    def decay_segments(self) -> list[tuple[int, int, bool]]:
        """(start, stop, decay) runs of my chunk, relative to it. AdamW decays matrices only
        (`optim.weight_decay_groups`: ndim >= 2), so a chunk that cuts through a bias and a weight
        needs both rules; the padding (no parameter) gets no decay and stays zero."""
        segments = []
        for i, shape in enumerate(self.shapes + [()]):  # a last pseudo-parameter: the padding
            start = self.offsets[i] if i < len(self.shapes) else self.numel
            stop = self.offsets[i + 1] if i < len(self.shapes) else self.padded
            a, b = max(int(start), self.lo), min(int(stop), self.hi)
            if a < b:
                decay = len(shape) >= 2
                if segments and segments[-1][2] == decay and segments[-1][1] == a - self.lo:
                    segments[-1] = (segments[-1][0], b - self.lo, decay)  # merge equal neighbours
                else:
                    segments.append((a - self.lo, b - self.lo, decay))
        return segments


def make_units(model, world_size: int, rank: int) -> list[FlatUnit]:
    """The root unit (every parameter outside the blocks: embeddings, ln_f, an untied head),
    then one unit per transformer block `h.i` — FSDP's usual wrapping of a transformer."""
    named = list(model.named_parameters())
    root = [(n, p) for n, p in named if not n.startswith("h.")]
    units = [FlatUnit("root", root, world_size, rank)]
    for i in range(len(model.h)):
        units.append(FlatUnit(f"h.{i}", [(n, p) for n, p in named if n.startswith(f"h.{i}.")], world_size, rank))
    return units


class LiveBytes:
    """Bytes of short-lived buffers alive right now, and the most ever alive at once (the peak)."""

    def __init__(self):
        self.now = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += int(nbytes)
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= int(nbytes)


# ----------------------------------------------------------------------------- the optimizer


class ShardedAdamW:
    """AdamW on this rank's chunks only: 2 x Ψ/N moments instead of 2 x Ψ (stage 1's saving).

    `params[u]` and `grads[u]` are unit u's owned chunks (views or arrays, updated in place).
    Bias correction uses the global step; weight decay follows each element's parameter.
    """

    def __init__(self, units: list[FlatUnit], params: list, grads: list, weight_decay: float):
        self.units, self.params, self.grads = units, params, grads
        self.weight_decay = weight_decay
        self.segments = [u.decay_segments() for u in units]
        self.exp_avg = [np.zeros_like(p) for p in params]
        self.exp_avg_sq = [np.zeros_like(p) for p in params]
        self.step_count = 0

    def clip_grad_norm_(self, max_norm: float, group: World) -> float:
        """Global norm from the chunks: each rank sums its squares (the padding adds zeros), one
        all-reduce adds the N partial sums; then the same scaling as optim.clip_grad_norm_."""
        squares = np.array([sum(float(np.dot(g, g)) for g in self.grads)])
        all_reduce(squares, op="sum", group=group)
        total = math.sqrt(float(squares[0]))
        scale = max_norm / (total + 1e-6)
        if scale < 1.0:
            for g in self.grads:
                g *= scale
        return total

    def step(self, lr: float) -> None:
        self.step_count += 1
        for u in range(len(self.units)):
            p, g, m, v = self.params[u], self.grads[u], self.exp_avg[u], self.exp_avg_sq[u]
            for a, b, decay in self.segments[u]:
                adamw_update(p[a:b], g[a:b], m[a:b], v[a:b], self.step_count, lr, BETAS, EPS,
                             self.weight_decay if decay else 0.0)

    def nbytes(self) -> int:
        return sum(m.nbytes + v.nbytes for m, v in zip(self.exp_avg, self.exp_avg_sq))


# ----------------------------------------------------------------------------- the trainer


class ZeroTrainer:
    """The serial training step under ZeRO stage 1, 2 or 3 on a data-parallel group.

        trainer = ZeroTrainer(config, settings, task, batch_size, group=world, stage=2)
        loss, acc = trainer.step(step)      # same numbers on every rank, = the serial run's
        trainer.memory()                    # this rank's live bytes by pile, and the peak
        trainer.state_dict()                # full weights, serial keys (collective: all ranks call)
        trainer.save_checkpoint(dir); trainer.load_checkpoint(dir)   # sharded, atomic

    `.model` is the full GPT for sampling in stages 1-2 (after the all-gather every rank holds
    all weights); in stage 3 no rank ever holds them all between steps, and `.model` is None.
    """

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, stage: int = 1):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r} (stage 0 is plain data parallelism)")
        self.world = resolve(group)
        n, rank = self.world.size, self.world.rank
        if batch_size % n:
            raise ValueError(f"global batch {batch_size} is not divisible by dp={n}")
        self.stage, self.name = stage, f"zero{stage}"
        self.task, self.batch_size, self.settings, self.config = task, batch_size, settings, config
        self.live = LiveBytes()
        self.activation_bytes = 0
        # Every rank builds the full model from the seed (same numbers as the serial run), then
        # keeps only what its stage needs. Real ZeRO-3 avoids ever materialising it (meta device).
        model = GPT(config, seed=seed)
        self.units = make_units(model, n, rank)
        self._check_same_layout(model)
        if stage < 3:
            # the parameters become views into one full flat buffer per unit; the owned chunk of
            # that buffer is what this rank's optimizer updates
            self.param_buffers = [u.flatten([p.data for p in u.params]) for u in self.units]
            for u, flat in zip(self.units, self.param_buffers):
                for p, view in zip(u.params, u.views(flat)):
                    p.data = view
            shards = [flat[u.lo:u.hi] for u, flat in zip(self.units, self.param_buffers)]
            self.model = model
        else:
            from minidist.parallel.fsdp import FullyShardedGPT

            shards = [u.flatten([p.data for p in u.params])[u.lo:u.hi].copy() for u in self.units]
            self.model = None
            self.fsdp = FullyShardedGPT(model, self.units, shards, self.world, self.live)
        self._model = model
        if stage == 1:  # full gradient buffers, kept: backward accumulates into views of them
            self.grad_buffers = [np.zeros(u.padded, dtype=u.dtype) for u in self.units]
            grads = [flat[u.lo:u.hi] for u, flat in zip(self.units, self.grad_buffers)]
        else:  # only the chunk of the gradient is kept; hooks reduce each unit as it completes
            grads = [np.zeros(u.chunk, dtype=u.dtype) for u in self.units]
            self._unit_of = {id(p): u for u in self.units for p in u.params}
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self.optimizer = ShardedAdamW(self.units, shards, grads, settings.weight_decay)

    def _check_same_layout(self, model) -> None:
        """Every rank must cut the same units from the same weights: compare sizes and checksums
        once here, so the steps can skip the per-call consistency check."""
        facts = np.array([u.padded for u in self.units]
                         + [float(np.sum(p.data, dtype=np.float64)) for p in model.parameters()])
        lowest, highest = facts.copy(), facts.copy()
        collectives.check_consistent(self.world, "zero layout", facts.size, facts.dtype)
        all_reduce(lowest, op="min", group=self.world)
        all_reduce(highest, op="max", group=self.world)
        if not np.array_equal(lowest, highest):
            raise RuntimeError(f"ZeRO: ranks built different units or weights (rank {self.world.rank}: "
                               f"unit sizes {[u.padded for u in self.units]})")

    # -- gradients
    def _grad_ready(self, p) -> None:
        """Stages 2-3: a parameter's gradient is complete; when its unit's are, reduce the unit."""
        self.live.add(p.grad.nbytes)  # the full gradient exists until its unit is reduced
        unit = self._unit_of[id(p)]
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._reduce_unit(self.units.index(unit))

    def _reduce_unit(self, index: int) -> None:
        """Copy the unit's gradients into a flat bucket, reduce_scatter(avg) it so that this rank
        receives the mean gradient of its chunk, and drop the full gradients at once."""
        unit = self.units[index]
        bucket = unit.flatten([p.grad for p in unit.params])
        self.live.add(bucket.nbytes)
        with unchecked():
            reduce_scatter(bucket, op="avg", group=self.world, out=self.optimizer.grads[index])
        self.live.sub(bucket.nbytes + sum(p.grad.nbytes for p in unit.params if p.grad is not None))
        for p in unit.params:
            p.grad = None
        unit.ready = -1  # reduced
        if self.stage == 3:
            self.fsdp.after_backward(index)

    def _zero_grad(self) -> None:
        for unit in self.units:
            unit.ready = 0
        if self.stage == 1:
            for unit, flat in zip(self.units, self.grad_buffers):
                flat[...] = 0.0
                for p, view in zip(unit.params, unit.views(flat)):
                    p.grad = view  # backward's `+=` lands in the flat buffer: no copy needed
        else:
            for grad in self.optimizer.grads:
                grad[...] = 0.0

    def _finish_gradients(self) -> None:
        with unchecked():
            if self.stage == 1:
                for unit, flat in zip(self.units, self.grad_buffers):
                    chunk = reduce_scatter(flat, op="avg", group=self.world)  # a chunk-sized temporary
                    self.live.add(chunk.nbytes)
                    flat[unit.lo:unit.hi] = chunk  # the owned part of the buffer now holds the mean
                    self.live.sub(chunk.nbytes)
                return
            for index, unit in enumerate(self.units):  # a unit that got no gradient at all
                if unit.ready != -1:
                    self._reduce_unit(index)

    # -- the step
    def step(self, step: int):
        """One optimizer step on the global batch; returns (global mean loss, accuracy)."""
        x, y = self.task.get_batch(step, self.batch_size, self.world.rank, self.world.size)
        self._zero_grad()
        forward = self.fsdp if self.stage == 3 else self._model
        logits, loss = forward(x, y)
        if not self.activation_bytes:  # every step builds the same graph: measure it once
            self.activation_bytes = graph_bytes(loss)
        loss.backward()
        self._finish_gradients()
        if self.settings.clip:
            self.optimizer.clip_grad_norm_(self.settings.clip, self.world)
        self.optimizer.step(self.settings.lr_at(step))
        if self.stage < 3:  # every rank needs every updated weight for the next forward
            with unchecked():
                for flat, shard in zip(self.param_buffers, self.optimizer.params):
                    all_gather(shard, group=self.world, out=flat)
        stats = np.array([loss.item(), accuracy(logits.data, y)])
        all_reduce(stats, op="avg", group=self.world)
        return float(stats[0]), float(stats[1])

    # -- measurements and state
    def memory(self) -> dict:
        """This rank's bytes by pile. `params` and `grads` are what stays allocated between steps
        (stage 3: the parameter chunks); `transient` is the most that gathered units and gradient
        buckets ever held at once; `peak` adds everything, as pessimistic as memory.ledger."""
        if self.stage < 3:
            params = sum(flat.nbytes for flat in self.param_buffers)
        else:
            params = sum(shard.nbytes for shard in self.optimizer.params)
        grads = sum(flat.nbytes for flat in self.grad_buffers) if self.stage == 1 else \
            sum(g.nbytes for g in self.optimizer.grads)
        piles = {"params": params, "grads": grads, "optimizer": self.optimizer.nbytes(),
                 "activations": int(self.activation_bytes), "transient": self.live.peak}
        piles["peak"] = sum(piles.values())
        if self.stage == 3:  # the most full weights alive at once: root + one block, not the model
            piles["gathered"] = self.fsdp.gathered_peak
        return piles

    def num_parameters(self) -> int:
        return sum(u.numel for u in self.units)

    def state_dict(self) -> dict:
        """Full weights keyed like the serial model's. Collective in stage 3 (call on all ranks)."""
        if self.stage < 3:
            return self._model.state_dict()
        return self.fsdp.full_state_dict()

    def save_checkpoint(self, directory) -> None:
        from minidist.parallel.zero_checkpoint import save_checkpoint

        save_checkpoint(self, directory)

    def load_checkpoint(self, directory) -> None:
        from minidist.parallel.zero_checkpoint import load_checkpoint

        load_checkpoint(self, directory)
