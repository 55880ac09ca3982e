"""A pipeline stage on a piece of every sequence: context parallelism inside the mesh (chapters 9, 11).

Chapter 11 split every sequence over cp ranks (`context_parallel.py`), each holding the whole
model; chapter 9 cut the model over tp and pp ranks (`composed.py`). Megatron-LM composes them:
each rank holds its stage's layers, its tp rank's shards of them, and T/cp tokens of each
sequence of its replica's micro-batches. What changes in a stage is small, because everything
but attention is token-local — LayerNorms, the MLP, the residual stream, the embeddings, the
loss, and each tensor-parallel layer, which only mixes the features of one token:

    positions   the embedding adds each token's own position in the sequence (zigzag or contiguous)
    attention   the core of every block's attention — this rank's H/tp heads (tp) on its T/cp
                queries (cp) — runs ring attention (or Ulysses) over the cp group: the keys and
                values of the other T - T/cp tokens come round the ring
    loss        the mean over this rank's tokens, weighed by their share of the counted tokens
                of the whole sequences: the cp ranks' losses add up to the micro-batch's mean

So a stage is the plain stage — the same modules, the same initial weights — with those three
methods changed (`SplitSequence`, mixed into chapter 5's `PipelineStage`, chapter 6's
`TensorParallelStage` and `SequenceParallelStage`). What crosses a stage boundary is the
(B/dp/m, T/cp, C) activation (T/(cp·tp) tokens with sequence parallelism). The trainer's part
(the gradients summed over cp and averaged over dp in one all-reduce over the flattened dp x cp
group) is in `composed.py`. Parallel equals serial: tests/test_parallel_context_mesh.py.
"""
from __future__ import annotations

import numpy as np

from minidist.core.data import IGNORE_INDEX
from minidist.core.model import GPTConfig
from minidist.parallel.context_parallel import (AttentionStats, SequenceSplit, check_context_parallel,
                                                context_parallel_traffic_per_step, ring_attention)
from minidist.parallel.pipeline_stage import PipelineStage
from minidist.parallel.tensor_stage import SequenceParallelStage, TensorParallelStage
from minidist.parallel.ulysses import ulysses_attention
from minidist.core.tensor import get_default_dtype


