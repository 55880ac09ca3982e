"""Context parallelism (上下文并行): each rank holds a piece of every sequence; attention rings.

Chapter 11, part 2 (ring attention: Liu et al. 2023; Megatron-LM's `--context-parallel-size`).
Sequence parallelism (chapter 6) splits the tokens only between tensor-parallel matrices;
context parallelism splits them everywhere. Every rank holds the whole model (as in data
parallelism) and T/N tokens of each sequence. LayerNorms, the MLP, the embeddings (at the
tokens' own positions) and the loss are token-local: they run on the rank's tokens as they are.
Only attention mixes tokens — a query needs every earlier key — and it is done in a ring:

    ring attention (N ranks)   step s: rank r holds the K/V block of rank r-s, sends it on to r+1
                               while it attends to it; after N-1 steps it has seen every block.

The blocks' partial attentions are merged with the online-softmax rule: a partial result over
some keys is kept as (out, lse), out normalised by its own softmax sum and lse = log of that
sum, and two of them over disjoint keys merge as

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

Backward (`RingAttention.backward`, FlashAttention's formulas): with the final lse saved, a
block's softmax weights are recomputed as exp(scores - lse), so no T x T matrix is ever kept;
the K/V blocks go round again, and so do their gradients dK, dV, each collecting the
contributions of the ranks it passes until it reaches its owner: N-1 more sends.

Traffic per attention, per rank (`ring_attention_traffic`): forward N-1 messages of K and V,
2 (N-1) B·H·(T/N)·D elements; backward as much K/V again plus as much dK/dV. Memory: a rank
keeps its q, k, v, output and lse — no scores; it computes B·H·T²/N score entries in all
(without a mask), one block at a time.

The causal mask makes the work uneven: with contiguous pieces rank 0 (the first tokens) sees
almost nothing and rank N-1 everything. The zigzag split (`SequenceSplit`) cuts the sequence
into 2N chunks and gives rank r chunks r and 2N-1-r, an early one and a late one: every rank
then has the same number of visible scores. A block of chunks is skipped where the mask hides
it whole; the K/V still travel (every rank needs them later in the ring).

DeepSpeed-Ulysses, the other way to split attention (all-to-all to heads), is in `ulysses.py`.

`ContextParallelTrainer` runs the serial GPT's own modules on this rank's tokens
(`ContextParallelGPT`); each rank's loss is its tokens' share of the global mean, so the
gradient of the replicated weights is the *sum* over the cp group, and the average over dp
replicas: one all-reduce over all cp x dp ranks (Megatron's "dp-cp" group), here chapter 3's
bucketed `DistributedDataParallel`. Ranks are numbered cp fastest (a cp group is adjacent ranks:
it talks every layer). Parallel equals serial: tests/test_parallel_context.py.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import numpy as np

from minidist import timeline
from minidist.plan import memory
from minidist.comm import all_reduce, any_rank, irecv, isend, wait
from minidist.comm.world import World, resolve
from minidist.core.data import IGNORE_INDEX, shard_rows
from minidist.precision.mixed_precision import Precision
from minidist.core.model import GPT, GPTConfig
from minidist.parallel.data_parallel import DistributedDataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.ulysses import check_ulysses, ulysses_attention, ulysses_traffic
from minidist.core.tensor import Function, get_default_dtype, graph_bytes
from minidist.training.train import (OptimSettings, Trainer, load_training_state, make_optimizer, training_state)

ALGORITHMS, SPLITS = ("ring", "ulysses"), ("zigzag", "contiguous")
KV_TAG, DKV_TAG = 11, 12  # the ring's two streams of messages: K/V blocks, their gradients


def check_context_parallel(config: GPTConfig, cp: int, dp: int = 1, world_size: int | None = None,
                           batch_size: int | None = None, algorithm: str = "ring", split: str = "zigzag") -> None:
    """Every way a context-parallel layout can be wrong, in one line, before any message."""
    if algorithm not in ALGORITHMS or split not in SPLITS:
        raise ValueError(f"context parallel: algorithm {algorithm!r} / split {split!r}: "
                         f"choose from {ALGORITHMS} / {SPLITS}")
    if not (isinstance(cp, int) and isinstance(dp, int) and cp >= 1 and dp >= 1):
        raise ValueError(f"context parallel: cp and dp must be integers >= 1, got cp={cp!r}, dp={dp!r}")
    if world_size is not None and cp * dp != world_size:
        raise ValueError(f"context parallel: cp={cp} x dp={dp} = {cp * dp} ranks, but the world has {world_size}")
    if batch_size is not None and batch_size % dp:
        raise ValueError(f"context parallel: global batch {batch_size} does not split over dp={dp} replicas")
    check_sequence_split(config.block_size, cp, split)
    if algorithm == "ulysses":
        check_ulysses(config.n_head, cp)
    if config.dropout:
        raise ValueError(f"context parallel: dropout={config.dropout} is not supported (attention-weight dropout "
                         "would need the serial mask of every block of scores): use dropout 0")


def check_sequence_split(length: int, cp: int, kind: str = "zigzag") -> None:
    pieces = 2 * cp if kind == "zigzag" else cp
    if length % pieces:
        raise ValueError(f"context parallel: sequence length T={length} is not divisible by "
                         + (f"2 x cp = {pieces} (the zigzag split cuts it into 2 chunks per rank)"
                            if kind == "zigzag" else f"cp={cp}"))


@dataclass(frozen=True)
class SequenceSplit:
    """Which tokens of a sequence of `length` each of `cp` ranks holds.

    contiguous: rank r holds chunk r of cp equal chunks.
    zigzag:     2·cp chunks; rank r holds chunks r and 2·cp-1-r (cp = 2: 0,3 | 1,2)."""
    length: int
    cp: int
    kind: str = "zigzag"

    def __post_init__(self):
        check_sequence_split(self.length, self.cp, self.kind)

    @property
    def chunk(self) -> int:
        """Tokens per chunk."""
        return self.length // (2 * self.cp if self.kind == "zigzag" else self.cp)

    def chunk_ids(self, rank: int) -> tuple[int, ...]:
        return (rank, 2 * self.cp - 1 - rank) if self.kind == "zigzag" else (rank,)

    def positions(self, rank: int) -> np.ndarray:
        """The positions in the sequence of rank's tokens, in the order the rank holds them."""
        return np.concatenate([np.arange(c * self.chunk, (c + 1) * self.chunk) for c in self.chunk_ids(rank)])

    def order(self) -> np.ndarray:
        """Every rank's positions, rank after rank (where Ulysses' all-to-all puts each token)."""
        return np.concatenate([self.positions(r) for r in range(self.cp)])

    def unmasked_scores(self, rank: int, causal: bool = True) -> int:
        """Score entries per sequence and head that rank's queries see: query i sees keys 0..i."""
        positions = self.positions(rank)
        return int((positions + 1).sum()) if causal else len(positions) * self.length

    def computed_scores(self, rank: int, causal: bool = True) -> int:
        """Score entries per sequence and head the ring computes for rank (whole blocks)."""
        blocks = sum(1 for s in range(self.cp) for _ in visible_blocks(self.chunk_ids(rank), self.chunk_ids(s),
                                                                       self.chunk, causal))
        return blocks * self.chunk ** 2


