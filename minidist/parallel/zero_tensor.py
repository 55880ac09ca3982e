"""ZeRO inside a DP x TP mesh: each tensor-parallel shard sharded again over dp (chapter 9).

FSDP + TP, as torchtitan composes them (and DeepSpeed's ZeRO with Megatron's tensor
parallelism): the mesh (`mesh.py`) gives each rank a tp group and a dp group. The tp group
splits the model's matrices (chapter 6); within each dp group, the ranks that hold the *same*
tp shard cut that shard's states into chunks with ZeRO's stages (chapter 8). Nothing in
either strategy changes; only four things about "the whole model" change meaning:

    the module     this rank's tensor-parallel shard, not the GPT (`build_model`)
    the gradient   sequence parallelism leaves partial gradients of the replicated parameters;
                   they are summed over tp just before their unit is reduce-scattered over dp
    the norm       chunk squares summed over dp, then over tp — replicated parameters counted on
                   tp rank 0 only (`norm_groups`)
    the accuracy   the arg-max over the vocabulary split across tp

Stages 2 and 3, without a pipeline (ZeRO-1 over any mesh, pipeline or not, is `composed.py`'s
`MeshZero1Trainer`, on the same partition). Gradient accumulation (`accumulation=k`) is the
stages' own (zero.py): each micro-batch's gradients are reduce-scattered over dp and added into
the chunk.
"""
from __future__ import annotations

import numpy as np

from minidist.comm.world import World, resolve
from minidist.core.model import GPTConfig
from minidist.parallel.mesh import DeviceMesh, check_mesh
from minidist.parallel.sequence import allreduce_partial_grads
from minidist.parallel.tensor_parallel import (SequenceParallelGPT, TensorParallelGPT, check_tensor_parallel,
                                               consolidate_state_dict, vocab_parallel_accuracy)
from minidist.parallel.zero import Zero2Trainer, Zero3Trainer
from minidist.training.train import OptimSettings


class TensorParallelShards:
    """What a ZeRO stage needs to change to run over a tp shard (mixed in before the stage)."""

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, dp: int = 1, tp: int = 1, sequence_parallel: bool = False,
                 precision: str = "fp32", accumulation: int = 1):
        world = resolve(group)
        check_mesh(world.size, dp, tp, 1, config, batch_size, accumulation)
        check_tensor_parallel(config, tp, sequence_parallel)
        self.mesh, self.sequence_parallel = DeviceMesh(world, dp=dp, tp=tp), sequence_parallel
        super().__init__(config, settings, task, batch_size, seed, group=self.mesh.dp_group, precision=precision,
                         accumulation=accumulation)
        self.name = f"dp{dp}-tp{tp}" + ("-sp" if sequence_parallel else "") + f"-zero{self.stage}"
        self.model = None  # the module is a shard: nothing to sample from on one rank
        self.norm_weights = [u.flatten([np.full(shape, float(self.counted_in_norm(p)))
                                        for p, shape in zip(u.params, u.shapes)])[u.lo:u.hi] for u in self.units]

    def build_model(self, config: GPTConfig, seed: int):
        model = SequenceParallelGPT if self.sequence_parallel else TensorParallelGPT
        return model(config, self.mesh.tp_group, seed=seed)

    def everyone(self) -> World:
        return self.mesh.world  # dp chunks of tp shards: every rank holds a piece

    def complete_partial_gradients(self, params: list) -> None:
        allreduce_partial_grads(params, self.module.group)  # sequence parallelism's, over tp

    def counted_in_norm(self, p) -> bool:
        return getattr(p, "tensor_model_parallel", False) or self.mesh.place.tp == 0

    def norm_groups(self):
        return [self.group, self.module.group], self.norm_weights  # chunks over dp, shards over tp

    def accuracy(self, logits: np.ndarray, targets) -> float:
        logits = np.asarray(logits, dtype=np.float32)
        return vocab_parallel_accuracy(logits, targets, self.module.group, self.module.vocab_start_index())

    def state_dict(self) -> dict | None:
        """Collective. The serial model's state dict on world rank 0: this dp group's shards
        first (each stage's own way), then glued over tp."""
        shards = super().state_dict()
        whole = consolidate_state_dict(self.module, state=shards)
        return whole if self.mesh.world.rank == 0 else None

    @property
    def tp_rank(self) -> int:
        """Where this rank's shards sit in the serial arrays (checkpoints: `global_state`)."""
        return self.module.group.rank


class TensorParallelZero2Trainer(TensorParallelShards, Zero2Trainer):
    """ZeRO-2 over dp, of each tp shard's moments and gradients."""


class TensorParallelZero3Trainer(TensorParallelShards, Zero3Trainer):
    """ZeRO-3 (FSDP) over dp, of each tp shard's moments, gradients and weights."""


# ZeRO-1 over a mesh, with or without a pipeline, is composed.py's MeshZero1Trainer: one way for each stage
STAGES = {2: TensorParallelZero2Trainer, 3: TensorParallelZero3Trainer}
