"""Composed parallelism: data x tensor x pipeline on one device mesh (chapter 9).

Each strategy of chapters 3-8 cut one thing: the batch (DP), the matrices (TP), the layers (PP),
the model states (ZeRO). Real training runs cut all of them at once — Megatron-LM's PTD-P
trained a trillion-parameter GPT on tensor 8 x pipeline 64 x data 6 — and this is the one file
that knows how they fit together. The mesh (`mesh.py`) gives each rank its place (pp, dp, tp)
and a group per axis; then:

    PP  the engine of chapter 5 (`PipelineTrainer`) runs the schedule over the pp group;
    TP  each stage is built from chapter 6's layers over the tp group (`tensor_stage.py`);
    DP  each replica trains on its B/dp rows of the global batch, in m micro-batches.

What happens at the end of the step, in order, and why (`MeshTrainer.finish_gradients`):

    1. tp: with sequence parallelism, the replicated parameters' partial gradients (each tp rank
       saw T/t tokens) are summed over the tp group.
    2. embedding: the tied word embedding lives on the first stage (input) and the last (head);
       the two halves of its gradient are summed over the embedding group.
    3. dp: each stage's gradients are averaged over its dp group ONCE, after the stage's last
       micro-batch backward — never per micro-batch (the sum over micro-batches is linear, so
       averaging it once moves 1/m of the bytes). Each rank averages only its own shard: dp
       traffic is 2(N-1)/N x (this rank's parameter bytes), not the whole model's.
       (Sums and averages are linear: any order gives the serial gradient. This one lets ZeRO-1
       work on whole gradients until its reduce-scatter.)
    4. clipping: the norm of the *whole* model's gradient: each rank's squares (tp-split
       parameters always; replicated ones on tp rank 0 only; the tied copy on the first stage
       only), summed over the tp group and then the pp group. The dp ranks hold equal copies
       after step 1, so they are not summed.

Then every rank updates its shard with AdamW: `MeshTrainer` keeps a full AdamW per rank (DP),
`MeshZero1Trainer` cuts its moments over the dp group (ZeRO-1, as Megatron-LM's distributed
optimizer does). ZeRO-2/3 do not mix with a pipeline: they shard the gradients, which must
persist across the micro-batches of a step, so each micro-batch would repeat the dp traffic
(DeepSpeed refuses the combination too).

Parallel equals serial: every shard is cut from the serial model's initialisation, and every
factorisation of the world reproduces the serial run's losses and weights
(tests/test_parallel_mesh.py).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from minidist import memory
from minidist.comm import all_gather, all_reduce, any_rank, reduce_scatter
from minidist.comm.world import World, resolve
from minidist.data import accuracy
from minidist.mixed_precision import finish_step, to_low_precision
from minidist.model import GPTConfig
from minidist.parallel.data_parallel import DistributedDataParallel
from minidist.parallel.mesh import DeviceMesh, check_mesh, layout
from minidist.parallel.pipeline import PipelineStage, PipelineTrainer, check_pipeline_layout, merge_stage_states
from minidist.parallel.tensor_parallel import check_tensor_parallel, consolidate_state_dict, vocab_parallel_accuracy
from minidist.parallel.tensor_stage import SequenceParallelStage, TensorParallelStage
from minidist.parallel import zero_checkpoint
from minidist.parallel.zero_partition import (ShardedAdamW, flat_parameters, make_units, master_chunks,
                                              mixed_precision_step)
from minidist.precision import autocast
from minidist.tensor import get_default_dtype
from minidist.train import (OptimSettings, load_training_state, make_optimizer, make_scaler, precision_report,
                            training_state)


def check_composed(config: GPTConfig, world_size: int, batch_size: int, dp: int = 1, tp: int = 1, pp: int = 1,
                   microbatches: int = 1, schedule: str = "1f1b", virtual_stages: int = 1,
                   sequence_parallel: bool = False, zero: int = 0) -> None:
    """Every way a composed layout can be wrong, in one line, before any message (pure arithmetic)."""
    check_mesh(world_size, dp, tp, pp, config, batch_size, microbatches)
    check_tensor_parallel(config, tp, sequence_parallel)
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallelism needs tp > 1 (it splits what tensor parallelism replicates)")
    check_pipeline_layout(config, batch_size // dp, pp, microbatches, schedule, virtual_stages)
    if zero not in (0, 1):
        raise ValueError(f"ZeRO stage {zero} inside a mesh with micro-batches or pipeline stages: stages 2 and 3 shard "
                         "the gradients, which must persist across a step's micro-batches (sharding them would repeat "
                         "the dp traffic on every micro-batch; DeepSpeed refuses this too): use --zero 1")


class MeshTrainer(PipelineTrainer):
    """The serial training step on a pp x dp x tp mesh of the ranks of `group`.

    `dp * tp * pp` must be the group's size. tp = 1 stages are chapter 5's `PipelineStage`;
    tp > 1 stages are `TensorParallelStage` (or `SequenceParallelStage`). pp = 1 is a one-stage
    pipeline: the step is m micro-batches of gradient accumulation, then the update."""

    zero = 0

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, dp: int = 1, tp: int = 1, pp: int = 1, microbatches: int = 1,
                 schedule: str = "1f1b", virtual_stages: int | None = None, sequence_parallel: bool = False,
                 bucket_cap_bytes: int = 1 << 20, precision: str = "fp32", fp32_grads: bool = False):
        world = resolve(group)
        v = virtual_stages if virtual_stages is not None else (2 if schedule == "interleaved" else 1)
        check_composed(config, world.size, batch_size, dp, tp, pp, microbatches, schedule, v, sequence_parallel,
                       self.zero)
        self.mesh = mesh = DeviceMesh(world, dp=dp, tp=tp, pp=pp)
        self.sequence_parallel, self.precision, self.fp32_grads = sequence_parallel, precision, fp32_grads
        self.scaler = make_scaler(precision, settings)
        # every tensor-parallel message's size follows from these facts: checked once (chapter 7)
        self.tp_group = mesh.tp_group.verify("the tensor-parallel layout",
                                             [config, tp, get_default_dtype().str, sequence_parallel])
        super().__init__(config, settings, task, batch_size, seed, group=mesh.pp_group, microbatches=microbatches,
                         schedule=schedule, virtual_stages=v)
        self.name = mesh_name(dp, tp, pp, self.zero, sequence_parallel)
        self.model = None  # no rank holds the whole model (tp = pp = 1 would: use the dp trainer)
        self.build_data_parallel(bucket_cap_bytes)

    def build_stage(self, config: GPTConfig, seed: int, virtual_stages: int):
        if self.mesh.tp == 1:
            stage = PipelineStage(config, self.rank, self.stages, seed, virtual_stages)
        else:
            kind = SequenceParallelStage if self.sequence_parallel else TensorParallelStage
            stage = kind(config, self.tp_group, self.rank, self.stages, seed, virtual_stages)
        # chapter 10: 16-bit weights, so 16-bit activations between stages and 16-bit gradients
        self.masters = to_low_precision(stage, self.precision) if self.precision != "fp32" else None
        return stage

    def build_optimizer(self, settings: OptimSettings):
        return make_optimizer(self.stage, settings, self.masters)

    def build_data_parallel(self, bucket_cap_bytes: int) -> None:
        """Chapter 3's bucketed wrapper over the dp group, around this rank's stage shard."""
        self.ddp = DistributedDataParallel(self.stage, self.mesh.dp_group, bucket_cap_bytes, timeline=self.timeline,
                                           grad_dtype=np.float32 if self.fp32_grads else None)

    def accumulating(self):
        """While the schedule runs, gradients accumulate locally: no dp message per micro-batch."""
        return self.ddp.no_sync()

    # -- the step
    def step(self, step: int):
        with self.accumulating():
            loss, acc = super().step(step)  # the pipeline of this replica; finish_gradients inside
        stats = np.array([loss, acc])  # equal rows per replica: the mean of means is the mean
        all_reduce(stats, op="avg", group=self.mesh.dp_group)
        return float(stats[0]), float(stats[1])

    def batch(self, step: int):
        """This replica's B/dp rows of the global batch (the same on every tp and pp rank of it)."""
        return self.task.get_batch(step, self.batch_size, self.mesh.place.dp, self.mesh.dp)

    def activation_shape(self, rows: int, length: int) -> tuple:
        """With sequence parallelism a stage hands on its T/t tokens only."""
        return (rows, length // self.mesh.tp if self.sequence_parallel else length, self.config.n_embd)

    def _forward(self, i: int, c: int = 0):
        with autocast(self.precision):  # fp32: nothing changes
            super()._forward(i, c)

    def backward_loss(self, loss):
        return self.scaler.scale_loss(super().backward_loss(loss))  # fp32 and bf16: no scaling

    def accuracy(self, logits: np.ndarray, targets) -> float:
        logits = np.asarray(logits, dtype=np.float32) if self.precision != "fp32" else logits
        if self.mesh.tp == 1:
            return accuracy(logits, targets)
        return vocab_parallel_accuracy(logits, targets, self.tp_group, self.stage.vocab_start_index())

    # -- the end of the step (see the module docstring for the order)
    def finish_gradients(self) -> None:
        if self.mesh.tp > 1:
            self.stage.finish_gradients()  # sequence parallelism's partial sums (or nothing)
        self._sync_tied_weight()
        self.average_over_replicas()

    def average_over_replicas(self) -> None:
        self.ddp.finish_gradient_synchronization()  # every bucket's all-reduce, once per step

    def _sync_tied_weight(self) -> None:
        """The first and last stage add their halves of wte's gradient (one all-reduce of two ranks)."""
        group = self.mesh.embedding_group
        if not self.config.tie_weights or group is None or group.size == 1:
            return
        weight = self.stage.wte.weight
        if weight.grad is None:
            weight.grad = np.zeros_like(weight.data)
        all_reduce(weight.grad, op="sum", group=group)  # a + b == b + a: both copies get the same bits

    def counted_in_norm(self, p) -> bool:
        """Is p's gradient counted in the global norm on this rank? Each element once in the mesh."""
        if p is self.stage.tied_copy():
            return False  # the first stage counts the tied weight
        return getattr(p, "tensor_model_parallel", False) or self.mesh.place.tp == 0

    def _global_grad_norm(self) -> float:
        if self.precision != "fp32":
            return float("nan")  # taken in update, of the unscaled fp32 gradients
        params = self.stage.parameters()
        return self.norm_of(params, [p.grad for p in params])

    def norm_of(self, params: list, grads: list) -> float:
        """The whole model's gradient norm from this rank's `grads` (of `params`)."""
        squared = np.array([sum(float(np.dot(g.ravel(), g.ravel())) for p, g in zip(params, grads)
                                if g is not None and self.counted_in_norm(p))])
        all_reduce(squared, op="sum", group=self.tp_group)
        all_reduce(squared, op="sum", group=self.group)
        return math.sqrt(squared[0])

    def update(self, total_norm: float) -> None:
        if self.precision == "fp32":
            return super().update(total_norm)
        # every rank holds a piece of the gradients: all skip together, or none (chapter 10)
        finish_step(self.optimizer, self.scaler, self.settings, self.step_index,
                    agree=lambda found_inf: any_rank(found_inf, self.mesh.world),
                    norm=lambda grads: self.norm_of(self.optimizer.params(), grads))

    def checkpoint_state(self) -> dict[str, np.ndarray]:
        return training_state(self.stage, self.optimizer, self.scaler)

    def load_checkpoint_state(self, state: dict[str, np.ndarray]) -> None:
        load_training_state(self.stage, self.optimizer, state, self.scaler)

    # -- reports and state
    def report(self) -> dict:
        report = {"mesh": mesh_report(self.mesh), **precision_report(self.precision, self.scaler)}
        if self.stages > 1:
            report["pipeline"] = self.pipeline_report()
        return report

    def state_dict(self) -> dict | None:
        """Collective. The serial model's state dict on world rank 0 (None elsewhere): shards glued
        over each tp group, then the stages of replica 0 gathered."""
        if self.mesh.tp > 1:
            mine = consolidate_state_dict(self.stage)  # every tp rank takes part; tp rank 0 receives
        else:
            mine = self.stage.state_dict()
        keep = self.mesh.place.dp == 0 and self.mesh.place.tp == 0
        parts = self.mesh.world.comm.gather(mine if keep else None, root=0)  # small and once: pickle
        if self.mesh.world.rank != 0:
            return None
        return merge_stage_states([part for part in parts if part is not None])


class MeshZero1Trainer(MeshTrainer):
    """The mesh with ZeRO-1 over the dp group: AdamW's moments cut into dp chunks of this rank's
    shard (Megatron-LM's `--use-distributed-optimizer`). Gradients still accumulate over the
    micro-batches in full; at the end of the step each unit is reduce-scattered (averaged) so
    that a rank receives the chunk it updates, and the updated chunks are all-gathered."""

    zero = 1

    def build_data_parallel(self, bucket_cap_bytes: int) -> None:
        """ZeRO-1's partition of chapter 8 (`zero_partition.py`), applied to this rank's stage shard."""
        dp = self.mesh.dp_group
        self.units = make_units(self.stage, dp.size, dp.rank)  # no root unit on a middle stage
        # replicas of one shard cut the same units: checked once, then every collective is one line
        self.dp_group = dp.verify("the mesh's ZeRO units", [(u.name, u.padded, np.dtype(u.dtype).str) for u in self.units])
        self.param_buffers = flat_parameters(self.units)  # one all-gather per unit refreshes the weights
        self.grad_chunks = [np.zeros(u.chunk, dtype=u.dtype) for u in self.units]
        self.norm_weights = [u.flatten([np.full(p.shape, float(self.counted_in_norm(p))) for p in u.params])[u.lo:u.hi]
                             for u in self.units]
        self.optimizer = ShardedAdamW(self.units, [flat[u.lo:u.hi] for u, flat in zip(self.units, self.param_buffers)],
                                      self.grad_chunks, self.settings.weight_decay,
                                      master_chunks(self.units, self.masters))  # 16-bit: fp32 masters (chapter 10)
        self.module = self.stage  # what zero_checkpoint's per-rank state reads the generators from

    def accumulating(self):
        return contextlib.nullcontext()

    def average_over_replicas(self) -> None:
        """Each rank needs only its chunk of the averaged gradient: one reduce-scatter per unit."""
        for unit, chunk in zip(self.units, self.grad_chunks):
            reduce_scatter(unit.flatten([p.grad for p in unit.params]), op="avg", group=self.dp_group, out=chunk)

    def _global_grad_norm(self) -> float:
        if self.precision != "fp32":
            return float("nan")  # taken in update, of the unscaled fp32 chunks
        return self.optimizer.grad_norm(self.norm_groups(), self.norm_weights)

    def norm_groups(self) -> list:
        """Chunks over dp, shards over tp, stages over pp: each element of the model counted once."""
        return [self.dp_group, self.tp_group, self.group]

    def update(self, total_norm: float) -> None:
        if self.precision != "fp32":
            mixed_precision_step(self.optimizer, self.scaler, self.settings, self.step_index, self.mesh.world,
                                 self.norm_groups(), self.norm_weights)
        else:
            if self.settings.clip:
                self.optimizer.clip_to(self.settings.clip, total_norm)
            self.optimizer.step(self.settings.lr_at(self.step_index))
        self.all_gather_parameters()

    def all_gather_parameters(self) -> None:
        """The updated chunks to every replica: the stage's weights are whole again."""
        for flat, chunk in zip(self.param_buffers, self.optimizer.params):
            all_gather(chunk, group=self.dp_group, out=flat)

    def memory(self) -> dict:
        ledger = memory.ledger(self.stage, None, self.peak_bytes[self.rank])
        ledger["params"] = sum(flat.nbytes for flat in self.param_buffers)  # padded flat buffers
        ledger["optimizer"] = self.optimizer.nbytes()
        ledger["peak"] = ledger["params"] + ledger["grads"] + ledger["optimizer"] + ledger["activations"]
        return memory.with_masters_apart(ledger, self.optimizer.master_nbytes())

    def checkpoint_state(self) -> dict[str, np.ndarray]:
        """This rank's chunk of every unit (weights, moments, masters), the step count, its
        generators and loss scale: ZeRO's own per-rank state (zero_checkpoint.py)."""
        return zero_checkpoint.checkpoint_state(self)

    def load_checkpoint_state(self, state: dict[str, np.ndarray]) -> None:
        zero_checkpoint.load_checkpoint_state(self, state)  # collective over dp: the weights re-gathered


def MeshTrainerFor(zero: int = 0):
    """The mesh trainer class for a ZeRO stage (0: plain data parallelism over the dp group)."""
    return {0: MeshTrainer, 1: MeshZero1Trainer}[zero]


def mesh_name(dp: int, tp: int, pp: int, zero: int = 0, sequence_parallel: bool = False) -> str:
    """'dp2-tp2', 'tp2-pp2', 'dp2-tp2-pp2-zero1': the degrees above 1, in the mesh's order."""
    parts = [f"{axis}{degree}" for axis, degree in (("dp", dp), ("tp", tp), ("pp", pp)) if degree > 1]
    return "-".join(parts + (["sp"] if sequence_parallel else []) + ([f"zero{zero}"] if zero else [])) or "serial"


def mesh_report(mesh: DeviceMesh) -> dict:
    """The demo's `mesh` JSON: the shape and every rank's place (no messages: pure arithmetic)."""
    rows = layout(mesh.world.size, dp=mesh.dp, tp=mesh.tp, pp=mesh.pp)
    return {"shape": {"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp}, "order": "pp-dp-tp (tp fastest)",
            "ranks": [{"rank": p.rank, "pp": p.pp, "dp": p.dp, "tp": p.tp, "tp_group": list(p.tp_group),
                       "dp_group": list(p.dp_group), "pp_group": list(p.pp_group),
                       "embedding_group": list(p.embedding) if p.embedding else None} for p in rows]}