class AttentionStats:
    """What this rank's attention did: score entries computed, how many of them unmasked, the
    bytes of the largest score array it held at once, and (ring) the CPU seconds of its blocks,
    forward and backward, waits excluded (ranks sharing a core would inflate wall time)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.scores = self.unmasked = self.peak_bytes = 0
        self.compute_seconds = 0.0

    def add(self, scores: int, unmasked: int, nbytes: int) -> None:
        self.scores += scores
        self.unmasked += unmasked
        self.peak_bytes = max(self.peak_bytes, nbytes)


# ----------------------------------------------------------------------------- ring attention


def visible_blocks(q_chunks, k_chunks, size: int, causal: bool):
    """(query rows, key rows, diagonal?) for each pair of chunks with a visible score: query
    chunk ci sees key chunk cj whole if ci > cj, its lower triangle if ci == cj, nothing if ci < cj."""
    for a, ci in enumerate(q_chunks):
        for b, cj in enumerate(k_chunks):
            if not causal or ci >= cj:
                yield slice(a * size, (a + 1) * size), slice(b * size, (b + 1) * size), causal and ci == cj


def block_scores(q: np.ndarray, k: np.ndarray, scale: float, diagonal: bool) -> np.ndarray:
    scores = (q @ np.swapaxes(k, -1, -2)) * scale
    if diagonal:  # a chunk against itself: -inf above the diagonal (key after query)
        scores += np.triu(np.full(scores.shape[-2:], -np.inf, dtype=scores.dtype), k=1)
    return scores


def merge(out: np.ndarray, lse: np.ndarray, block_out: np.ndarray, block_lse: np.ndarray) -> None:
    """The online-softmax rule, in place: (out, lse) over some keys and (block_out, block_lse)
    over others become the attention over both (each weighted by its share of the softmax sum)."""
    total = np.logaddexp(lse, block_lse)
    out *= np.exp(lse - total)[..., None]
    out += block_out * np.exp(block_lse - total)[..., None]
    lse[...] = total


def _pass_on(kv: np.ndarray, group, s: int):
    """Post the ring's next step (send my K/V block right, receive the next from the left):
    (the receive buffer, the requests), or (None, []) after the last step."""
    n, r = group.size, group.rank
    if s == n - 1:
        return None, []
    incoming = np.empty_like(kv)
    return incoming, [irecv(incoming, (r - 1) % n, KV_TAG, group, kind="ring_attention.kv"),
                      isend(kv, (r + 1) % n, KV_TAG, group, kind="ring_attention.kv")]


class RingAttention(Function):
    """softmax(q k^T / sqrt(d) + causal mask) v over the whole sequence, for this rank's queries,
    with the K/V blocks passed round the ring (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, split, causal, stats):
        n, r = group.size, group.rank
        scale, mine = 1.0 / math.sqrt(q.shape[-1]), split.chunk_ids(r)
        out, lse = np.zeros_like(q), np.full(q.shape[:-1], -np.inf, dtype=q.dtype)
        kv = np.ascontiguousarray(np.stack([k, v]))  # K and V travel together: one message per step
        for s in range(n):
            incoming, pending = _pass_on(kv, group, s)  # the next block arrives while we compute
            started = time.process_time()
            for rows, cols, diagonal in visible_blocks(mine, split.chunk_ids((r - s) % n), split.chunk, causal):
                scores = block_scores(q[..., rows, :], kv[0][..., cols, :], scale, diagonal)
                top = scores.max(-1, keepdims=True)
                weights = np.exp(scores - top)
                total = weights.sum(-1, keepdims=True)
                merge(out[..., rows, :], lse[..., rows], (weights @ kv[1][..., cols, :]) / total,
                      (top + np.log(total))[..., 0])
                if stats is not None:
                    stats.add(scores.size, int(np.isfinite(scores).sum()), scores.nbytes)
            if stats is not None:
                stats.compute_seconds += time.process_time() - started
            wait(pending)
            kv = incoming if incoming is not None else kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.split, ctx.causal, ctx.stats = group, split, causal, stats
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse = ctx.saved
        group, split, stats = ctx.group, ctx.split, ctx.stats
        n, r = group.size, group.rank
        left, right = (r - 1) % n, (r + 1) % n
        scale, mine = 1.0 / math.sqrt(q.shape[-1]), split.chunk_ids(r)
        delta = (g * out).sum(-1)  # softmax backward's row term: sum_j a_ij (g v_j^T) = g . out
        dq, kv = np.zeros_like(q), np.ascontiguousarray(np.stack([k, v]))
        own = np.zeros_like(kv)  # dK, dV of my block: my queries' part (step 0), then the others'
        sent = []
        for s in range(n):
            incoming, pending = _pass_on(kv, group, s)
            if s >= 2:  # the gradient of the block I hold, from the ranks it visited before me
                partial = np.empty_like(kv)
                pending.append(irecv(partial, left, DKV_TAG, group, kind="ring_attention.dkv"))
            dkv = own if s == 0 else np.zeros_like(kv)
            started = time.process_time()
            for rows, cols, diagonal in visible_blocks(mine, split.chunk_ids((r - s) % n), split.chunk, ctx.causal):
                qi, gi, kj, vj = q[..., rows, :], g[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :]
                weights = np.exp(block_scores(qi, kj, scale, diagonal) - lse[..., rows, None])  # the final ones
                dkv[1][..., cols, :] += np.swapaxes(weights, -1, -2) @ gi
                dscores = weights * (gi @ np.swapaxes(vj, -1, -2) - delta[..., rows, None]) * scale
                dq[..., rows, :] += dscores @ kj
                dkv[0][..., cols, :] += np.swapaxes(dscores, -1, -2) @ qi
            if stats is not None:
                stats.compute_seconds += time.process_time() - started
            wait(pending)
            if s >= 2:
                dkv += partial
            if s >= 1:  # on towards its owner, collecting each rank's part (the last step delivers it)
                sent.append(isend(dkv, right, DKV_TAG, group, kind="ring_attention.dkv"))
            kv = incoming if incoming is not None else kv
        if n > 1:  # my block's gradient, home after visiting every other rank
            home = np.empty_like(kv)
            wait(irecv(home, left, DKV_TAG, group, kind="ring_attention.dkv"))
            own += home
        wait(sent)
        return dq, own[0], own[1], None, None, None, None


