"""The small GPT every chapter trains: GPT-2's architecture at a size a laptop can run.

Chapter 1. Token and position embeddings, `n_layer` pre-LayerNorm blocks (causal multi-head
attention, then a 4x-wide MLP with GELU, each added back to the residual stream), a final
LayerNorm and a language-model head, optionally tied to the token embedding.

Initial weights depend only on (seed, parameter name): each parameter draws from its own
generator. A pipeline stage or a tensor-parallel shard can therefore cut its piece out of the
same numbers the serial model starts from, which is what lets every parallel layout reproduce
the serial run.

The model is also usable in three parts — `embed`, `blocks`, `head` — which is how the
pipeline chapter splits it across ranks. `set_recompute` switches on activation checkpointing
(chapter 11): the blocks, or only their attention cores, run again in backward.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import numpy as np

from minidist.core import functional as F
from minidist.core.nn import Dropout, Embedding, LayerNorm, Linear, Module, ModuleList
from minidist.core.recompute import check_recompute, checkpoint, checkpoint_sequential
from minidist.core.tensor import Tensor, no_grad


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(Module):
    """Each position attends to itself and the positions before it, in n_head heads."""

    recompute_core = False  # chapter 11, selective recomputation (GPT.set_recompute)

    def __init__(self, config: GPTConfig, seed: int = 0):
        c = config.n_embd
        self.n_head = config.n_head
        # separate q, k, v projections: tensor parallelism splits each of them by heads
        self.q_proj, self.k_proj, self.v_proj = Linear(c, c), Linear(c, c), Linear(c, c)
        self.c_proj = Linear(c, c)
        self.dropout_p = config.dropout
        self.attn_rng = np.random.default_rng([seed, 1])
        self.resid_dropout = Dropout(config.dropout, seed=seed)

    def split_heads(self, x, n_head):
        b, t, c = x.shape
        return x.reshape(b, t, n_head, c // n_head).permute(0, 2, 1, 3)  # (B, H, T, D)

    def forward(self, x):
        b, t, c = x.shape
        q = self.split_heads(self.q_proj(x), self.n_head)
        k = self.split_heads(self.k_proj(x), self.n_head)
        v = self.split_heads(self.v_proj(x), self.n_head)
        p = self.dropout_p if self.training else 0.0
        if self.recompute_core:  # keep q, k, v only: the (B, H, T, T) weights and mask are rebuilt in backward
            y = checkpoint(self.core, q, k, v, p, generators=[self.attn_rng])
        else:
            y = self.core(q, k, v, p)
        y = y.permute(0, 2, 1, 3).reshape(b, t, c)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))

    def core(self, q, k, v, dropout_p):
        """softmax(q k^T / sqrt(d)) v with dropout on the weights: what selective recomputation reruns."""
        return F.scaled_dot_product_attention(q, k, v, causal=True, dropout_p=dropout_p, rng=self.attn_rng)


class MLP(Module):
    def __init__(self, config: GPTConfig, seed: int = 0):
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)
        self.dropout = Dropout(config.dropout, seed=seed)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(Module):
    """Pre-LayerNorm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        self.ln_1 = LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, seed=seed)
        self.ln_2 = LayerNorm(config.n_embd)
        self.mlp = MLP(config, seed=seed + 1)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(Module):
    recompute = "none"  # chapter 11: "none", "full" or "selective" (set_recompute)
    segments = None  # with "full": checkpointed runs of consecutive blocks (None: one per block)

    def __init__(self, config: GPTConfig, seed: int = 0):
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = Dropout(config.dropout, seed=seed)
        self.h = ModuleList(Block(config, seed=seed + 2 * (i + 1)) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd)
        if not config.tie_weights:
            self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        init_weights(self, seed)

    # -- the three parts a pipeline splits the model into
    def embed(self, idx):
        idx = np.asarray(idx.data if isinstance(idx, Tensor) else idx)
        if idx.ndim != 2:
            raise ValueError(f"GPT expects token ids of shape (batch, time), got {idx.shape}")
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"GPT: sequence length {t} is longer than block_size={self.config.block_size}")
        return self.drop(self.wte(idx) + self.wpe(np.arange(t)))

    def head(self, x, targets=None):
        x = self.ln_f(x)
        weight = self.wte.weight if self.config.tie_weights else self.lm_head.weight
        logits = F.linear(x, weight)
        loss = None if targets is None else F.cross_entropy(logits, targets)
        return logits, loss

    def forward(self, idx, targets=None):
        """Logits of shape (batch, time, vocab) and, given targets, the mean cross-entropy."""
        x = self.embed(idx)
        if self.recompute == "full":  # chapter 11: keep each run's input only, run it again in backward
            x = checkpoint_sequential(self.h, self.segments or len(self.h), x)
        else:
            for block in self.h:
                x = block(x)
        return self.head(x, targets)

    def set_recompute(self, mode: str = "full", segments: int | None = None) -> "GPT":
        """Activation checkpointing (chapter 11, minidist/core/recompute.py): memory for compute.

        "none" keeps every block's graph (the default). "full" keeps only the input of each of
        `segments` runs of consecutive blocks (default: one run per block) and runs each again
        in backward. "selective" keeps everything except the attention core, softmax(QK^T)V and
        its dropout, whose (batch, heads, T, T) arrays it rebuilds in backward. The numbers of
        training do not change, only the memory and the time.
        """
        check_recompute(mode, segments, self.config.n_layer)
        self.recompute, self.segments = mode, segments
        for block in self.h:
            block.attn.recompute_core = mode == "selective"
        return self

    def generate(self, idx, max_new_tokens: int) -> np.ndarray:
        """Extend each row of `idx` greedily (most likely next token) by max_new_tokens."""
        idx = np.asarray(idx)
        was_training = self.training
        self.eval()
        with no_grad():
            for _ in range(max_new_tokens):
                logits, _ = self(idx[:, -self.config.block_size:])
                next_id = logits.data[:, -1, :].argmax(axis=-1)
                idx = np.concatenate([idx, next_id[:, None].astype(idx.dtype)], axis=1)
        self.train(was_training)
        return idx


def init_weights(model: Module, seed: int, n_layer: int | None = None) -> None:
    """GPT-2 initialisation, drawn per parameter from a generator seeded by (seed, name).

    Weights ~ N(0, 0.02); the two projections that write into the residual stream (attention's
    and the MLP's c_proj) use 0.02 / sqrt(2 n_layer) so the stream's variance does not grow with
    depth; biases are zero and LayerNorm gains one. Values are drawn in float64 and then cast,
    so float32 and float64 models start from the same numbers.
    """
    n_layer = n_layer or model.config.n_layer
    for name, p in model.named_parameters():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name.endswith("bias"):
            value = np.zeros(p.shape)
        elif ".ln_" in name or name.startswith("ln_"):
            value = np.ones(p.shape)
        else:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
            value = rng.normal(0.0, std, size=p.shape)
        p.data[...] = value
