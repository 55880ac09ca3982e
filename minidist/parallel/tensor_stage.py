"""A pipeline stage built from tensor-parallel layers: TP inside PP (chapter 9, composing).

Chapter 5 cut the GPT by layers into stages (`pipeline.PipelineStage`); chapter 6 cut every
big matrix of it over t ranks (`tensor_parallel.TensorParallelGPT`). Composed, each stage of
the pipeline is itself a tensor-parallel group: stage s holds the blocks of its layer range,
each split over its t ranks, plus the embedding (first stage) or the head and the loss (last
stage), split over the vocabulary.

Nothing new is computed here. The stage is `PipelineStage` with its parts made of chapter 6's
layers, and its two ends are `TensorParallelGPT`'s own `embed` and `head`, so the numbers are
exactly those of the tensor-parallel model (and, through it, of the serial one): every shard is
cut from the same full initialisation (`init_shards`).

With sequence parallelism (`SequenceParallelStage`), the activations between the blocks hold
this rank's T/t tokens: what crosses a stage boundary is 1/t of the sequence, so the pipeline's
messages shrink by t as well (Megatron-LM sends the same sequence-split tensor).
"""
from __future__ import annotations

from minidist.comm.world import World
from minidist.core.model import GPTConfig
from minidist.core.nn import Embedding, LayerNorm
from minidist.parallel.pipeline_stage import Layers, PipelineStage, chunk_layers
from minidist.parallel.sequence import SequenceParallelLayers, allreduce_sequence_parallel_grads, mark_sequence_parallel
from minidist.parallel.tensor_layers import TensorParallelLayers
from minidist.parallel.tensor_parallel import (ParallelBlock, SequenceParallelGPT, TensorParallelGPT,
                                               check_tensor_parallel, init_shards)


class TensorParallelStage(PipelineStage):
    """Stage `rank` of `stages`, every block split over the ranks of `group` (its tp group).

    Same parameter names as the serial GPT (`h.2.attn.q_proj.weight`, ...), with this rank's
    shard as the value, as both `PipelineStage` and `TensorParallelGPT` keep them."""

    layers = TensorParallelLayers
    embed, head = TensorParallelGPT.embed, TensorParallelGPT.head  # chapter 6's two ends
    positions, vocab_start_index = TensorParallelGPT.positions, TensorParallelGPT.vocab_start_index

    def __init__(self, config: GPTConfig, group: World, rank: int, stages: int, seed: int = 0,
                 virtual_stages: int = 1):
        check_tensor_parallel(config, group.size, self.layers is SequenceParallelLayers)
        self.config, self.group, self.virtual_stages = config, group, virtual_stages
        self.first, self.last = rank == 0, rank == stages - 1
        c, v, layers = config.n_embd, config.vocab_size, self.layers
        if self.first:
            self.wte = layers.embedding(v, c, group)
            self.wpe = Embedding(config.block_size, c)
            self.drop = layers.dropout(config.dropout, group, seed)
        elif self.last and config.tie_weights:
            self.wte = layers.embedding(v, c, group)  # the head's copy of the tied (V/t, C) rows
        ranges = chunk_layers(config.n_layer, stages, rank, virtual_stages)
        self.h = Layers({i: ParallelBlock(config, group, seed=seed + 2 * (i + 1), layers=layers)
                         for start, end in ranges for i in range(start, end)})
        blocks = dict(zip((i for start, end in ranges for i in range(start, end)), self.h))
        self.chunks = [[blocks[i] for i in range(start, end)] for start, end in ranges]
        if self.last:
            self.ln_f = LayerNorm(c)
            if not config.tie_weights:
                self.lm_head = layers.column(c, v, group, bias=False)
        init_shards(self, seed)  # the full parameter from the seed, then this rank's slice

    def finish_gradients(self) -> None:
        """Nothing to add: replicated parameters saw every token on every tp rank."""


class SequenceParallelStage(TensorParallelStage):
    """The stage built from sequence parallelism's layers (chapter 6, part 3): LayerNorms, the
    residual stream and what crosses to the next stage hold this rank's T/t tokens."""

    layers = SequenceParallelLayers
    positions = SequenceParallelGPT.positions

    def __init__(self, config: GPTConfig, group: World, rank: int, stages: int, seed: int = 0,
                 virtual_stages: int = 1):
        super().__init__(config, group, rank, stages, seed, virtual_stages)
        # replicated but fed T/t tokens: partial gradients, summed over the tp group after backward
        ends = [m for m in (getattr(self, "wpe", None), getattr(self, "ln_f", None)) if m is not None]
        mark_sequence_parallel(*ends, *(m for block in self.h for m in (block.ln_1, block.ln_2)))

    def finish_gradients(self) -> None:
        allreduce_sequence_parallel_grads(self, self.group)
