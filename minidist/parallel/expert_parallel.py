"""Expert parallelism (专家并行): the MoE GPT's experts spread over ep ranks, the tokens sent to them.

Chapter 11, part 3 (the serial MoE GPT is `minidist/core/moe.py`). The world's W ranks are
data-parallel: each holds a slice of B/W rows of the batch and a copy of everything that is not
an expert (embeddings, attention, LayerNorms, routers). Groups of ep consecutive ranks share the
E experts between them, E/ep each, as DeepSpeed lays them out:

    W = 4, ep = 2:   expert-parallel groups (ep)        [0, 1]  [2, 3]    experts 0-1 | 2-3
                     expert-data-parallel groups        [0, 2]  [1, 3]    the same experts

A MoE layer on each rank: route its tokens; all-gather how many chose each expert (k x E numbers
per rank); from those counts every rank computes the same queue places the serial layer would
give the whole batch (`moe.queue_starts`), so which choices are dropped is decided exactly as
serially, by the rank that owns the token, before anything is sent. Then the hand-written
all-to-all sends each expert its tokens (an E x S x C buffer: S rows per expert, the most any
rank of the group sends one expert; the counts tell every rank S), each rank runs its experts on
the rows from every source, in the serial queue order, and a second all-to-all brings the
outputs home, where the gates combine them. An all-to-all is its own transpose, so its backward
is the same all-to-all of the gradients (`AllToAll`).

Gradients. Rank r's loss L_r is its slice's mean cross-entropy plus its aux loss (P from its
tokens, f from the whole batch's counts); the serial loss is (1/W) sum_r L_r.
* A replicated parameter on rank r gets dL_r/dθ only (its tokens come back to it): average over
  all W ranks, as data parallelism does.
* An expert on its rank gets sum_{s in its ep group} dL_s/dW_e: the backward all-to-all has
  already added up every source of the group. The ranks holding the same expert in the other
  ep groups (its expert-data-parallel group, W/ep ranks) hold the other sources' terms: sum over
  that group and divide by W. With ep = W the group is the rank alone: no message at all, the
  dispatch did the averaging's sum; only the 1/W is left.

Traffic per rank and step, per MoE layer: the counts' all-gather, (W-1) k E integers; four
all-to-alls (dispatch and combine, forward and backward) of (ep-1)/ep x E x S x C elements each
(`expert_parallel_traffic`). Every layout reproduces `training.train.MoETrainer` in float64, dropped tokens
included (tests/test_parallel_expert.py).
"""
from __future__ import annotations

import math
import re

import numpy as np

from minidist.core import functional as F
from minidist.plan import memory
from minidist.comm import all_gather, all_reduce, all_to_all, any_rank
from minidist.comm.world import World, resolve
from minidist.core.data import accuracy
from minidist.precision.mixed_precision import Precision
from minidist.core.moe import MoEConfig, MoEGPT, MoELayer, Routing, is_moe_param, moe_report
from minidist.plan.memory import moe_param_count
from minidist.parallel.mesh import DeviceMesh
from minidist.core.tensor import Function, Tensor, get_default_dtype, graph_bytes
from minidist.training.train import (OptimSettings, Trainer, load_training_state, make_optimizer,
                            training_state)


def check_expert_parallel(config, world_size: int, ep: int, batch_size: int | None = None) -> None:
    """Raise ValueError naming the numbers if the layout cannot be built. Pure arithmetic: every
    rank reaches the same verdict before any message."""
    if not isinstance(config, MoEConfig):
        raise ValueError(f"expert parallelism needs a MoE model (MoEConfig, --experts E), got {type(config).__name__}")
    if not isinstance(ep, (int, np.integer)) or ep < 1:
        raise ValueError(f"expert parallel: ep must be an integer >= 1, got {ep!r}")
    if world_size % ep:
        raise ValueError(f"expert parallel: ep={ep} does not divide the {world_size} data-parallel ranks")
    if config.num_experts % ep:
        raise ValueError(f"expert parallel: num_experts={config.num_experts} is not divisible by ep={ep} "
                         "(each rank holds num_experts/ep experts)")
    if batch_size is not None and batch_size % world_size:
        raise ValueError(f"expert parallel: global batch {batch_size} does not split over {world_size} ranks "
                         f"({batch_size} % {world_size} = {batch_size % world_size})")


