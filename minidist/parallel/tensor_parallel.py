"""Tensor parallelism (张量并行), the model: the GPT with every big matrix split over t ranks.

Chapter 6, part 2 (the layers and the f/g functions are in `tensor_layers.py`). The one idea:
with Megatron-LM's column-then-row pairing, a transformer block needs exactly two all-reduces
forward (after attention and after the MLP: g) and two backward (where the block's two
LayerNorm outputs enter the split layers: f), each of B·T·C elements. Everything else —
LayerNorms, position embeddings, the residual stream, row-parallel biases — is replicated,
computed identically on every rank.

    attention   q_proj, k_proj, v_proj   ColumnParallelLinear (n_head/t heads per rank)
                c_proj                   RowParallelLinear  -> g
    MLP         c_fc                     ColumnParallelLinear (4C/t features per rank)
                c_proj                   RowParallelLinear  -> g
    wte         VocabParallelEmbedding   (V/t rows per rank) -> g
    head        logits for this rank's V/t vocabulary entries (f on the input), then
                vocab-parallel cross-entropy: the full logits are never gathered

The modules keep the serial GPT's names (`h.0.attn.q_proj.weight`, ...), so a rank's state
dict has the serial keys with shards as values, and `consolidate_state_dict` glues the shards
back into exactly the serial model's state dict. Shards are cut from the same deterministic
initialisation (seeded by parameter name), so tp = 1, 2, 4 start from the same weights and
train to the same weights as `SerialTrainer` (tests/test_parallel_tensor.py, float64, 1e-9).

`sequence_parallel=True` (part 3, `sequence.py`) runs the LayerNorms, residual adds and dropouts
on this rank's T/t tokens: every g becomes a reduce-scatter, every f an all-gather, and the
replicated parameters' gradients are summed over the group after backward.
"""
from __future__ import annotations

import math

import numpy as np

from minidist import functional as F
from minidist import memory
from minidist.comm import all_gather
from minidist.comm.world import World, resolve
from minidist.model import GPTConfig, init_weights
from minidist.nn import Dropout, Embedding, LayerNorm, Module, ModuleList, Parameter
from minidist.optim import clip_grad_norm_, set_lr
from minidist.parallel.sequence import (SequenceParallelDropout, allreduce_sequence_parallel_grads,
                                        check_sequence_length, gather_from_sequence_parallel_region,
                                        mark_sequence_parallel)
from minidist.parallel.tensor_layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             all_reduce_unchecked,
                                             copy_to_tensor_parallel_region, vocab_parallel_argmax,
                                             vocab_parallel_cross_entropy)
from minidist.tensor import Tensor, graph_bytes
from minidist.train import OptimSettings, make_optimizer


def check_tensor_parallel(config: GPTConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Raise ValueError naming the sizes if `config` cannot be split over tp ranks (with
    sequence parallelism, its block_size too). Pure arithmetic: call it on every rank before any
    message is sent."""
    if tp < 1:
        raise ValueError(f"tensor parallel: tp must be >= 1, got {tp}")
    bad = [f"{name}={value}" for name, value in (("n_head", config.n_head), ("4*n_embd", 4 * config.n_embd),
                                                  ("vocab_size", config.vocab_size)) if value % tp]
    if bad:
        raise ValueError(f"tensor parallel: {', '.join(bad)} not divisible by tp={tp} "
                         "(each rank must hold an equal share of the heads, MLP features and vocabulary)")
    if sequence_parallel:
        check_sequence_length(config.block_size, tp)


def _dropout(p: float, group: World, seed: int, sequence_parallel: bool):
    """Dropout on the replicated (B, T, C) activation, or on this rank's T/t tokens of it."""
    return SequenceParallelDropout(p, group, seed=seed) if sequence_parallel else Dropout(p, seed=seed)


# ----------------------------------------------------------------------------- the model


class ParallelAttention(Module):
    """Causal self-attention with this rank's n_head/t heads; one f, one g (with sequence
    parallelism: one all-gather of the tokens, one reduce-scatter)."""

    def __init__(self, config: GPTConfig, group: World, seed: int = 0, sequence_parallel: bool = False):
        c, t = config.n_embd, group.size
        self.group, self.sequence_parallel = group, sequence_parallel
        self.n_head_local = config.n_head // t
        self.q_proj, self.k_proj, self.v_proj = (ColumnParallelLinear(c, c, group, copy_input=False) for _ in range(3))
        self.c_proj = RowParallelLinear(c, c, group, sequence_parallel=sequence_parallel)
        self.dropout_p = config.dropout
        self.attn_rng = np.random.default_rng([seed, 1, group.rank])  # other heads, other masks
        self.resid_dropout = _dropout(config.dropout, group, seed, sequence_parallel)  # the serial mask

    def forward(self, x):
        if self.sequence_parallel:  # attention mixes tokens: it needs all of them (g-bar)
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)  # f, once for q, k and v
        b, t, _ = x.shape

        def heads(y):  # (B, T, C/t) -> (B, H/t, T, D): rank r's columns are heads r·H/t ...
            return y.reshape(b, t, self.n_head_local, -1).permute(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        p = self.dropout_p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, causal=True, dropout_p=p, rng=self.attn_rng)
        y = y.permute(0, 2, 1, 3).reshape(b, t, -1)  # this rank's heads side by side: C/t features
        return self.resid_dropout(self.c_proj(y))  # row-parallel: g inside