def ring_attention(q, k, v, group, split: SequenceSplit, causal: bool = True, stats: AttentionStats | None = None):
    """Attention of this rank's queries (B, H, T/N, D) over the whole sequence, whose keys and
    values are spread over the ranks of `group` as `split` says."""
    tokens = len(split.positions(group.rank))
    if group.size != split.cp or not q.shape == k.shape == v.shape or q.shape[-2] != tokens:
        raise ValueError(f"ring attention: q {q.shape}, k {k.shape}, v {v.shape} on a group of {group.size} ranks; "
                         f"expected one shape (B, H, {tokens}, D) and a split over {split.cp} ranks")
    return RingAttention.apply(q, k, v, group, split, causal, stats)


def ring_attention_traffic(batch: int, n_head: int, length: int, head_dim: int, cp: int, itemsize: int = 8) -> dict:
    """Bytes and messages one rank sends for one ring attention: forward N-1 K/V blocks of
    (B, H, T/N, D) each for K and V; backward N-1 K/V blocks again and N-1 dK/dV blocks."""
    block = 2 * batch * n_head * (length // cp) * head_dim * itemsize  # K and V
    return {"forward": (cp - 1) * block, "backward": 2 * (cp - 1) * block, "bytes": 3 * (cp - 1) * block,
            "messages": 3 * (cp - 1)}


def context_parallel_traffic_per_step(config: GPTConfig, rows: int, cp: int, algorithm: str = "ring",
                                      itemsize: int = 8, tp: int = 1, layers: int | None = None) -> int:
    """Bytes a rank sends in its cp group per training step: one attention per layer, on the
    replica's `rows` sequences. In a mesh (chapter 9) a rank attends with its tp rank's H/tp
    heads, in the `layers` blocks of its pipeline stage (default: all of them)."""
    traffic = ring_attention_traffic if algorithm == "ring" else ulysses_traffic
    per_layer = traffic(rows, config.n_head // tp, config.block_size, config.n_embd // config.n_head, cp, itemsize)
    return (config.n_layer if layers is None else layers) * per_layer["bytes"]


# ----------------------------------------------------------------------------- the model and the trainer


class ContextParallelGPT:
    """The serial GPT's own modules, run on this rank's tokens of every sequence: everything is
    as in `GPT.forward` but the positions (this rank's) and attention (ring or Ulysses)."""

    def __init__(self, model: GPT, group, split: SequenceSplit, algorithm: str = "ring"):
        self.model, self.group, self.split, self.algorithm = model, group, split, algorithm
        self.positions = split.positions(group.rank)
        self.stats = AttentionStats()

    def __call__(self, idx, targets=None):
        """This rank's logits (B, T/N, V) and, given targets, the mean loss over its tokens."""
        m = self.model
        if np.shape(idx)[1:] != self.positions.shape:
            raise ValueError(f"context parallel: rank {self.group.rank} expects ids of shape (batch, "
                             f"{len(self.positions)}), its tokens of sequences of {self.split.length}; "
                             f"got {np.shape(idx)}")
        x = m.drop(m.wte(idx) + m.wpe(self.positions))  # each token at its own position
        for block in m.h:
            x = x + self.attention(block.attn, block.ln_1(x))
            x = x + block.mlp(block.ln_2(x))
        return m.head(x, targets)

    def attention(self, attn, x):
        b, t, c = x.shape
        q, k, v = (attn.split_heads(proj(x), attn.n_head) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if self.algorithm == "ring":
            y = ring_attention(q, k, v, self.group, self.split, stats=self.stats)
        else:
            y = ulysses_attention(q, k, v, self.group, self.split.order(), stats=self.stats)
        return attn.resid_dropout(attn.c_proj(y.permute(0, 2, 1, 3).reshape(b, t, c)))


def context_parallel_name(cp: int, dp: int = 1, algorithm: str = "ring", split: str = "zigzag") -> str:
    """'cp4', 'dp2-cp2', 'cp4-ulysses', 'cp4-contiguous': the defaults (ring, zigzag) unnamed."""
    parts = ([f"dp{dp}"] if dp > 1 else []) + [f"cp{cp}"]
    return "-".join(parts + [part for part in (algorithm, split) if part not in ("ring", "zigzag")])


def parse_context_parallel_name(kind: str) -> dict | None:
    """`context_parallel_name` backwards: {"cp", "dp", "algorithm", "split"}, or None."""
    match = re.fullmatch(r"(?:dp(\d+)-)?cp(\d+)(-ulysses)?(-contiguous)?", kind)
    if match is None:
        return None
    dp, cp, ulysses, contiguous = match.groups()
    return {"cp": int(cp), "dp": int(dp or 1), "algorithm": "ulysses" if ulysses else "ring",
            "split": "contiguous" if contiguous else "zigzag"}


class ContextParallelTrainer(Trainer):
    """The serial training step with each sequence split over cp ranks (and the batch over dp
    replicas of them). `model`: this rank's whole copy of the GPT (serial; sample from it)."""

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, cp: int = 1, dp: int = 1, algorithm: str = "ring",
                 split: str = "zigzag", precision: str = "fp32"):
        world = resolve(group)
        check_context_parallel(config, cp, dp, world.size, batch_size, algorithm, split)
        self.name = context_parallel_name(cp, dp, algorithm, split)
        self.config, self.settings, self.task, self.batch_size = config, settings, task, batch_size
        self.cp, self.dp, self.algorithm = cp, dp, algorithm
        # the mesh's pp x dp x cp x tp grid with cp fastest here: a cp group is adjacent ranks (mesh.py)
        self.mesh = DeviceMesh(world, dp=dp, cp=cp)
        self.dp_rank = self.mesh.place.dp
        # every attention message's size follows from these facts: checked once (chapter 7)
        facts = [config, cp, dp, algorithm, split, batch_size, get_default_dtype().str]
        self.cp_group = self.mesh.cp_group.verify("the context-parallel layout", facts)
        self.split = SequenceSplit(config.block_size, cp, split)
        self.model = GPT(config, seed=seed)
        self.amp = Precision(precision, settings)
        self.precision, self.scaler = self.amp.name, self.amp.scaler
        # chapter 10: 16-bit weights; attention's blocks travel in fp32 (its Functions compute in it)
        masters = self.amp.cast(self.model)
        self.cp_model = ContextParallelGPT(self.model, self.cp_group, self.split, algorithm)
        # gradients summed over cp and averaged over dp: one all-reduce over the flattened dp x cp group
        self.ddp = DistributedDataParallel(self.model, self.mesh["dp_cp"])
        self.group = self.ddp.group
        self.optimizer = make_optimizer(self.model, settings, masters)
        self.activation_bytes = 0

    def step(self, step: int):
        """One optimizer step on the global batch; returns (loss, accuracy), same on every rank."""
        x, y = self.task.get_batch(step, self.batch_size)  # the global batch: its count is the mean's
        counted = max(int((y != IGNORE_INDEX).sum()), 1)
        rows, positions = shard_rows(self.batch_size, self.dp_rank, self.dp), self.cp_model.positions
        x, y = x[rows][:, positions], y[rows][:, positions]  # my replica's sequences, my tokens of them
        mine = y != IGNORE_INDEX
        self.optimizer.zero_grad()
        with timeline.span("forward", "forward"), self.amp.autocast():  # fp32: nothing changes
            logits, loss = self.cp_model(x, y)
        share = loss * (int(mine.sum()) / counted)  # my tokens' part of the global mean
        if not self.activation_bytes:  # every step builds the same graph: measure it once
            self.activation_bytes = graph_bytes(share)
        # DDP averages over the cp x dp ranks; the gradient is the sum of the shares
        self.amp.scale(share * self.group.size).backward()
        self.ddp.finish_gradient_synchronization()
        # every rank holds the same averaged gradients; they agree on a skip all the same (chapter 10)
        self.amp.step(self.optimizer, step, agree=lambda found_inf: any_rank(found_inf, self.group))
        right = (np.asarray(logits.data, dtype=np.float32).argmax(-1) == y) & mine
        totals = np.array([share.item(), right.sum(), mine.sum()], dtype=np.float64)
        all_reduce(totals, group=self.group)
        return float(totals[0]), float(totals[1] / totals[2])

    def memory(self) -> dict:
        """This rank's ledger: the whole model, its gradients and AdamW moments (replicated), and
        the activations of its T/N tokens."""
        return memory.ledger(self.model, self.optimizer, self.activation_bytes)

    def num_parameters(self) -> int:
        return self.model.num_parameters()

    def state_dict(self) -> dict | None:
        """The serial model's state dict on rank 0 (every rank holds the same; no messages)."""
        return self.model.state_dict() if self.group.rank == 0 else None

    def global_state(self) -> dict:
        """This rank's whole training state (every rank holds a full copy: the checkpoint keeps
        one, rank 0's)."""
        return training_state(self.model, self.optimizer, self.scaler)

    def load_global_state(self, read) -> None:
        load_training_state(self.model, self.optimizer, read, self.scaler)

    def report(self) -> dict:
        """The demo's `context_parallel` JSON: the layout, every rank's visible score entries per
        sequence and head (the balance), the bytes a rank sends per step in its cp group, and what
        this rank's attention computed so far."""
        s, itemsize = self.split, np.dtype(get_default_dtype()).itemsize
        traffic = context_parallel_traffic_per_step(self.config, self.batch_size // self.dp, self.cp, self.algorithm,
                                                    itemsize)
        return {**self.amp.report(), "context_parallel": {
            "cp": self.cp, "dp": self.dp, "algorithm": self.algorithm, "split": s.kind,
            "positions": self.cp_model.positions.tolist(),
            "unmasked_scores_per_rank": [s.unmasked_scores(r) for r in range(self.cp)],
            "cp_bytes_per_step": traffic, "attention": vars(self.cp_model.stats).copy()}}
