"""Mixture of experts (混合专家, MoE): every block's MLP becomes E expert MLPs and a router.

Chapter 11, part 3. A router (a linear map C -> E, then softmax) gives each token a probability
per expert; the token goes to its top-k experts only, so the model has E times the MLP
parameters but each token pays for k MLPs. The pieces, as Switch Transformer (k = 1) and GShard
(k = 2) define them:

* Gates. k = 1: the token's output is p_top x expert(token) (Switch: the gate is the top
  probability itself, which is what lets the router learn). k = 2: the two top probabilities,
  renormalised to sum to one, g_j = p_j / (p_1 + p_2) (GShard, Mixtral), computed before any
  token is dropped: a dropped choice contributes zero and the other keeps its gate.
* Capacity. Each expert takes at most capacity = ceil(k x N / E x C) of the N tokens' choices
  (C: the capacity factor; N / E per expert is a perfect balance). Overflow is dropped, first
  come first served: all first choices queue before all second choices (GShard), and within a
  choice tokens queue in order of their position in the batch (row by row, then time). A
  dropped choice's MLP output is zero: the token passes through the block's residual.
* Balance. Switch's auxiliary loss alpha x E x sum_i f_i P_i per layer is added to the loss,
  f_i the fraction of tokens whose first choice is expert i (counted before dropping), P_i the
  mean router probability of expert i. Only P carries a gradient; it is smallest (alpha) when
  the router spreads tokens evenly.

The routing arithmetic (`top_k_experts`, `queue_starts`, `assign_slots`, `expert_capacity`) is
plain NumPy on counts, written for R consecutive slices of the batch so that expert parallelism
(`minidist/parallel/expert_parallel.py`) applies the very same rule to the whole batch while each
rank holds one slice; here R = 1. Routing decisions are piecewise constant: gradients flow
through the gates and the experts, never through the choice itself.

Parameters are named like the dense GPT's plus `h.<i>.mlp.router.weight` and
`h.<i>.mlp.experts.<e>.c_fc.weight` ..., and drawn by `init_weights` from (seed, name), so an
expert-parallel rank cuts the same numbers for the experts it holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist.core import functional as F
from minidist.core.model import GPT, MLP, GPTConfig, init_weights
from minidist.core.nn import Linear, Module
from minidist.core.tensor import Tensor


@dataclass
class MoEConfig(GPTConfig):
    num_experts: int = 4
    top_k: int = 1
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01  # alpha of the load-balancing loss (Switch Transformer's 0.01)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.num_experts, (int, np.integer)) or self.num_experts < 2:
            raise ValueError(f"MoEConfig: num_experts must be an integer >= 2, got {self.num_experts!r}")
        if self.top_k not in (1, 2) or self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig: top_k must be 1 or 2 (and <= num_experts={self.num_experts}), "
                             f"got {self.top_k!r}")
        if not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig: capacity_factor must be > 0, got {self.capacity_factor!r}")
        if not self.aux_loss_coef >= 0:
            raise ValueError(f"MoEConfig: aux_loss_coef must be >= 0, got {self.aux_loss_coef!r}")


# ----------------------------------------------------------------------------- the routing rule


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """ceil(k x tokens / E x C): how many choices one expert takes (rounded to 9 digits first, so
    that 1.1 x 40 / 4 is 11, not 12)."""
    return max(1, math.ceil(round(top_k * tokens * capacity_factor / num_experts, 9)))


def top_k_experts(probs: np.ndarray, k: int) -> np.ndarray:
    """(N, k) expert ids, most probable first; a tie goes to the lower id."""
    return np.argsort(-probs, axis=-1, kind="stable")[:, :k]


def choice_counts(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """(k, E): how many tokens chose each expert as their first, (second) choice."""
    return np.stack([np.bincount(experts[:, j], minlength=num_experts) for j in range(experts.shape[1])])


def queue_starts(counts: np.ndarray) -> np.ndarray:
    """counts (R, k, E) of R consecutive slices of the batch -> (R, k, E): the place in expert
    e's queue of slice r's first choice-j token. First choices queue before second choices;
    within a choice, slice after slice."""
    ### BEGIN SOLUTION assignment=moe_capacity
    per_choice = counts.sum(axis=0)                            # (k, E)
    choice_start = np.cumsum(per_choice, axis=0) - per_choice  # all first choices come first
    slice_start = np.cumsum(counts, axis=0) - counts           # earlier slices come first
    return choice_start[None] + slice_start
    ### END SOLUTION


def assign_slots(experts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """(N, k) places in the experts' queues of this slice's choices; `starts` (k, E) is this
    slice's row of `queue_starts`. Tokens queue in order of position."""
    ### BEGIN SOLUTION assignment=moe_capacity
    n, k = experts.shape
    slots = np.empty((n, k), dtype=np.int64)
    for j in range(k):
        same = experts[:, j, None] == np.arange(starts.shape[1])   # (N, E) one-hot
        ahead = np.cumsum(same, axis=0)[np.arange(n), experts[:, j]] - 1
        slots[:, j] = starts[j, experts[:, j]] + ahead
    return slots
    ### END SOLUTION