class ParallelMLP(Module):
    def __init__(self, config: GPTConfig, group: World, seed: int = 0, sequence_parallel: bool = False):
        c, sp = config.n_embd, sequence_parallel
        self.c_fc = ColumnParallelLinear(c, 4 * c, group, sequence_parallel=sp)  # f (or all-gather) inside
        self.c_proj = RowParallelLinear(4 * c, c, group, sequence_parallel=sp)  # g (or reduce-scatter) inside
        self.dropout = _dropout(config.dropout, group, seed, sp)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # GELU works on the slice


class ParallelBlock(Module):
    """With sequence parallelism x is (B, T/t, C): the LayerNorms and the adds see T/t tokens."""

    def __init__(self, config: GPTConfig, group: World, seed: int = 0, sequence_parallel: bool = False):
        self.ln_1 = LayerNorm(config.n_embd)
        self.attn = ParallelAttention(config, group, seed=seed, sequence_parallel=sequence_parallel)
        self.ln_2 = LayerNorm(config.n_embd)
        self.mlp = ParallelMLP(config, group, seed=seed + 1, sequence_parallel=sequence_parallel)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TensorParallelGPT(Module):
    """This rank's shard of the GPT; same parameter names as `minidist.model.GPT`.

    sequence_parallel=True: between the split layers, activations are this rank's T/t tokens."""

    def __init__(self, config: GPTConfig, group: World | None = None, seed: int = 0, sequence_parallel: bool = False):
        self.group = group = resolve(group)
        sp = self.sequence_parallel = sequence_parallel
        check_tensor_parallel(config, group.size, sp)
        self.config = config
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, group, sequence_parallel=sp)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = _dropout(config.dropout, group, seed, sp)
        self.h = ModuleList(ParallelBlock(config, group, seed=seed + 2 * (i + 1), sequence_parallel=sp)
                            for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd)
        if not config.tie_weights:  # the head's weight is split like the vocabulary: (V/t, C)
            self.lm_head = ColumnParallelLinear(config.n_embd, config.vocab_size, group, bias=False,
                                                sequence_parallel=sp)
        init_shards(self, seed)
        if sp:  # replicated, but each rank's gradient comes from its T/t tokens only: summed later
            mark_sequence_parallel(self.wpe, self.ln_f, *(m for b in self.h for m in (b.ln_1, b.ln_2)))
            for block in self.h:
                block.attn.c_proj.bias.sequence_parallel = block.mlp.c_proj.bias.sequence_parallel = True

    def forward(self, idx, targets=None):
        """This rank's logits (batch, time, V/t) and, given targets, the global mean loss."""
        idx = np.asarray(idx.data if isinstance(idx, Tensor) else idx)
        if idx.ndim != 2 or idx.shape[1] > self.config.block_size:
            raise ValueError(f"GPT expects ids of shape (batch, time <= {self.config.block_size}), got {idx.shape}")
        positions = np.arange(idx.shape[1])
        if self.sequence_parallel:  # wte reduce-scatters: add the positions of my T/t tokens
            check_sequence_length(idx.shape[1], self.group.size)
            positions = np.split(positions, self.group.size)[self.group.rank]
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if self.config.tie_weights and self.sequence_parallel:  # the head needs every token: g-bar
            logits = F.linear(gather_from_sequence_parallel_region(x, self.group), self.wte.weight)
        elif self.config.tie_weights:  # logits = x wte^T: a column-parallel linear with wte's rows
            logits = F.linear(copy_to_tensor_parallel_region(x, self.group), self.wte.weight)
        else:
            logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits, targets, self.group, self.wte.vocab_start_index,
                                                self.config.vocab_size)
        return logits, loss


# ----------------------------------------------------------------------------- shards of the serial model


def _local_slice(p: Parameter, group: World) -> tuple:
    """The index of this rank's shard inside the full parameter."""
    if not getattr(p, "tensor_model_parallel", False):
        return (slice(None),) * p.ndim
    index = [slice(None)] * p.ndim
    n = p.shape[p.partition_dim]
    index[p.partition_dim] = slice(group.rank * n, (group.rank + 1) * n)
    return tuple(index)


