"""A pipeline stage: the part of the GPT one rank holds (chapters 4 and 5).

`partition` cuts the n_layer blocks into p balanced ranges; `chunk_layers` gives a rank its
chunks (with interleaving, chunks rank, rank + p, ...), or its part of a cut by measured cost
(stage_balance.py); `PipelineStage` builds only those blocks,
plus the embeddings on the first stage and the head on the last, under the serial model's names
and from the serial model's initialisation; `check_pipeline_layout` says, before any message, every way
a pipeline layout can be wrong. The engine that runs a schedule over the stages is
`pipeline.py`'s `PipelineTrainer`.
"""
from __future__ import annotations

import numpy as np

from minidist.core.model import GPT, Block, GPTConfig, init_weights
from minidist.core.nn import Dropout, Embedding, LayerNorm, Linear, Module
from minidist.parallel import schedules as S
from minidist.core.recompute import check_recompute, checkpoint_sequential


def partition(n_layer: int, stages: int) -> list[tuple[int, int]]:
    """Balanced layer ranges [start, end) per stage; the first n_layer % p stages get one more
    (the last stage also runs the head and the loss, so it is the one to keep light)."""
    ### BEGIN SOLUTION assignment=layer_partition
    sizes = [n_layer // stages + (r < n_layer % stages) for r in range(stages)]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(bounds[r]), int(bounds[r + 1])) for r in range(stages)]
    ### END SOLUTION


def check_pipeline_layout(config: GPTConfig, batch_size: int, stages: int, microbatches: int, schedule: str,
                 virtual_stages: int = 1, blocks: list[int] | None = None) -> None:
    """Every way the layout can be wrong, found identically on every rank before any message."""
    if blocks is not None:
        if virtual_stages != 1:
            raise ValueError("a cut of the blocks by stage (stage_blocks) needs one chunk per rank, "
                             f"not virtual_stages={virtual_stages}")
        if len(blocks) != stages or min(blocks) < 1 or sum(blocks) != config.n_layer:
            raise ValueError(f"stage_blocks {list(blocks)} must give each of the {stages} stages at least one "
                             f"block and add up to n_layer={config.n_layer}")
    if schedule not in S.SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose from {sorted(S.SCHEDULES)}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if schedule == "interleaved":
        S.check_interleaved(stages, microbatches, virtual_stages)
        if stages * virtual_stages > config.n_layer:
            raise ValueError(f"interleaved pipeline of pp={stages} stages x virtual_stages={virtual_stages} = "
                             f"{stages * virtual_stages} chunks needs at least {stages * virtual_stages} layers, "
                             f"but the model has n_layer={config.n_layer}: each chunk must hold at least one block")
    elif virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule 'interleaved' (got {schedule!r}, "
                         "which holds one chunk per rank)")
    if stages > config.n_layer:
        raise ValueError(f"pipeline of pp={stages} stages needs at least {stages} layers, but the model has "
                         f"n_layer={config.n_layer}: each stage must hold at least one block")
    if batch_size % microbatches:
        raise ValueError(f"global batch {batch_size} does not split into {microbatches} micro-batches "
                         f"({batch_size} % {microbatches} = {batch_size % microbatches})")


class Layers(Module):
    """Blocks start..end-1, named by their index in the whole model (`h.2`, `h.3`), as in GPT."""

    def __init__(self, blocks: dict):
        self._items = list(blocks.values())
        for i, block in blocks.items():
            setattr(self, str(i), block)

    def __iter__(self):
        return iter(self._items)


def chunk_layers(n_layer: int, stages: int, rank: int, virtual_stages: int = 1,
                 blocks: list[int] | None = None) -> list[tuple[int, int]]:
    """The layer ranges rank `rank` holds: chunks rank, rank + p, ... of the p * v chunks; with
    `blocks` (one count per stage, v = 1: a cut by measured cost, stage_balance.py) that cut."""
    if blocks is not None:
        start = sum(blocks[:rank])
        return [(start, start + blocks[rank])]
    ranges = partition(n_layer, stages * virtual_stages)
    return [ranges[chunk * stages + rank] for chunk in range(virtual_stages)]


class PipelineStage(Module):
    """The part of the GPT that stage `rank` of `stages` holds, with the serial model's names.

    With `virtual_stages=v` it holds v chunks of blocks (not adjacent: chunk c is the model's
    chunk c * p + rank), still in one Module, so the optimizer, the gradient norm and the state
    dict see one set of parameters per rank. `first` (the embedding) is rank 0, `last` (the
    head and the loss) rank p - 1: they belong to its chunk 0 and chunk v - 1."""

    def __init__(self, config: GPTConfig, rank: int, stages: int, seed: int = 0, virtual_stages: int = 1,
                 stage_blocks: list[int] | None = None):
        self.config, self.virtual_stages = config, virtual_stages
        self.first, self.last = rank == 0, rank == stages - 1
        c, v = config.n_embd, config.vocab_size
        if self.first:
            self.wte = Embedding(v, c)
            self.wpe = Embedding(config.block_size, c)
            self.drop = Dropout(config.dropout, seed=seed)
        elif self.last and config.tie_weights:
            self.wte = Embedding(v, c)  # the head's copy of the tied weight: same name, same numbers
        ranges = chunk_layers(config.n_layer, stages, rank, virtual_stages, stage_blocks)
        self.h = Layers({i: Block(config, seed=seed + 2 * (i + 1)) for start, end in ranges for i in range(start, end)})
        blocks = dict(zip((i for start, end in ranges for i in range(start, end)), self.h))
        self.chunks = [[blocks[i] for i in range(start, end)] for start, end in ranges]  # a plain list: not walked
        if self.last:
            self.ln_f = LayerNorm(c)
            if not config.tie_weights:
                self.lm_head = Linear(c, v, bias=False)
        init_weights(self, seed, n_layer=config.n_layer)

    def tied_copy(self):
        """The last stage's copy of the tied wte.weight when it is a second copy (p > 1), else None.
        (A method, not an attribute: a Parameter attribute would show up in named_parameters.)"""
        return self.wte.weight if (self.last and not self.first and self.config.tie_weights) else None

    def has_input(self, chunk: int = 0) -> bool:
        """Is this chunk the model's first (token ids in, through the embedding)?"""
        return self.first and chunk == 0

    def has_loss(self, chunk: int = 0) -> bool:
        """Is this chunk the model's last (the head and the loss)?"""
        return self.last and chunk == self.virtual_stages - 1

    embed, head = GPT.embed, GPT.head  # the serial model's own code, run on this stage's modules
    recompute = "none"  # chapter 11: "full" checkpoints each block of the stage (set_recompute)

    def forward(self, x, targets=None, chunk: int = 0):
        """Token ids (first chunk) or activations in; activations, or (logits, loss) on the last."""
        if self.has_input(chunk):
            x = self.embed(x)
        if self.recompute == "full":  # each micro-batch keeps its blocks' inputs only, until its backward
            x = checkpoint_sequential(self.chunks[chunk], len(self.chunks[chunk]), x)
        else:
            for block in self.chunks[chunk]:
                x = block(x)
        return self.head(x, targets) if self.has_loss(chunk) else x

    def set_recompute(self, mode: str = "full") -> None:
        """Activation checkpointing in a pipeline stage (chapter 11): "full" reruns each block in
        backward, "selective" only the attention cores (chapter 4's attention; the tensor-parallel
        one has no selective variant). The activations a micro-batch holds shrink, the numbers do not change."""
        check_recompute(mode, None, self.config.n_layer)
        self.recompute = mode
        for block in self.h:
            if mode == "selective":
                if not hasattr(block.attn, "recompute_core"):
                    raise ValueError("selective recomputation is written for the serial attention, not the "
                                     "tensor-parallel one: use --recompute full")
                block.attn.recompute_core = True