@dataclass
class Routing:
    """One layer's decisions for this slice of the batch, and the counts of every slice."""
    experts: np.ndarray   # (N, k) chosen expert ids
    slots: np.ndarray     # (N, k) place in the expert's queue
    kept: np.ndarray      # (N, k) slot < capacity
    capacity: int
    counts: np.ndarray    # (R, k, E) choices per slice (R = 1 serially)
    starts: np.ndarray    # (R, k, E) queue_starts(counts)
    source: int           # which slice is this one
    probs: np.ndarray = None  # (N, E) the router's probabilities the choices came from

    def kept_counts(self) -> np.ndarray:
        """(R, k, E): choices of each slice that fit under the capacity."""
        return np.clip(self.capacity - self.starts, 0, self.counts)

    def queue(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, choices) this slice sends to expert e, in queue order."""
        token, choice = np.nonzero((self.experts == e) & self.kept)
        order = np.argsort(self.slots[token, choice], kind="stable")
        return token[order], choice[order]


# ----------------------------------------------------------------------------- the layer


class Experts(Module):
    """Expert MLPs under their global numbers (`experts.0`, `experts.1`, ...); an expert-parallel
    rank holds some of them. Each is marked `allreduce = False` (DeepSpeed's mark): its gradient
    is not averaged with the replicated parameters'."""

    def __init__(self, config: GPTConfig, ids, seed: int = 0, make_mlp=MLP):
        self.ids = list(ids)
        for e in self.ids:
            mlp = make_mlp(config, seed=[seed, e])  # one dropout stream per expert
            for p in mlp.parameters():
                p.allreduce = False
            setattr(self, str(e), mlp)

    def items(self):
        return [(e, getattr(self, str(e))) for e in self.ids]


def is_moe_param(p) -> bool:
    return getattr(p, "allreduce", True) is False


class MoELayer(Module):
    """Router + experts in place of a block's MLP (DeepSpeed: `MoE`, Megatron-LM: `MoELayer`).

    forward(x) returns the combined expert outputs, shaped like x, and leaves the layer's
    load-balancing loss in `self.aux_loss` and its counts in `self.stats`. Two steps are methods
    so that expert parallelism can replace them: `gather_counts` (how many tokens chose each
    expert, in every slice of the batch) and `run_experts` (send tokens, compute, bring back)."""

    def __init__(self, config: MoEConfig, seed: int = 0, expert_ids=None):
        self.config = config
        self.router = Linear(config.n_embd, config.num_experts, bias=False)  # Switch: no bias
        self.experts = Experts(config, range(config.num_experts) if expert_ids is None else expert_ids, seed,
                               self.expert_mlp)
        self.aux_loss, self.stats, self.routing = None, None, None

    def forward(self, x):
        b, t, c = x.shape
        cfg, E = self.config, self.config.num_experts
        tokens = x.reshape(b * t, c)
        probs = F.softmax(self.router(tokens), axis=-1)                     # (N, E)
        routing = self.route(probs.data)
        gates = [F.getitem(probs, (np.arange(b * t), routing.experts[:, j])) for j in range(cfg.top_k)]
        if cfg.top_k == 2:  # GShard: renormalise the two gates (before dropping)
            total = gates[0] + gates[1]
            gates = [g / total for g in gates]
        outputs, rows = self.run_experts(tokens, routing)  # rows[n, j]: token n's j-th output row
        y = None
        for j, gate in enumerate(gates):
            part = F.getitem(outputs, rows[:, j]) * gate.reshape(b * t, 1)
            y = part if y is None else y + part
        # Switch's balance loss: f from the whole batch's first choices, P from these tokens
        first = routing.counts[:, 0, :].sum(axis=0)
        f = Tensor((first / first.sum()).astype(probs.dtype))
        self.aux_loss = (F.mean(probs, axis=0) * f).sum() * (cfg.aux_loss_coef * E)
        routed = routing.counts.sum(axis=(0, 1))
        dropped = routed - routing.kept_counts().sum(axis=(0, 1))
        self.stats = {"tokens_per_expert": routed.tolist(), "dropped_per_expert": dropped.tolist(),
                      "capacity": routing.capacity, "aux_loss": self.aux_loss.item()}
        self.routing = routing
        return y.reshape(b, t, c)

    def expert_mlp(self, config: GPTConfig, seed) -> Module:
        """One expert: the dense block's MLP (a tensor-parallel mesh splits it over its tp ranks)."""
        return MLP(config, seed=seed)

    def route(self, probs: np.ndarray) -> Routing:
        """Top-k choices, their places in the queues of the whole batch, and which fit."""
        cfg = self.config
        experts = top_k_experts(probs, cfg.top_k)
        counts, source = self.gather_counts(choice_counts(experts, cfg.num_experts))
        capacity = expert_capacity(int(counts[:, 0, :].sum()), cfg.num_experts, cfg.top_k, cfg.capacity_factor)
        starts = queue_starts(counts)
        slots = assign_slots(experts, starts[source])
        return Routing(experts, slots, slots < capacity, capacity, counts, starts, source, probs)

    def gather_counts(self, counts: np.ndarray) -> tuple[np.ndarray, int]:
        """(every slice's counts (R, k, E), this slice's index): serially, one slice."""
        return counts[None], 0

    def run_experts(self, tokens, routing: Routing):
        """Each expert on its queue; returns (the outputs stacked, with a zero row last, and the
        (N, k) row of each choice's output, the zero row for a dropped one)."""
        n, c = tokens.shape
        pieces, rows, offset = [], np.full(routing.experts.shape, -1), 0
        for e, expert in self.experts.items():
            token, choice = routing.queue(e)
            pieces.append(expert(F.getitem(tokens, token)))  # an idle expert runs on 0 rows
            rows[token, choice] = offset + np.arange(len(token))
            offset += len(token)
        rows[rows < 0] = offset
        return F.concat(pieces + [Tensor(np.zeros((1, c), dtype=tokens.dtype))]), rows


# ----------------------------------------------------------------------------- the model


class MoEGPT(GPT):
    """The GPT with a MoELayer in every block; its loss is cross-entropy + every layer's aux loss."""

    def __init__(self, config: MoEConfig, seed: int = 0):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoEGPT needs a MoEConfig, got {type(config).__name__}")
        super().__init__(config, seed)
        for i, block in enumerate(self.h):  # the dense MLPs give way to MoE layers (same seeds)
            block.mlp = self.moe_layer(config, seed + 2 * (i + 1) + 1)
        init_weights(self, seed)  # by name: the attention and embeddings draw what they drew

    def moe_layer(self, config: MoEConfig, seed: int) -> MoELayer:
        return MoELayer(config, seed=seed)

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        if loss is not None:
            for block in self.h:
                loss = loss + block.mlp.aux_loss
        return logits, loss

    def moe_stats(self) -> dict:
        """The last forward's counts, one row per layer, and the summed aux loss."""
        layers = [block.mlp.stats for block in self.h]
        return {"tokens_per_expert": [s["tokens_per_expert"] for s in layers],
                "dropped_per_expert": [s["dropped_per_expert"] for s in layers],
                "capacity": layers[0]["capacity"], "aux_loss": sum(s["aux_loss"] for s in layers)}


def merge_moe_stats(stats: list[dict]) -> dict:
    """One step's stats from its micro-batches': counts added up, the balance loss averaged (the
    step's loss is the micro-batches' mean), the capacity of one micro-batch."""
    return {"tokens_per_expert": np.sum([s["tokens_per_expert"] for s in stats], axis=0).tolist(),
            "dropped_per_expert": np.sum([s["dropped_per_expert"] for s in stats], axis=0).tolist(),
            "capacity": stats[-1]["capacity"], "aux_loss": sum(s["aux_loss"] for s in stats) / len(stats)}


def moe_report(config: MoEConfig, history: list[dict]) -> dict:
    """The demo's `moe` key, one entry per step (one row per layer inside): tokens_per_expert,
    the choices routed to each expert (k per token, before dropping); dropped_per_expert, those
    over its capacity; dropped_tokens, their total; aux_loss, the layers' summed balance loss."""
    return {"moe": {"num_experts": config.num_experts, "top_k": config.top_k,
                    "capacity_factor": config.capacity_factor, "aux_loss_coef": config.aux_loss_coef,
                    "capacity": history[-1]["capacity"] if history else None,
                    "tokens_per_expert": [h["tokens_per_expert"] for h in history],
                    "dropped_per_expert": [h["dropped_per_expert"] for h in history],
                    "dropped_tokens": [int(np.sum(h["dropped_per_expert"])) for h in history],
                    "aux_loss": [h["aux_loss"] for h in history]}}
