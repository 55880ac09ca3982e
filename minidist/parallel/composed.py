"""Composed parallelism: data x tensor x pipeline (x context) on one device mesh (chapter 9).

Each strategy of chapters 3-8 cut one thing: the batch (DP), the matrices (TP), the layers (PP),
the model states (ZeRO). Real training runs cut all of them at once — Megatron-LM's PTD-P
trained a trillion-parameter GPT on tensor 8 x pipeline 64 x data 6 — and this is the one file
that knows how they fit together. The mesh (`mesh.py`) gives each rank its place (pp, dp, cp,
tp) and a group per axis; then:

    PP  the engine of chapter 5 (`PipelineTrainer`) runs the schedule over the pp group;
    TP  each stage is built from chapter 6's layers over the tp group (`tensor_stage.py`);
    DP  each replica trains on its B/dp rows of the global batch, in m micro-batches;
    CP  (chapter 11, `cp > 1`) each sequence of them is split over the cp group: a rank holds
        T/cp tokens, and its stages' attention rings over the cp group (`context_stage.py`).
        Each rank's loss is its tokens' share of the micro-batch's mean, so the cp ranks'
        gradients add up to the replica's (Megatron-LM's `--context-parallel-size`).

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
       With cp, this step is where cp sits: the cp ranks of a replica hold the same weights, so
       one all-reduce over the flattened dp x cp group (Megatron's "dp-cp") averages over both;
       the loss was multiplied by cp before backward, so that average is the sum over cp and
       the mean over dp. Steps 1 and 2 come before it on each cp rank's own tokens' gradients
       (each is linear in them); ZeRO-1 cuts its chunks over the same dp x cp group.
    4. clipping: the norm of the *whole* model's gradient: each rank's squares (tp-split
       parameters always; replicated ones on tp rank 0 only; the tied copy on the first stage
       only), summed over the tp group and then the pp group. The dp (and cp) ranks hold equal
       copies after step 3, so they are not summed.

Then every rank updates its shard with AdamW: `MeshTrainer` keeps a full AdamW per rank (DP),
`MeshZero1Trainer` cuts its moments over the dp group (ZeRO-1, as Megatron-LM's distributed
optimizer does). ZeRO-2/3 do not mix with a pipeline: they shard the gradients, which must
persist across the micro-batches of a step, so each micro-batch would repeat the dp traffic
(DeepSpeed refuses the combination too).

Parallel equals serial: every shard is cut from the serial model's initialisation, and every
factorisation of the world reproduces the serial run's losses and weights
(tests/test_parallel_mesh.py; with cp, tests/test_parallel_context_mesh.py).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from minidist.plan import memory
from minidist.comm import all_gather, all_reduce, reduce_scatter
from minidist.comm.world import World, resolve
from minidist.core.data import accuracy
from minidist.core.model import GPTConfig
from minidist.parallel.context_parallel import SequenceSplit
from minidist.parallel.context_stage import ContextSplit, check_context_stage, context_parallel_stage
from minidist.parallel.data_parallel import DistributedDataParallel
from minidist.parallel.mesh import DeviceMesh, check_mesh, layout
from minidist.parallel.pipeline import PipelineStage, PipelineTrainer, check_pipeline_layout, merge_stage_states
from minidist.parallel.tensor_parallel import check_tensor_parallel, consolidate_state_dict, vocab_parallel_accuracy
from minidist.parallel.tensor_stage import SequenceParallelStage, TensorParallelStage
from minidist.parallel.zero_partition import (ShardedAdamW, chunk_state, flat_parameters, load_chunk_state,
                                              make_units, master_chunks, mixed_precision_step)
from minidist.core.tensor import get_default_dtype
from minidist.training.train import (OptimSettings, generator_state, load_generator_states, load_scaler_state,
                            load_training_state, scaler_state,
                            training_state)


def check_composed(config: GPTConfig, world_size: int, batch_size: int, dp: int = 1, tp: int = 1, pp: int = 1,
                   microbatches: int = 1, schedule: str = "1f1b", virtual_stages: int = 1,
                   sequence_parallel: bool = False, zero: int = 0, cp: int = 1, cp_algorithm: str = "ring",
                   cp_split: str = "zigzag") -> None:
    """Every way a composed layout can be wrong, in one line, before any message (pure arithmetic)."""
    check_mesh(world_size, dp, tp, pp, config, batch_size, microbatches, cp=cp)
    if cp > 1:
        check_context_stage(config, cp, tp, cp_algorithm, cp_split, sequence_parallel)
    check_tensor_parallel(config, tp, sequence_parallel)
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallelism needs tp > 1 (it splits what tensor parallelism replicates)")
    check_pipeline_layout(config, batch_size // dp, pp, microbatches, schedule, virtual_stages)
    if zero not in (0, 1):
        raise ValueError(f"ZeRO stage {zero} inside a mesh with micro-batches or pipeline stages: stages 2 and 3 shard "
                         "the gradients, which must persist across a step's micro-batches (sharding them would repeat "
                         "the dp traffic on every micro-batch; DeepSpeed refuses this too): use --zero 1")


class MeshTrainer(PipelineTrainer):
    """The serial training step on a pp x dp x cp x tp mesh of the ranks of `group`.

    `dp * cp * tp * pp` must be the group's size. tp = 1 stages are chapter 5's `PipelineStage`;
    tp > 1 stages are `TensorParallelStage` (or `SequenceParallelStage`). pp = 1 is a one-stage
    pipeline: the step is m micro-batches of gradient accumulation, then the update. cp > 1
    (chapter 11) runs each stage on this rank's T/cp tokens of every sequence, its attention by
    `cp_algorithm` ("ring" or "ulysses") over the cp group, the tokens chosen by `cp_split`
    ("zigzag" or "contiguous"); see `context_stage.py`."""

    zero = 0

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, dp: int = 1, tp: int = 1, pp: int = 1, microbatches: int = 1,
                 schedule: str = "1f1b", virtual_stages: int | None = None, sequence_parallel: bool = False,
                 bucket_cap_bytes: int = 1 << 20, precision: str = "fp32", fp32_grads: bool = False,
                 cp: int = 1, cp_algorithm: str = "ring", cp_split: str = "zigzag", ep: int = 1,
                 stage_blocks: list[int] | None = None):
        world = resolve(group)
        v = virtual_stages if virtual_stages is not None else (2 if schedule == "interleaved" else 1)
        check_composed(config, world.size, batch_size, dp, tp, pp, microbatches, schedule, v, sequence_parallel,
                       self.zero, cp, cp_algorithm, cp_split)
        self.mesh = mesh = DeviceMesh(world, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)  # ep: expert_stage.py
        self.sequence_parallel, self.fp32_grads = sequence_parallel, fp32_grads
        # every tensor-parallel message's size follows from these facts: checked once (chapter 7)
        self.tp_group = mesh.tp_group.verify("the tensor-parallel layout",
                                             [config, tp, get_default_dtype().str, sequence_parallel])
        # chapter 11: this rank's piece of every sequence; the ranks holding the same weights are then dp x cp
        self.context = None if cp == 1 else ContextSplit(
            mesh.cp_group.verify("the context-parallel layout", [config, cp, tp, cp_algorithm, cp_split,
                                                                 get_default_dtype().str]),
            SequenceSplit(config.block_size, cp, cp_split), cp_algorithm)
        self.replica_group = mesh.dp_group if cp == 1 else mesh["dp_cp"]
        super().__init__(config, settings, task, batch_size, seed, group=mesh.pp_group, microbatches=microbatches,
                         schedule=schedule, virtual_stages=v, precision=precision, stage_blocks=stage_blocks)
        self.name = mesh_name(dp, tp, pp, self.zero, sequence_parallel, cp, cp_algorithm, cp_split)
        self.model = None  # no rank holds the whole model (tp = pp = 1 would: use the dp trainer)
        self.build_data_parallel(bucket_cap_bytes)

    def build_stage(self, config: GPTConfig, seed: int, virtual_stages: int):
        if self.context is not None:  # the same stage on this rank's tokens (chapter 11)
            stage = context_parallel_stage(self.context, config, self.tp_group, self.rank, self.stages, seed,
                                           virtual_stages, self.sequence_parallel)
        elif self.mesh.tp == 1:
            stage = PipelineStage(config, self.rank, self.stages, seed, virtual_stages, self.stage_blocks)
        else:
            kind = SequenceParallelStage if self.sequence_parallel else TensorParallelStage
            stage = kind(config, self.tp_group, self.rank, self.stages, seed, virtual_stages)
        return self.cast(stage)  # chapter 10: 16-bit weights, their fp32 masters

    def build_data_parallel(self, bucket_cap_bytes: int) -> None:
        """Chapter 3's bucketed wrapper over the dp (x cp) group, around this rank's stage shard."""
        self.ddp = DistributedDataParallel(self.stage, self.replica_group, bucket_cap_bytes, timeline=self.timeline,
                                           grad_dtype=np.float32 if self.fp32_grads else None)

    def accumulating(self):
        """While the schedule runs, gradients accumulate locally: no dp message per micro-batch."""
        return self.ddp.no_sync()

    # -- the step
    def step(self, step: int):
        with self.accumulating():
            loss, acc = super().step(step)  # the pipeline of this replica; finish_gradients inside
        stats = np.array([loss, acc])  # equal rows per replica: the mean of means is the mean
        all_reduce(stats, op="avg", group=self.replica_group)
        stats *= self.mesh.cp  # a cp rank's numbers are its tokens' shares: their sum over cp, not the mean
        return float(stats[0]), float(stats[1])

    def batch(self, step: int):
        """This replica's B/dp rows of the global batch (the same on every tp and pp rank of it).
        With cp: this rank's tokens of them, and the whole sequences' targets (the stage's head
        takes its tokens' targets, and weighs their loss by their share of the counted ones)."""
        x, y = self.task.get_batch(step, self.batch_size, self.mesh.place.dp, self.mesh.dp)
        return (x, y) if self.context is None else (self.context.tokens(x), y)

    def activation_shape(self, rows: int, length: int) -> tuple:
        """With sequence parallelism a stage hands on its T/t tokens only."""
        return (rows, length // self.mesh.tp if self.sequence_parallel else length, self.config.n_embd)

    def loss_share(self, loss):
        loss = super().loss_share(loss)
        if self.context is not None:  # shares of the loss, averaged over dp x cp: x cp makes it their sum over cp
            loss = loss * self.mesh.cp
        return loss

    def accuracy(self, logits: np.ndarray, targets) -> float:
        if self.context is not None:  # whole sequences' targets: my tokens' share of their accuracy
            share = self.context.share(targets)
            mine = self.token_accuracy(logits, self.context.tokens(targets))  # (a collective over tp: always)
            return share * mine if share else 0.0
        return self.token_accuracy(logits, targets)

    def token_accuracy(self, logits: np.ndarray, targets) -> float:
        logits = np.asarray(logits, dtype=np.float32) if self.amp.low else logits
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

    def everyone(self) -> World:
        return self.mesh.world  # every rank holds a piece of the gradients

    def norm_of(self, params: list, grads: list) -> float:
        """The whole model's gradient norm from this rank's `grads` (of `params`)."""
        squared = np.array([sum(float(np.dot(g.ravel(), g.ravel())) for p, g in zip(params, grads)
                                if g is not None and self.counted_in_norm(p))])
        all_reduce(squared, op="sum", group=self.tp_group)
        all_reduce(squared, op="sum", group=self.group)
        return math.sqrt(squared[0])

    def global_state(self) -> dict:
        """This rank's shards as pieces of the serial arrays (where its tp box sits); the last
        stage's copy of a tied embedding is the first stage's to write. No messages."""
        return training_state(self.stage, self.optimizer, self.scaler, self.tp_group.rank, (self.stage.tied_copy(),))

    def load_global_state(self, read) -> None:
        load_training_state(self.stage, self.optimizer, read, self.scaler, self.tp_group.rank)

    # -- reports and state
    def report(self) -> dict:
        report = {"mesh": mesh_report(self.mesh), **self.amp.report()}
        if self.stages > 1:
            report["pipeline"] = self.pipeline_report()
        if self.context is not None:
            report["context_parallel"] = self.context.report(self.config, self.batch_size // self.mesh.dp, self.mesh.tp,
                                                             len(list(self.stage.h)))
        return report

    def state_dict(self) -> dict | None:
        """Collective. The serial model's state dict on world rank 0 (None elsewhere): shards glued
        over each tp group, then the stages of replica 0 (cp rank 0) gathered."""
        if self.mesh.tp > 1:
            mine = consolidate_state_dict(self.stage)  # every tp rank takes part; tp rank 0 receives
        else:
            mine = self.stage.state_dict()
        keep = self.mesh.place.dp == 0 and self.mesh.place.cp == 0 and self.mesh.place.tp == 0
        parts = self.mesh.world.comm.gather(mine if keep else None, root=0)  # small and once: pickle
        if self.mesh.world.rank != 0:
            return None
        return merge_stage_states([part for part in parts if part is not None])


class MeshZero1Trainer(MeshTrainer):
    """The mesh with ZeRO-1 over the dp group: AdamW's moments cut into dp chunks of this rank's
    shard (Megatron-LM's `--use-distributed-optimizer`). Gradients still accumulate over the
    micro-batches in full; at the end of the step each unit is reduce-scattered (averaged) so
    that a rank receives the chunk it updates, and the updated chunks are all-gathered. With cp,
    the chunks are cut over the flattened dp x cp group: its ranks hold the same weights."""

    zero = 1

    def build_data_parallel(self, bucket_cap_bytes: int) -> None:
        """ZeRO-1's partition of chapter 8 (`zero_partition.py`), applied to this rank's stage shard."""
        dp = self.replica_group
        units = make_units(self.stage, dp.size, dp.rank)  # no root unit on a middle stage
        # replicas of one shard cut the same units: checked once, then every collective is one line
        self.dp_group = dp.verify("the mesh's ZeRO units", [(u.name, u.padded, np.dtype(u.dtype).str) for u in units])
        self.build_data_parallel_units(units)

    def build_data_parallel_units(self, units: list) -> None:
        """Flat weights, gradient chunks and the sharded AdamW over `units`."""
        self.units = units
        self.param_buffers = flat_parameters(self.units)  # one all-gather per unit refreshes the weights
        self.grad_chunks = [np.zeros(u.chunk, dtype=u.dtype) for u in self.units]
        self.norm_weights = [u.flatten([np.full(p.shape, float(self.counted_in_norm(p))) for p in u.params])[u.lo:u.hi]
                             for u in self.units]
        self.optimizer = ShardedAdamW(self.units, [flat[u.lo:u.hi] for u, flat in zip(self.units, self.param_buffers)],
                                      self.grad_chunks, self.settings.weight_decay,
                                      master_chunks(self.units, self.masters),  # 16-bit: fp32 masters (chapter 10)
                                      self.settings.betas, self.settings.eps)
        self.module = self.stage  # the module that runs (its generators are in the checkpoint)

    def accumulating(self):
        return contextlib.nullcontext()

    def average_over_replicas(self) -> None:
        """Each rank needs only its chunk of the averaged gradient: one reduce-scatter per unit."""
        for unit, chunk in zip(self.units, self.grad_chunks):
            reduce_scatter(unit.flatten([p.grad for p in unit.params]), op="avg", group=self.dp_group, out=chunk)

    def norm_groups(self) -> list:
        """Chunks over dp, shards over tp, stages over pp: each element of the model counted once."""
        return [self.dp_group, self.tp_group, self.group]

    def update(self) -> None:
        """ZeRO-1's sharded step (chapter 8; in 16 bits on the fp32 master chunks), then the gather."""
        if self.amp.low:
            mixed_precision_step(self.optimizer, self.scaler, self.settings, self.step_index, self.mesh.world,
                                 self.norm_groups(), self.norm_weights)
        else:
            if self.settings.clip:
                self.optimizer.clip_to(self.settings.clip, self.optimizer.grad_norm(self.norm_groups(), self.norm_weights))
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

    def global_state(self) -> dict:
        """This rank's chunk of every unit (weights, moments, masters) as pieces of the serial
        arrays, the step count, its generators and loss scale, as Zero1Trainer's. No messages."""
        return {**chunk_state(self.units, self.optimizer, self.tp_group.rank, (self.stage.tied_copy(),)),
                **scaler_state(self.scaler), **generator_state(self.stage)}

    def load_global_state(self, read) -> None:
        """The chunks cut from the whole arrays, the stage's full weights too: nothing gathered."""
        load_chunk_state(self.units, self.optimizer, self.param_buffers, read, self.tp_group.rank)
        load_scaler_state(self.scaler, read)
        load_generator_states(self.stage, read)


def MeshTrainerFor(zero: int = 0):
    """The mesh trainer class for a ZeRO stage (0: plain data parallelism over the dp group)."""
    return {0: MeshTrainer, 1: MeshZero1Trainer}[zero]


def mesh_name(dp: int, tp: int, pp: int, zero: int = 0, sequence_parallel: bool = False, cp: int = 1,
              cp_algorithm: str = "ring", cp_split: str = "zigzag") -> str:
    """'dp2-tp2', 'tp2-pp2', 'dp2-tp2-pp2-zero1', 'tp2-cp2-ulysses': the degrees above 1 (dp, tp,
    pp, cp, as a Layout's name), then sp and zero, then cp's choices where not the defaults."""
    parts = [f"{axis}{degree}" for axis, degree in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)) if degree > 1]
    parts += (["sp"] if sequence_parallel else []) + ([f"zero{zero}"] if zero else [])
    if cp > 1:
        parts += [choice for choice in (cp_algorithm, cp_split) if choice not in ("ring", "zigzag")]
    return "-".join(parts) or "serial"


def mesh_report(mesh: DeviceMesh) -> dict:
    """The demo's `mesh` JSON: the shape and every rank's place (no messages: pure arithmetic)."""
    rows = layout(mesh.world.size, dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp)
    report = {"shape": {"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp}, "order": "pp-dp-tp (tp fastest)",
              "ranks": [{"rank": p.rank, "pp": p.pp, "dp": p.dp, "tp": p.tp, "tp_group": list(p.tp_group),
                         "dp_group": list(p.dp_group), "pp_group": list(p.pp_group),
                         "embedding_group": list(p.embedding) if p.embedding else None} for p in rows]}
    if mesh.cp > 1:  # chapter 11's axis, between dp and tp
        report["shape"]["cp"], report["order"] = mesh.cp, "pp-dp-cp-tp (tp fastest)"
        for row, p in zip(report["ranks"], rows):
            row.update(cp=p.cp, cp_group=list(p.cp_group))
    return report