def check_context_stage(config: GPTConfig, cp: int, tp: int = 1, algorithm: str = "ring", split: str = "zigzag",
                        sequence_parallel: bool = False) -> None:
    """Every way cp can be wrong inside a mesh, in one line, before any message (pure arithmetic)."""
    check_context_parallel(config, cp, algorithm=algorithm, split=split)  # the split, the algorithm, no dropout
    if algorithm == "ulysses" and (config.n_head // tp) % cp:
        raise ValueError(f"Ulysses inside a mesh: each tp rank's n_head/tp = {config.n_head}/{tp} = "
                         f"{config.n_head // tp} heads are not divisible by cp={cp}")
    if sequence_parallel and (config.block_size // cp) % tp:
        raise ValueError(f"sequence parallelism with cp={cp}: a cp rank's T/cp = {config.block_size}/{cp} = "
                         f"{config.block_size // cp} tokens are not divisible by tp={tp}")


class ContextSplit:
    """This rank's piece of every sequence in its cp `group`: which tokens (`positions`), their
    share of a mean over the whole sequences, and attention over all the tokens — the core that
    a stage's attention calls, on this rank's queries, keys and values (B, H/tp, T/cp, D)."""

    def __init__(self, group, split: SequenceSplit, algorithm: str = "ring"):
        self.group, self.split, self.algorithm = group, split, algorithm
        self.positions = split.positions(group.rank)
        self.stats = AttentionStats()

    def tokens(self, sequences: np.ndarray) -> np.ndarray:
        """(rows, T) ids or targets -> this rank's (rows, T/cp), in the order it holds them."""
        return np.asarray(sequences)[:, self.positions]

    def share(self, targets: np.ndarray) -> float:
        """This rank's counted tokens over the whole sequences' (0 if the sequences count none)."""
        return int((self.tokens(targets) != IGNORE_INDEX).sum()) / max(int((targets != IGNORE_INDEX).sum()), 1)

    def __call__(self, q, k, v, dropout_p: float = 0.0):
        """Causal attention of this rank's queries over the whole sequence (dropout is refused)."""
        if self.algorithm == "ring":
            return ring_attention(q, k, v, self.group, self.split, stats=self.stats)
        return ulysses_attention(q, k, v, self.group, self.split.order(), stats=self.stats)

    def report(self, config: GPTConfig, rows: int, tp: int, layers: int) -> dict:
        """The demo's `context_parallel` JSON in a mesh: the split, the bytes a rank sends per step
        in its cp group (the formula: `layers` attentions of H/tp heads on `rows` sequences), and
        what this rank's attention computed so far."""
        itemsize = np.dtype(get_default_dtype()).itemsize
        return {"cp": self.split.cp, "algorithm": self.algorithm, "split": self.split.kind,
                "positions": self.positions.tolist(),
                "cp_bytes_per_step": context_parallel_traffic_per_step(config, rows, self.split.cp, self.algorithm,
                                                                       itemsize, tp=tp, layers=layers),
                "attention": vars(self.stats).copy()}


class SplitSequence:
    """What a stage changes to run on this rank's tokens (see the module docstring): mixed in
    before a plain stage class, whose arguments follow `context`."""

    def __init__(self, context: ContextSplit, *args, **kwargs):
        super().__init__(*args, **kwargs)  # the plain stage: same modules, same initial weights
        self.context = context  # not a Module: no parameters, walked by nobody
        for block in self.h:
            block.attn.core = context  # its heads, its queries, every key: the ring

    def positions(self, length: int) -> np.ndarray:
        """Where this rank's tokens sit in the whole sequence."""
        return self.context.positions

    def embed(self, idx):
        """This rank's T/cp token ids -> the first block's input: wte + wpe at their own positions."""
        idx, tokens = np.asarray(idx), len(self.context.positions)
        if idx.ndim != 2 or idx.shape[1] != tokens:
            raise ValueError(f"context parallel: a cp rank expects ids of shape (batch, {tokens}), its tokens "
                             f"of sequences of {self.context.split.length}; got {idx.shape}")
        return self.drop(self.wte(idx) + self.wpe(self.positions(idx.shape[1])))

    def head(self, x, targets=None):
        """Given the whole sequences' targets (rows, T): this rank's logits (rows, T/cp, ...) and
        its tokens' mean loss times their share of the counted tokens (the cp ranks' add up)."""
        if targets is None:
            return super().head(x)
        logits, loss = super().head(x, self.context.tokens(targets))
        return logits, loss * self.context.share(targets)


class ContextParallelStage(SplitSequence, PipelineStage):
    """Chapter 5's stage (tp = 1) on this rank's tokens."""


class TensorContextParallelStage(SplitSequence, TensorParallelStage):
    """Chapter 6's tensor-parallel stage on this rank's tokens: its heads, its queries."""


class SequenceContextParallelStage(SplitSequence, SequenceParallelStage):
    """Sequence parallelism inside a cp rank: its T/cp tokens cut again over the tp group."""

    def positions(self, length: int) -> np.ndarray:
        return np.split(self.context.positions, self.group.size)[self.group.rank]


def context_parallel_stage(context: ContextSplit, config: GPTConfig, tp_group, rank: int, stages: int, seed: int,
                           virtual_stages: int, sequence_parallel: bool = False):
    """Stage `rank` of `stages` on this rank's piece of every sequence (the plain stage's choice)."""
    if tp_group.size == 1:
        return ContextParallelStage(context, config, rank, stages, seed, virtual_stages)
    kind = SequenceContextParallelStage if sequence_parallel else TensorContextParallelStage
    return kind(context, config, tp_group, rank, stages, seed, virtual_stages)
