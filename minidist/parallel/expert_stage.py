"""Expert parallelism inside the mesh: MoE layers in pipeline stages and over tensor-parallel ranks.

Chapter 11, part 3 (the plain expert-parallel trainer is `expert_parallel.py`; the mesh is
chapter 9's `composed.py`). The data-parallel replicas of a pp x dp x tp mesh share out the
experts in runs of ep, as DeepSpeed-MoE and Megatron-Core place expert parallelism inside data
parallelism; each stage's blocks carry MoE layers instead of MLPs. Three things change, and
nothing else:

* Routing follows the micro-batch. A pipeline (or gradient accumulation) runs each micro-batch
  through a MoE layer on its own, so capacity, dropped tokens and f of the balance loss are the
  micro-batch's. The reference is `MoETrainer(microbatches=m)`; and so that micro-batch i of all
  the replicas together holds serial micro-batch i's rows, in order, each replica takes its
  1/dp of every serial micro-batch (`ExpertMeshTrainer.batch`), not 1/dp of the batch.
* The balance loss of a middle stage. Its layers are not where the loss is computed, so their
  aux loss cannot be added to it. `AuxiliaryLoss` (Megatron-Core's `MoEAuxLossAutoScaler`)
  attaches it to the layer's output instead: an identity forward whose backward also seeds the
  aux loss with the factor the loss itself was given (1/m, times fp16's loss scale).
* Tensor parallelism. The router is replicated over the tp group (it is small, and every tp
  rank holds the same tokens, so all route alike); each expert is the tensor-parallel MLP of
  chapter 6 (column, then row: one all-reduce forward, one backward), so the tp ranks of an
  ep group each hold 1/tp of its experts' weights (Megatron-Core's expert tensor parallelism
  equal to tp). Each tp rank dispatches the same tokens over its own ep group.

Gradients, at the end of the step: replicated parameters average over dp, experts add up over
their expert-data-parallel group and divide by dp (`average_expert_gradients`, as in the plain
trainer). The norm adds the experts' squares over the ep group as well. Every layout equals
`MoETrainer` with the same micro-batches in float64, dropped tokens included
(tests/test_parallel_expert_mesh.py).
"""
from __future__ import annotations

import contextlib

import numpy as np

from minidist.comm import all_gather, all_reduce, reduce_scatter
from minidist.comm.world import World
from minidist.core.model import GPTConfig, init_weights
from minidist.core.moe import MoEConfig, is_moe_param, merge_moe_stats, moe_report
from minidist.core.tensor import Function
from minidist.parallel.composed import MeshTrainer, MeshZero1Trainer
from minidist.parallel.expert_parallel import (ExpertParallelMoELayer, average_expert_gradients,
                                               check_expert_parallel, expert_parallel_traffic)
from minidist.parallel.pipeline_stage import PipelineStage, chunk_layers
from minidist.parallel.tensor_parallel import ParallelMLP, consolidate_state_dict, init_shards
from minidist.parallel.pipeline import merge_stage_states
from minidist.parallel.tensor_stage import TensorParallelStage
from minidist.parallel.zero_partition import make_units
from minidist.plan.memory import moe_param_count


class AuxiliaryLoss(Function):
    """y unchanged; in backward, y's gradient passes through and the aux loss gets `scale`, as
    if `scale * aux` had been added to the loss that backward started from."""

    autocast = "pass"

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.aux, ctx.scale = aux, scale
        return y.copy()

    @staticmethod
    def backward(ctx, g):
        return g, np.full_like(ctx.aux, ctx.scale), None


class MeshMoELayer(ExpertParallelMoELayer):
    """The expert-parallel MoE layer of a mesh stage: its experts split over `tp_group` (if
    above one rank), its balance loss attached to its output (module docstring)."""

    def __init__(self, config: MoEConfig, seed: int, dp_group: World, ep_group: World, tp_group: World):
        self.tp_group = tp_group  # the experts are built inside super().__init__
        super().__init__(config, seed, dp_group, ep_group)
        self.aux_scale = 1.0     # d(the loss backward starts from) / d(aux): set by the trainer each step
        self.step_stats: list[dict] = []  # one per micro-batch of the step

    def expert_mlp(self, config: GPTConfig, seed):
        if self.tp_group.size == 1:
            return super().expert_mlp(config, seed)
        return ParallelMLP(config, self.tp_group, seed=seed)

    def forward(self, x):
        y = super().forward(x)
        self.step_stats.append({**self.stats, "slots_per_expert": self.slots_per_expert})
        return AuxiliaryLoss.apply(y, self.aux_loss, self.aux_scale)