class _FullParameter(Module):
    """One parameter at its full (serial) shape, under its serial name: what init_weights draws."""

    def __init__(self, name: str, shape, dtype):
        self.name, self.p = name, Parameter(np.zeros(shape), dtype)

    def named_parameters(self, prefix=""):
        yield self.name, self.p


def init_shards(model: TensorParallelGPT, seed: int) -> None:
    """Draw each parameter at its full shape exactly as the serial GPT does, keep this rank's
    slice (Megatron-LM does the same on CPU: the master weight, then split). Transient memory:
    one full parameter at a time, never the whole model."""
    for name, p in model.named_parameters():
        full = _FullParameter(name, getattr(p, "full_shape", p.shape), p.dtype)
        init_weights(full, seed, n_layer=model.config.n_layer)
        p.data[...] = full.p.data[_local_slice(p, model.group)]


def consolidate_state_dict(model: TensorParallelGPT, dst: int = 0) -> dict | None:
    """The serial model's state dict (same keys, full shapes) on rank `dst`, None elsewhere.
    Collective: every rank of the group must call it. Split parameters are all-gathered and
    glued along their partition axis; replicated ones are taken as they are."""
    group, state = model.group, {}
    for name, p in model.named_parameters():
        value = p.data.copy()
        if getattr(p, "tensor_model_parallel", False) and group.size > 1:
            flat = all_gather(np.ascontiguousarray(p.data), group=group)  # every shard, in rank order
            value = np.concatenate([s.reshape(p.shape) for s in np.split(flat, group.size)], axis=p.partition_dim)
        state[name] = value
    return state if group.rank == dst else None


# ----------------------------------------------------------------------------- clipping


def split_and_replicated(model: Module) -> tuple[list, list]:
    params = model.parameters()
    split = [p for p in params if getattr(p, "tensor_model_parallel", False)]
    return split, [p for p in params if not getattr(p, "tensor_model_parallel", False)]


def clip_grad_norm_tensor_parallel_(model: Module, max_norm: float, group: World) -> float:
    """Clip by the norm of the *whole* model's gradient, as serial clipping does.

    norm² = Σ_ranks (squared norms of my shards) + (squared norm of the replicated gradients,
    counted once: every rank holds the same copy). One all-reduce of one number."""
    split, replicated = split_and_replicated(model)

    def squares(params):
        return sum(float(np.dot(p.grad.ravel(), p.grad.ravel())) for p in params if p.grad is not None)

    total = np.array([squares(split)])
    all_reduce_unchecked(total, group)
    norm = math.sqrt(float(total[0]) + squares(replicated))
    return clip_grad_norm_(split + replicated, max_norm, total_norm=norm)


# ----------------------------------------------------------------------------- the formulas


