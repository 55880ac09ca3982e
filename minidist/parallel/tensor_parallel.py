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

The model verifies its group once, when it is built (`World.verify`: the same config, tp and
dtype on every rank, from which every later message's size follows), and its layers keep that
verified group, so each collective is one line with no per-call check. On one machine the
all-reduces (algorithm "auto") go through the shared-memory window (`comm/shared_memory.py`).

`SequenceParallelGPT` (part 3, `sequence.py`) is the same model built from sequence
parallelism's layers: the LayerNorms, residual adds and dropouts run on this rank's T/t tokens,
every g becomes a reduce-scatter, every f an all-gather, and the replicated parameters'
gradients are summed over the group after backward.

The formulas sit with their kind: parameters per rank in `memory.tensor_parallel_parameter_counts`,
the activations sequence parallelism saves in `memory.sequence_parallel_activation_bytes`, bytes
per step in `comm.cost.tensor_parallel_traffic_per_step`.
"""
from __future__ import annotations

import math

import numpy as np

from minidist.core import functional as F
from minidist.plan import memory
from minidist.comm import all_gather, all_reduce, any_rank
from minidist.comm.world import World, resolve
from minidist.core.model import GPTConfig, init_weights
from minidist.core.nn import Embedding, LayerNorm, Module, ModuleList, Parameter
from minidist.precision.mixed_precision import Precision
from minidist.core.optim import clip_grad_norm_
from minidist.parallel.sequence import (SequenceParallelLayers, allreduce_sequence_parallel_grads,
                                        check_sequence_length, mark_sequence_parallel)
from minidist.parallel.tensor_layers import TensorParallelLayers, vocab_parallel_argmax, vocab_parallel_cross_entropy
from minidist.core.tensor import Tensor, get_default_dtype, graph_bytes
from minidist.training.train import OptimSettings, Trainer, load_training_state, make_optimizer, training_state


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


# ----------------------------------------------------------------------------- the model


class ParallelAttention(Module):
    """Causal self-attention with this rank's n_head/t heads; one f, one g (built from
    sequence parallelism's layers: one all-gather of the tokens, one reduce-scatter)."""

    def __init__(self, config: GPTConfig, group: World, seed: int = 0, layers=TensorParallelLayers):
        c, t = config.n_embd, group.size
        self.group = group
        self.n_head_local = config.n_head // t
        self.q_proj, self.k_proj, self.v_proj = (layers.column(c, c, group, copy_input=False) for _ in range(3))
        self.c_proj = layers.row(c, c, group)
        self.dropout_p = config.dropout
        self.attn_rng = np.random.default_rng([seed, 1, group.rank])  # other heads, other masks
        self.resid_dropout = layers.dropout(config.dropout, group, seed)  # the serial mask

    def forward(self, x):
        x = self.q_proj.enter(x, self.group)  # f once for q, k and v: one all-reduce in backward (chapter 6)
        b, t, _ = x.shape

        def heads(y):  # (B, T, C/t) -> (B, H/t, T, D): rank r's columns are heads r·H/t ...
            return y.reshape(b, t, self.n_head_local, -1).permute(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        y = self.core(q, k, v, self.dropout_p if self.training else 0.0)
        y = y.permute(0, 2, 1, 3).reshape(b, t, -1)  # this rank's heads side by side: C/t features
        return self.resid_dropout(self.c_proj(y))  # row-parallel: g inside

    def core(self, q, k, v, dropout_p):
        """softmax(q k^T / sqrt(d)) v on this rank's heads (context parallelism swaps it, chapter 11)."""
        return F.scaled_dot_product_attention(q, k, v, causal=True, dropout_p=dropout_p, rng=self.attn_rng)


class ParallelMLP(Module):
    def __init__(self, config: GPTConfig, group: World, seed: int = 0, layers=TensorParallelLayers):
        c = config.n_embd
        self.c_fc = layers.column(c, 4 * c, group)  # f inside
        self.c_proj = layers.row(4 * c, c, group)  # g inside
        self.dropout = layers.dropout(config.dropout, group, seed)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # GELU works on the slice


class ParallelBlock(Module):
    def __init__(self, config: GPTConfig, group: World, seed: int = 0, layers=TensorParallelLayers):
        self.ln_1 = LayerNorm(config.n_embd)
        self.attn = ParallelAttention(config, group, seed=seed, layers=layers)
        self.ln_2 = LayerNorm(config.n_embd)
        self.mlp = ParallelMLP(config, group, seed=seed + 1, layers=layers)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TensorParallelGPT(Module):
    """This rank's shard of the GPT; same parameter names as `minidist.core.model.GPT`."""

    layers = TensorParallelLayers  # what the modules are built from (SequenceParallelGPT: its own)

    def __init__(self, config: GPTConfig, group: World | None = None, seed: int = 0):
        world = resolve(group)
        check_tensor_parallel(config, world.size)
        self.config = config
        # every message's size follows from these facts: checked once here, never per call (chapter 7)
        facts = [config, world.size, get_default_dtype().str]
        self.group = group = world.verify("the tensor-parallel layout", facts)
        layers = self.layers
        self.wte = layers.embedding(config.vocab_size, config.n_embd, group)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = layers.dropout(config.dropout, group, seed)
        self.h = ModuleList(ParallelBlock(config, group, seed=seed + 2 * (i + 1), layers=layers)
                            for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd)
        if not config.tie_weights:  # the head's weight is split like the vocabulary: (V/t, C)
            self.lm_head = layers.column(config.n_embd, config.vocab_size, group, bias=False)
        init_shards(self, seed)

    def positions(self, length: int) -> np.ndarray:
        """The positions of the tokens this rank's activations hold: all of them."""
        return np.arange(length)

    def finish_gradients(self) -> None:
        """After backward, before clipping: nothing to do here. The replicated parameters saw
        every token on every rank, so their gradients already agree."""

    def forward(self, idx, targets=None):
        """This rank's logits (batch, time, V/t) and, given targets, the global mean loss."""
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        return self.head(x, targets)

    # The two ends of the model, apart, so a pipeline stage of it runs them too (chapter 9).
    def embed(self, idx):
        """Token ids -> the first block's input: the vocabulary-parallel embedding (g inside)."""
        idx = np.asarray(idx.data if isinstance(idx, Tensor) else idx)
        if idx.ndim != 2 or idx.shape[1] > self.config.block_size:
            raise ValueError(f"GPT expects ids of shape (batch, time <= {self.config.block_size}), got {idx.shape}")
        return self.drop(self.wte(idx) + self.wpe(self.positions(idx.shape[1])))

    def head(self, x, targets=None):
        """The last block's output -> this rank's V/t logits and, given targets, the loss."""
        x = self.ln_f(x)
        if self.config.tie_weights:  # logits = x wte^T: a column-parallel linear with wte's rows
            logits = F.linear(self.layers.column.enter(x, self.group), self.wte.weight)
        else:
            logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_start_index(),
                                                self.config.vocab_size)
        return logits, loss

    def vocab_start_index(self) -> int:
        """The first vocabulary id of this rank's V/t logits (and of its rows of wte)."""
        return self.group.rank * (self.config.vocab_size // self.group.size)


class SequenceParallelGPT(TensorParallelGPT):
    """The tensor-parallel GPT built from sequence parallelism's layers (`sequence.py`): between
    the split layers, activations are this rank's T/t tokens. The LayerNorms and wpe are tagged
    for the gradient all-reduce here; the row-parallel biases tag themselves."""

    layers = SequenceParallelLayers

    def __init__(self, config: GPTConfig, group: World | None = None, seed: int = 0):
        check_sequence_length(config.block_size, resolve(group).size)
        super().__init__(config, group, seed)
        # replicated but fed T/t tokens: partial gradients, summed after backward (chapter 6, section 8)
        mark_sequence_parallel(self.wpe, self.ln_f, *(m for b in self.h for m in (b.ln_1, b.ln_2)))

    def positions(self, length: int) -> np.ndarray:
        """The positions of this rank's T/t tokens: the embedding reduce-scatters along the sequence."""
        check_sequence_length(length, self.group.size)
        return np.split(np.arange(length), self.group.size)[self.group.rank]

    def finish_gradients(self) -> None:
        """The replicated parameters saw only this rank's T/t tokens: sum their partial gradients
        over the group (before clipping: the norm needs the whole gradients)."""
        allreduce_sequence_parallel_grads(self, self.group)


def vocab_parallel_accuracy(logits: np.ndarray, targets, group: World, vocab_start: int,
                            ignore_index: int = -100) -> float:
    """`data.accuracy` of logits split over the vocabulary (collective over `group`): the
    arg-max over all V entries, never gathered; targets equal to `ignore_index` do not count."""
    predictions = vocab_parallel_argmax(logits, group, vocab_start)
    counted = np.asarray(targets) != ignore_index
    return float((predictions == targets)[counted].mean()) if counted.any() else float("nan")


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


def consolidate_state_dict(model: TensorParallelGPT, dst: int = 0, state: dict | None = None) -> dict | None:
    """The serial model's state dict (same keys, full shapes) on rank `dst`, None elsewhere.
    Collective: every rank of the group must call it. Split parameters are all-gathered and
    glued along their partition axis; replicated ones are taken as they are. `state`: this
    rank's shards by name, when the parameters do not hold them (ZeRO-3 keeps only chunks)."""
    group, whole = model.group, {}
    for name, p in model.named_parameters():
        shard = np.ascontiguousarray(state[name] if state is not None else p.data)
        value = shard.copy()
        if getattr(p, "tensor_model_parallel", False) and group.size > 1:
            flat = all_gather(shard, group=group)  # every shard, in rank order
            value = np.concatenate([s.reshape(shard.shape) for s in np.split(flat, group.size)], axis=p.partition_dim)
        whole[name] = value
    return whole if group.rank == dst else None


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
    params = split + replicated
    norm = tensor_parallel_grad_norm(params, [p.grad for p in params], group)
    return clip_grad_norm_(params, max_norm, total_norm=norm)


def tensor_parallel_grad_norm(params: list, grads: list, group: World) -> float:
    """The whole model's gradient norm from this rank's `grads` (of `params`): the split ones'
    squares summed over the tp group, the replicated ones' added once (chapter 10's fp32 copies
    of 16-bit gradients go through here too)."""
    split = [float(np.dot(g.ravel(), g.ravel())) for p, g in zip(params, grads)
             if g is not None and getattr(p, "tensor_model_parallel", False)]
    replicated = [float(np.dot(g.ravel(), g.ravel())) for p, g in zip(params, grads)
                  if g is not None and not getattr(p, "tensor_model_parallel", False)]
    total = np.array([sum(split)])
    all_reduce(total, group=group)
    return math.sqrt(float(total[0]) + sum(replicated))


# ----------------------------------------------------------------------------- the trainer


class TensorParallelTrainer(Trainer):
    """The serial training step with every rank of `group` holding 1/t of the big matrices.

    All ranks see the same batch (tensor parallelism splits the model, not the data).
    sequence_parallel=True: the model is a `SequenceParallelGPT`, which also splits the
    LayerNorm/dropout/residual activations by tokens."""

    name = "tp"

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, sequence_parallel: bool = False, precision: str = "fp32"):
        check_tensor_parallel(config, resolve(group).size, sequence_parallel)
        self.name = "tp-sp" if sequence_parallel else "tp"
        self.config, self.settings, self.task, self.batch_size = config, settings, task, batch_size
        model = SequenceParallelGPT if sequence_parallel else TensorParallelGPT
        self.local_model = model(config, group, seed=seed)  # this rank's shard
        self.group = self.local_model.group  # verified when the model was built
        self.model = None  # no full model to sample from on one rank (see the chapter)
        self.amp = Precision(precision, settings)  # chapter 10: the format, the masters, the scaler
        self.precision, self.scaler = self.amp.name, self.amp.scaler
        # AdamW is elementwise: shards are fine (16 bits: on their fp32 masters)
        self.optimizer = make_optimizer(self.local_model, settings, self.amp.cast(self.local_model))
        self.activation_bytes = 0

    def step(self, step: int):
        """One optimizer step on the global batch; returns (loss, accuracy), same on every rank."""
        x, y = self.task.get_batch(step, self.batch_size)
        with self.amp.autocast():  # fp32: nothing changes
            logits, loss = self.local_model(x, y)
        if not self.activation_bytes:  # every step builds the same graph: measure it once
            self.activation_bytes = graph_bytes(loss)
        self.local_model.zero_grad()
        self.amp.scale(loss).backward()
        self.local_model.finish_gradients()
        # clip by the whole model's norm (clip_grad_norm_tensor_parallel_'s), every rank agreeing on a skip
        params = self.optimizer.params()
        self.amp.step(self.optimizer, step, agree=lambda found_inf: any_rank(found_inf, self.group),
                      norm=lambda grads: tensor_parallel_grad_norm(params, grads, self.group))
        return loss.item(), self.accuracy(logits.data, y)

    def accuracy(self, logits: np.ndarray, targets) -> float:
        logits = np.asarray(logits, dtype=np.float32) if self.amp.low else logits
        return vocab_parallel_accuracy(logits, targets, self.group, self.local_model.vocab_start_index())

    def report(self) -> dict:
        return self.amp.report()

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

    def global_state(self) -> dict:
        """This rank's shards and their AdamW moments, each where it sits in the serial arrays
        (its box along the split axis), and its dropout generators (attention's differs per rank:
        other heads, other masks)."""
        return training_state(self.local_model, self.optimizer, tp_rank=self.group.rank)

    def load_global_state(self, read) -> None:
        load_training_state(self.local_model, self.optimizer, read, tp_rank=self.group.rank)