def install_moe_layers(stage, config: MoEConfig, rank: int, stages: int, seed: int, virtual_stages: int,
                       dp_group: World, ep_group: World, tp_group: World) -> list[MeshMoELayer]:
    """Give each block of `stage` a MoE layer in place of its MLP, seeded as `MoEGPT` seeds it."""
    indices = [i for start, end in chunk_layers(config.n_layer, stages, rank, virtual_stages) for i in range(start, end)]
    layers = []
    for i, block in zip(indices, stage.h):
        block.mlp = MeshMoELayer(config, seed + 2 * (i + 1) + 1, dp_group, ep_group, tp_group)
        layers.append(block.mlp)
    return layers


class ExpertMeshTrainer(MeshTrainer):
    """The MoE GPT on a pp x dp x tp mesh, its experts over ep of the dp replicas (module
    docstring). Micro-batches: the pipeline's, or accumulation with pp = 1."""

    def __init__(self, config: MoEConfig, settings, task, batch_size: int, seed: int = 0, group=None,
                 dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, microbatches: int = 1, schedule: str = "1f1b",
                 virtual_stages: int | None = None, precision: str = "fp32"):
        check_expert_parallel(config, dp, ep, batch_size)
        self.ep, self.history = ep, []
        super().__init__(config, settings, task, batch_size, seed, group=group, dp=dp, tp=tp, pp=pp,
                         microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
                         precision=precision, ep=ep)
        self.name = f"{self.name}-ep{ep}"
        self.ep_group, self.expert_dp_group = self.mesh["ep"], self.mesh["expert_dp"]
        params = self.stage.parameters()
        self.experts = [p for p in params if is_moe_param(p)]
        self.replicated = [p for p in params if not is_moe_param(p)]

    def build_stage(self, config: MoEConfig, seed: int, virtual_stages: int):
        mesh = self.mesh
        if mesh.tp == 1:
            stage = PipelineStage(config, self.rank, self.stages, seed, virtual_stages)
        else:
            stage = TensorParallelStage(config, self.tp_group, self.rank, self.stages, seed, virtual_stages)
        self.moe_layers = install_moe_layers(stage, config, self.rank, self.stages, seed, virtual_stages,
                                             mesh.dp_group, mesh["ep"], self.tp_group)
        if mesh.tp == 1:  # the MoE layers' weights: drawn by name from the seed, as MoEGPT draws them
            init_weights(stage, seed, n_layer=config.n_layer)
        else:
            init_shards(stage, seed)
        return self.cast(stage)

    def build_data_parallel(self, bucket_cap_bytes: int) -> None:
        """No buckets: replicated and expert gradients average over different groups, once a step."""

    def accumulating(self):
        return contextlib.nullcontext()

    def average_over_replicas(self) -> None:
        average_expert_gradients(self.replicated, self.experts, self.mesh.dp_group, self.expert_dp_group)

    def batch(self, step: int):
        """Replica r's 1/dp of every serial micro-batch, in order (module docstring)."""
        x, y = self.task.get_batch(step, self.batch_size)
        m, d, r = self.microbatches, self.mesh.dp, self.mesh.place.dp

        def mine(rows):
            return np.concatenate([np.split(micro, d)[r] for micro in np.split(rows, m)])
        return mine(x), mine(y)

    def step(self, step: int):
        scale = float(self.amp.scale(self.loss_share(1.0)))  # what the micro-batch's loss is multiplied by
        for layer in self.moe_layers:
            layer.aux_scale, layer.step_stats = scale, []
        loss, acc = super().step(step)  # the cross-entropy, averaged over the replicas
        self.history.append(self.gather_stats())
        return loss + self.history[-1]["aux_loss"], acc

    def gather_stats(self) -> dict:
        """The step's counts per layer and its balance loss, from every stage (and replica)."""
        cfg, m = self.config, self.microbatches
        counts = np.zeros((2, cfg.n_layer, cfg.num_experts))
        slots = np.zeros((cfg.n_layer, m))  # S of each layer and micro-batch (this rank's ep group)
        aux = np.zeros(1)
        for layer, i in zip(self.moe_layers, self.layer_indices()):
            merged = merge_moe_stats(layer.step_stats)
            counts[0, i], counts[1, i] = merged["tokens_per_expert"], merged["dropped_per_expert"]
            slots[i] = [s["slots_per_expert"] for s in layer.step_stats]
            aux[0] += merged["aux_loss"]
        mine = [int(s) for i in self.layer_indices() for s in slots[i]]
        for array in (counts, slots, aux):
            all_reduce(array, op="sum", group=self.group)  # the stages hold different layers
        all_reduce(aux, op="avg", group=self.mesh.dp_group)  # each replica's tokens' P: their mean
        return {"tokens_per_expert": counts[0].astype(int).tolist(), "dropped_per_expert": counts[1].astype(int).tolist(),
                "capacity": self.moe_layers[0].step_stats[-1]["capacity"], "aux_loss": float(aux[0]),
                "slots_per_expert": slots.astype(int).tolist(), "my_slots": mine}

    def layer_indices(self) -> list[int]:
        return [i for start, end in chunk_layers(self.config.n_layer, self.stages, self.rank, self.virtual_stages)
                for i in range(start, end)]

    def norm_of(self, params: list, grads: list) -> float:
        """The whole model's norm: replicated squares over tp (counted once) and pp; the experts'
        also over the ep group, whose ranks hold different experts."""
        squares = np.zeros(2)
        for p, g in zip(params, grads):
            if g is not None and self.counted_in_norm(p):
                squares[int(is_moe_param(p))] += float(np.dot(g.ravel(), g.ravel()))
        all_reduce(squares, op="sum", group=self.tp_group)
        all_reduce(squares, op="sum", group=self.group)
        experts = squares[1:].copy()
        if self.ep_group.size > 1:
            all_reduce(experts, op="sum", group=self.ep_group)
        return float(np.sqrt(squares[0] + experts[0]))

    def num_parameters(self) -> int:
        return moe_param_count(self.config)

    def report(self) -> dict:
        """The mesh's and the MoE's reports; `bytes_sent_per_step` is this rank's (its stage's layers)."""
        itemsize = self.dtype.itemsize  # the tokens travel in the model's format
        return {**super().report(), **moe_report(self.config, self.history),
                "expert_parallel": {"dp": self.mesh.dp, "ep": self.ep, "tp": self.mesh.tp, "pp": self.mesh.pp,
                                    "microbatches": self.microbatches,
                                    "slots_per_expert": [h["slots_per_expert"] for h in self.history],
                                    "bytes_sent_per_step": [expert_parallel_traffic(
                                        self.config, self.mesh.dp, self.ep, h["my_slots"], itemsize)
                                        for h in self.history]}}

    def state_dict(self) -> dict | None:
        """Collective. The serial MoE GPT's state dict on world rank 0: shards glued over tp, then
        the stages of the first ep replicas (which hold every expert once) gathered."""
        mine = consolidate_state_dict(self.stage) if self.mesh.tp > 1 else self.stage.state_dict()
        place = self.mesh.place
        keep = place.dp < self.ep and place.tp == 0
        parts = self.mesh.world.comm.gather(mine if keep else None, root=0)  # small and once: pickle
        if self.mesh.world.rank != 0:
            return None
        return merge_stage_states([part for part in parts if part is not None])