def expert_parallel_traffic(config: MoEConfig, world_size: int, ep: int, slots: list[int], itemsize: int) -> dict:
    """Bytes one rank sends in one step's MoE layers: the all-to-alls (given S of each pass of a
    token batch through a layer it holds: one per layer, or per layer and micro-batch) and the
    counts' all-gathers (int64), one per pass."""
    C, E = config.n_embd, config.num_experts
    return {"all_to_all": sum(4 * (ep - 1) * (E // ep) * s * C * itemsize for s in slots),
            "counts": len(slots) * (world_size - 1) * config.top_k * E * 8}


def average_expert_gradients(replicated: list, experts: list, dp_group: World, expert_dp_group: World) -> None:
    """Replicated gradients: the average over the W ranks of `dp_group`. Expert gradients: the
    sum over the expert-data-parallel group (nothing to send when ep = W), divided by W (module
    docstring). One flat all-reduce per group."""
    for params, group, op in ((replicated, dp_group, "avg"), (experts, expert_dp_group, "sum")):
        if not params:
            continue
        flat = np.concatenate([(p.grad if p.grad is not None else np.zeros_like(p.data)).ravel() for p in params])
        if group.size > 1:
            all_reduce(flat, op=op, group=group)
        if params is experts:
            flat /= dp_group.size
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.size].reshape(p.shape)
            offset += p.size


class AllToAll(Function):
    """all_to_all as a differentiable operation: chunk j of rank r lands at place r on rank j,
    a transpose of the (rank, chunk) grid, so the gradient goes back by the same all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(np.ascontiguousarray(x).reshape(-1), group=group).reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        return all_to_all(np.ascontiguousarray(g).reshape(-1), group=ctx.group).reshape(g.shape), None


class ExpertParallelMoELayer(MoELayer):
    """The MoE layer with this rank's E/ep experts; the counts and the tokens travel."""

    def __init__(self, config: MoEConfig, seed: int, dp_group: World, ep_group: World):
        local = config.num_experts // ep_group.size
        super().__init__(config, seed, expert_ids=range(ep_group.rank * local, (ep_group.rank + 1) * local))
        self.dp_group, self.ep_group = dp_group, ep_group
        self.slots_per_expert = None  # S of the last forward

    def gather_counts(self, counts: np.ndarray) -> tuple[np.ndarray, int]:
        """Every rank's (k, E) counts, in rank order = batch order: (W, k, E), and my index."""
        w = self.dp_group.size
        mine = np.ascontiguousarray(counts, dtype=np.int64).reshape(-1)
        every = all_gather(mine, group=self.dp_group, out=np.empty(w * mine.size, dtype=np.int64))
        return every.reshape(w, *counts.shape), self.dp_group.rank

    def run_experts(self, tokens, routing: Routing):
        n, c = tokens.shape
        P, E = self.ep_group.size, self.config.num_experts
        local = E // P
        first = self.dp_group.rank - self.ep_group.rank  # the slice of my group's first rank
        sent = routing.kept_counts().sum(axis=1)          # (W, E): rows each slice sends each expert
        S = self.slots_per_expert = max(1, int(sent[first:first + P].max()))
        zero = Tensor(np.zeros((1, c), dtype=tokens.dtype))

        # dispatch: my queue for expert e fills the first rows of send[e]; the rest point at zero
        send, rows = np.full((E, S), n), np.full(routing.experts.shape, E * S)
        for e in range(E):
            token, choice = routing.queue(e)
            send[e, :len(token)] = token
            rows[token, choice] = e * S + np.arange(len(token))
        received = AllToAll.apply(F.getitem(F.concat([tokens, zero]), send), self.ep_group)
        received = received.reshape(P * local * S, c)     # (source, local expert, row) flattened

        # each expert on its rows from every source of the group, in the serial queue's order
        pieces, back, offset = [], np.full(P * local * S, -1), 0
        for i, (e, expert) in enumerate(self.experts.items()):
            at = self.arrivals(routing, e, i, first, S)
            pieces.append(expert(F.getitem(received, at)))
            back[at] = offset + np.arange(len(at))
            offset += len(at)
        back[back < 0] = offset
        outputs = F.concat(pieces + [zero])

        # combine: every output row goes back to where its token came from, in the same place
        returned = AllToAll.apply(F.getitem(outputs, back), self.ep_group)   # (E * S, C) here
        return F.concat([returned, zero]), rows

    def arrivals(self, routing: Routing, e: int, i: int, first: int, S: int) -> np.ndarray:
        """Where the rows for expert e (my i-th) sit in the received buffer, sorted by queue
        place. Source s sent its kept first choices, then its kept second choices, and the
        counts say where each of those stands in the serial queue."""
        kept, local = routing.kept_counts(), len(self.experts.ids)
        places, where = [], []
        for q in range(self.ep_group.size):
            s, count = first + q, 0
            for j in range(kept.shape[1]):
                places.append(routing.starts[s, j, e] + np.arange(kept[s, j, e]))
                count += kept[s, j, e]
            where.append((q * local + i) * S + np.arange(count))
        return np.concatenate(where)[np.argsort(np.concatenate(places), kind="stable")]


class ExpertParallelGPT(MoEGPT):
    """This rank's part of the MoE GPT: everything but the experts, and E/ep experts per layer,
    under the serial model's names (initialised from them)."""

    def __init__(self, config: MoEConfig, seed: int, dp_group: World, ep_group: World):
        self.dp_group, self.ep_group = dp_group, ep_group  # the layers need them while being built
        super().__init__(config, seed)

    def moe_layer(self, config: MoEConfig, seed: int) -> MoELayer:
        return ExpertParallelMoELayer(config, seed, self.dp_group, self.ep_group)


class ExpertParallelTrainer(Trainer):
    """Data parallelism over the W ranks of `group`, with the experts split over ep of them.

    ep = 1: every rank holds every expert (plain data parallelism of the MoE GPT); ep = W: each
    expert lives on one rank and sees tokens from all."""

    name = "ep"

    def __init__(self, config: MoEConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, ep: int = 1, precision: str = "fp32"):
        world = resolve(group)
        check_expert_parallel(config, world.size, ep, batch_size)
        self.config, self.settings, self.task, self.batch_size, self.ep = config, settings, task, batch_size, ep
        facts = [config, world.size, ep, batch_size, get_default_dtype().str]
        # every later message's size follows from these facts and the counts: checked once here
        # every rank a dp replica; the mesh cuts the dp group into runs of ep (mesh.py)
        mesh = DeviceMesh(world, dp=world.size, ep=ep)
        self.dp_group = mesh.dp_group.verify("the expert-parallel layout", facts)
        self.ep_group = mesh["ep"].verify("the expert-parallel group", facts)
        self.expert_dp_group = mesh["expert_dp"].verify("the expert-data-parallel group", facts)
        self.name = f"dp{world.size}-ep{ep}"
        self.local_model = ExpertParallelGPT(config, seed, self.dp_group, self.ep_group)
        self.model = None  # no rank holds every expert to sample from (for ep > 1)
        self.amp = Precision(precision, settings)  # chapter 10: the format, the masters, the scaler
        self.precision, self.scaler = self.amp.name, self.amp.scaler
        self.optimizer = make_optimizer(self.local_model, settings, self.amp.cast(self.local_model))  # AdamW is elementwise: any split
        params = self.local_model.parameters()
        self.experts = [p for p in params if is_moe_param(p)]
        self.replicated = [p for p in params if not is_moe_param(p)]
        self.activation_bytes, self.history = 0, []
        self.itemsize = np.dtype(get_default_dtype()).itemsize  # of the tokens the all-to-alls carry

    def step(self, step: int):
        """One optimizer step on the global batch; returns (loss, accuracy), the same on every rank."""
        w = self.dp_group.size
        x, y = self.task.get_batch(step, self.batch_size, self.dp_group.rank, w)
        with self.amp.autocast():  # fp32: nothing changes
            logits, loss = self.local_model(x, y)
        if not self.activation_bytes:  # every step builds the same graph: measure it once
            self.activation_bytes = graph_bytes(loss)
        self.optimizer.zero_grad()
        self.amp.scale(loss).backward()
        self.synchronize_gradients()
        params = self.optimizer.params()
        self.amp.step(self.optimizer, step, agree=lambda found_inf: any_rank(found_inf, self.dp_group),
                      norm=lambda grads: self.grad_norm(params, grads))
        stats = self.local_model.moe_stats()
        totals = np.array([loss.item(), accuracy(np.asarray(logits.data, dtype=np.float32), y), stats["aux_loss"]])
        all_reduce(totals, op="avg", group=self.dp_group)  # the slices' means: the batch's
        stats["aux_loss"] = float(totals[2])
        stats["slots_per_expert"] = [block.mlp.slots_per_expert for block in self.local_model.h]
        self.history.append(stats)
        return float(totals[0]), float(totals[1])

    def synchronize_gradients(self) -> None:
        average_expert_gradients(self.replicated, self.experts, self.dp_group, self.expert_dp_group)

    def grad_norm(self, params: list, grads: list) -> float:
        """The whole model's gradient norm from `grads` (of `params`): the replicated parameters
        once, every expert once (each ep group holds all E of them: one number summed over it)."""
        def squares(expert: bool):
            return sum(float(np.dot(g.ravel(), g.ravel())) for p, g in zip(params, grads)
                       if g is not None and is_moe_param(p) == expert)

        experts = np.array([squares(True)])
        if self.ep_group.size > 1:
            all_reduce(experts, op="sum", group=self.ep_group)
        return math.sqrt(squares(False) + float(experts[0]))

    def report(self) -> dict:
        slots = [h["slots_per_expert"] for h in self.history]
        return {**moe_report(self.config, self.history), **self.amp.report(),
                "expert_parallel": {"dp": self.dp_group.size, "ep": self.ep, "slots_per_expert": slots,
                                    "bytes_sent_per_step": [expert_parallel_traffic(
                                        self.config, self.dp_group.size, self.ep, s, self.itemsize) for s in slots]}}

    def memory(self) -> dict:
        return memory.ledger(self.local_model, self.optimizer, self.activation_bytes)

    def num_parameters(self) -> int:
        return moe_param_count(self.config)

    def state_dict(self) -> dict | None:
        """The serial MoE GPT's state dict on rank 0 (None elsewhere). Collective: each expert
        parameter is all-gathered over the ep group; the rest every rank holds whole."""
        P = self.ep_group.size
        local = self.config.num_experts // P
        whole = {}
        for name, p in self.local_model.named_parameters():
            if not is_moe_param(p) or P == 1:
                whole[name] = p.data.copy()
                continue
            mine = np.ascontiguousarray(p.data).reshape(-1)
            every = all_gather(mine, group=self.ep_group, out=np.empty(P * mine.size, dtype=mine.dtype))
            head, e, tail = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.*)", name).groups()
            i = int(e) - self.ep_group.rank * local  # my i-th expert; rank q's i-th is q*local + i
            for q, value in enumerate(every.reshape(P, *p.shape)):
                whole[f"{head}.{q * local + i}.{tail}"] = value.copy()
        return whole if self.dp_group.rank == 0 else None

    def global_state(self) -> dict:
        """This rank's replicated parameters and its experts (whole, under their global numbers),
        their AdamW moments, its generators."""
        return training_state(self.local_model, self.optimizer, self.scaler)

    def load_global_state(self, read) -> None:
        load_training_state(self.local_model, self.optimizer, read, self.scaler)