def parameter_counts(config: GPTConfig, tp: int) -> dict:
    """How many parameters are split over the tp ranks and how many every rank replicates.

    Split, per block: q, k, v, c_proj weights (4C²) and q, k, v biases (3C); c_fc (4C² + 4C)
    and the MLP's c_proj weight (4C²): 12C² + 7C. Plus wte (VC) and an untied head (VC).
    Replicated, per block: two LayerNorms (4C) and the two row-parallel biases (2C): 6C.
    Plus wpe (T·C) and ln_f (2C). A rank holds split / tp + replicated."""
    V, T, L, C = config.vocab_size, config.block_size, config.n_layer, config.n_embd
    split = L * (12 * C * C + 7 * C) + V * C * (1 if config.tie_weights else 2)
    replicated = L * 6 * C + T * C + 2 * C
    return {"split": split, "replicated": replicated, "per_rank": split // tp + replicated}


def traffic_per_step(config: GPTConfig, batch: int, tp: int, itemsize: int = 4, seq: int | None = None,
                     sequence_parallel: bool = False, one_machine: bool = True) -> dict:
    """All-reduces of one training step and the bytes each rank sends for them (predicted).

    Activations of B·T·C elements: 2 per block forward (g after attention and MLP), 2 per block
    backward (f before them), the embedding's g and the head's f: 4L + 2. Small ones of B·T
    elements: the loss's max and its two sums (one message), the accuracy's argmax (max, then
    min of int64 ids); and one number for the gradient norm. Bytes per call are those of the
    algorithm all_reduce picks for that size (`minidist.comm.cost.terms`): with every rank on one
    machine (one_machine=True, as under mpirun here) shared memory, which sends (t-1) x the array
    up to 64 KB and 2(t-1)/t of it above, like the ring; across machines the alpha-beta choice.

    sequence_parallel=True: each B·T·C all-reduce becomes one reduce-scatter and one all-gather
    (ring: (t-1)/t of the array each, together a ring all-reduce's bytes), and one all-reduce of
    the replicated parameters' partial gradients is added."""
    from minidist.comm.collectives import auto_algorithm
    from minidist.comm.cost import terms

    seq = config.block_size if seq is None else seq
    n = batch * seq
    activations = (n * config.n_embd * itemsize, 4 * config.n_layer + 2, "activations (B·T·C)")
    calls = [(n * itemsize, 1, "loss: row max"), (2 * n * itemsize, 1, "loss: sum of exp and target logit"),
             (n * itemsize, 1, "accuracy: max"), (n * 8, 1, "accuracy: argmax id (int64)"),
             (8, 1, "gradient norm")]
    if sequence_parallel:
        grads = parameter_counts(config, tp)["replicated"] * itemsize
        calls.append((grads, 1, "sequence-parallel gradients (LayerNorms, row biases, wpe)"))
    else:
        calls.insert(0, activations)
    halves = activations[1] if sequence_parallel else 0  # reduce-scatters, and as many all-gathers
    if tp == 1:
        return {"all_reduces": 0, "reduce_scatters": 0, "all_gathers": 0, "bytes_sent": 0, "calls": calls}
    def chosen(nbytes):
        return "shared_memory" if one_machine else auto_algorithm(nbytes, tp)

    sent = sum(count * terms("all_reduce", chosen(nbytes), tp, nbytes)[1] for nbytes, count, _ in calls)
    sent += halves * sum(terms(kind, "ring", tp, activations[0])[1] for kind in ("reduce_scatter", "all_gather"))
    return {"all_reduces": sum(c for _, c, _ in calls), "reduce_scatters": halves, "all_gathers": halves,
            "bytes_sent": int(round(sent)), "calls": calls}


# ----------------------------------------------------------------------------- the trainer


class TensorParallelTrainer:
    """The serial training step with every rank of `group` holding 1/t of the big matrices.

    All ranks see the same batch (tensor parallelism splits the model, not the data).
    sequence_parallel=True: also split the LayerNorm/dropout/residual activations by tokens."""

    name = "tp"

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, sequence_parallel: bool = False):
        self.world = resolve(group)
        check_tensor_parallel(config, self.world.size, sequence_parallel)
        self.sequence_parallel = sequence_parallel
        self.name = "tp-sp" if sequence_parallel else "tp"
        self.config, self.settings, self.task, self.batch_size = config, settings, task, batch_size
        self.local_model = TensorParallelGPT(config, self.world, seed=seed,  # this rank's shard
                                             sequence_parallel=sequence_parallel)
        self.model = None  # no full model to sample from on one rank (see the chapter)
        self.optimizer = make_optimizer(self.local_model, settings)  # AdamW is elementwise: shards fine
        self.activation_bytes = 0
        self.last_grad_norm = float("nan")

    def step(self, step: int):
        """One optimizer step on the global batch; returns (loss, accuracy), same on every rank."""
        x, y = self.task.get_batch(step, self.batch_size)
        logits, loss = self.local_model(x, y)
        if not self.activation_bytes:  # every step builds the same graph: measure it once
            self.activation_bytes = graph_bytes(loss)
        self.local_model.zero_grad()
        loss.backward()
        if self.sequence_parallel:  # before clipping: the norm needs the whole gradients
            allreduce_sequence_parallel_grads(self.local_model, self.world)
        s = self.settings
        if s.clip:
            self.last_grad_norm = clip_grad_norm_tensor_parallel_(self.local_model, s.clip, self.world)
        set_lr(self.optimizer, s.lr_at(step))
        self.optimizer.step()
        return loss.item(), self.accuracy(logits.data, y)

    def accuracy(self, logits: np.ndarray, targets, ignore_index: int = -100) -> float:
        predictions = vocab_parallel_argmax(logits, self.world, self.local_model.wte.vocab_start_index)
        counted = np.asarray(targets) != ignore_index
        return float((predictions == targets)[counted].mean()) if counted.any() else float("nan")

    def memory(self) -> dict:
        """This rank's ledger: its shards and the replicated parameters, their gradients and
        AdamW moments, and the activations of its forward."""
        return memory.ledger(self.local_model, self.optimizer, self.activation_bytes)

    def num_parameters(self) -> int:
        """Parameters of the whole (serial) model, not of this rank's shard."""
        return memory.param_count(self.config)

    def state_dict(self) -> dict | None:
        """The serial model's state dict on rank 0 (None elsewhere). Collective: call it on
        every rank (the shards are gathered)."""
        return consolidate_state_dict(self.local_model)

    def shard_state_dict(self) -> dict:
        """This rank's shards under the serial names (no communication)."""
        return self.local_model.state_dict()