class ExpertMeshZero1Trainer(ExpertMeshTrainer, MeshZero1Trainer):
    """ZeRO-1 of the MoE mesh (Megatron-LM's distributed optimizer with experts): the replicated
    parameters' optimizer states cut over the dp group, each expert's over its
    expert-data-parallel group (the ranks that hold the same experts). The gradient norm needs
    nothing new: the dp group is the ep groups times the expert-dp groups, so summing every
    rank's chunk squares over dp counts each expert once, like each replicated weight."""

    def build_data_parallel(self, bucket_cap_bytes: int) -> None:
        mesh = self.mesh
        dp, expert_dp = mesh.dp_group, mesh["expert_dp"]
        replicated = make_units(self.stage, dp.size, dp.rank, select=lambda p: not is_moe_param(p))
        experts = make_units(self.stage, expert_dp.size, expert_dp.rank, select=is_moe_param, suffix=".experts")
        facts = [(u.name, u.padded, np.dtype(u.dtype).str) for u in replicated + experts]
        self.dp_group = dp.verify("the MoE mesh's ZeRO units", facts)
        expert_dp = expert_dp.verify("the MoE mesh's expert ZeRO units", facts)
        self.unit_groups = [self.dp_group] * len(replicated) + [expert_dp] * len(experts)
        super().build_data_parallel_units(replicated + experts)

    def average_over_replicas(self) -> None:
        """Replicated units: averaged over dp. Expert units: summed over their expert-dp group,
        divided by dp (the module docstring of expert_parallel.py). One reduce-scatter per unit."""
        for unit, chunk, group in zip(self.units, self.grad_chunks, self.unit_groups):
            expert = group is not self.dp_group
            reduce_scatter(unit.flatten([p.grad for p in unit.params]), op="sum" if expert else "avg", group=group,
                           out=chunk)
            if expert:
                chunk /= self.mesh.dp

    def all_gather_parameters(self) -> None:
        for flat, chunk, group in zip(self.param_buffers, self.optimizer.params, self.unit_groups):
            all_gather(chunk, group=group, out=flat)
