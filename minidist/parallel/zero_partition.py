"""The ZeRO partitioner: flat units cut into N chunks, and AdamW on a chunk (chapter 8).

What all three stages of `zero.py` stand on (and the mesh's ZeRO-1, `composed.py`):

- `FlatUnit`: a group of parameters laid side by side in one flat buffer, padded to a multiple
  of N, so rank r owns the contiguous chunk r (`lo:hi`) — exactly the chunk that the ring
  `reduce_scatter` hands rank r and that `all_gather` collects from it. A model is a few units:
  the "root" (embeddings, final LayerNorm, the tied head) and one per transformer block.
- `ShardedAdamW`: the serial AdamW update (`optim.adamw_update`, shared code) applied to the
  owned chunk only, with weight decay decided per element by which parameter it belongs to.
- `LiveBytes`: the bytes of short-lived buffers, for the memory ledger's peak.
- `chunk_state`, `load_chunk_state`: the chunks as pieces of the serial model's arrays, and back
  (checkpoints, minidist/training/reshard.py): a flat range of each parameter a chunk cuts through.
"""
from __future__ import annotations

import math

import numpy as np

from minidist.comm import all_reduce, any_rank
from minidist.core.optim import adamw_update
from minidist.training.reshard import Piece, box_of, checked, cut, global_shape, whole

BETAS, EPS = (0.9, 0.95), 1e-8  # as train.make_optimizer builds the serial AdamW


# ----------------------------------------------------------------------------- the partitioner


class FlatUnit:
    """Parameters flattened side by side, padded to a multiple of N; rank r owns chunk r.

        names    ['h.0.ln_1.weight', 'h.0.ln_1.bias', ...]   offsets[i]:offsets[i+1] in the unit
        numel    elements of the real parameters; padded = numel rounded up to a multiple of N
        lo, hi   this rank's chunk: padded // N elements (the padding's zeros live in the last)
    """

    def __init__(self, name: str, named_params: list, world_size: int, rank: int):
        self.name = name
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [p.shape for p in self.params]
        self.dtype = self.params[0].dtype
        self.offsets = np.concatenate([[0], np.cumsum([p.size for p in self.params])]).astype(int)
        self.numel = int(self.offsets[-1])
        self.padded = -(-self.numel // world_size) * world_size
        self.chunk = self.padded // world_size
        self.lo, self.hi = rank * self.chunk, (rank + 1) * self.chunk

    def flatten(self, arrays, dtype=None) -> np.ndarray:
        """One padded flat buffer holding `arrays` (one per parameter; None counts as zeros), in
        the unit's dtype or `dtype` (the fp32 masters of 16-bit weights, chapter 10)."""
        flat = np.zeros(self.padded, dtype=dtype or self.dtype)
        for i, a in enumerate(arrays):
            if a is not None:
                flat[self.offsets[i]:self.offsets[i + 1]] = a.ravel()
        return flat

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Each parameter's slot in a padded flat buffer, shaped like the parameter (no copy)."""
        return [flat[self.offsets[i]:self.offsets[i + 1]].reshape(s) for i, s in enumerate(self.shapes)]

    def decay_segments(self) -> list[tuple[int, int, bool]]:
        """(start, stop, decay) runs of my chunk, relative to it. AdamW decays matrices only
        (`optim.weight_decay_groups`: ndim >= 2), so a chunk that cuts through a bias and a weight
        needs both rules; the padding (no parameter) gets no decay and stays zero."""
        segments = []
        for i, shape in enumerate(self.shapes + [()]):  # a last pseudo-parameter: the padding
            start = self.offsets[i] if i < len(self.shapes) else self.numel
            stop = self.offsets[i + 1] if i < len(self.shapes) else self.padded
            a, b = max(int(start), self.lo), min(int(stop), self.hi)
            if a < b:
                decay = len(shape) >= 2
                if segments and segments[-1][2] == decay and segments[-1][1] == a - self.lo:
                    segments[-1] = (segments[-1][0], b - self.lo, decay)  # merge equal neighbours
                else:
                    segments.append((a - self.lo, b - self.lo, decay))
        return segments


def make_units(model, world_size: int, rank: int, select=None, suffix: str = "") -> list[FlatUnit]:
    """The root unit (every parameter outside the blocks: embeddings, ln_f, an untied head),
    then one unit per transformer block `h.i` — FSDP's usual wrapping of a transformer. `model`
    may be a pipeline stage (chapter 9): its blocks keep their serial names, a middle stage has
    no root. `select(p)`: only those parameters (the experts apart, chapter 11), the units'
    names ending in `suffix`."""
    named = [(n, p) for n, p in model.named_parameters() if select is None or select(p)]
    root = [(n, p) for n, p in named if not n.startswith("h.")]
    blocks = sorted({int(n.split(".")[1]) for n, _ in named if n.startswith("h.")})
    pieces = [("root", root)] + [(f"h.{i}", [(n, p) for n, p in named if n.startswith(f"h.{i}.")]) for i in blocks]
    return [FlatUnit(name + suffix, params, world_size, rank) for name, params in pieces if params]


def flat_parameters(units: list[FlatUnit]) -> list[np.ndarray]:
    """One flat buffer per unit holding its weights, the parameters made views into it: an
    all-gather into the buffer then refreshes every weight at once (stage 1's, the mesh's)."""
    buffers = [u.flatten([p.data for p in u.params]) for u in units]
    for unit, flat in zip(units, buffers):
        for p, view in zip(unit.params, unit.views(flat)):
            p.data = view
    return buffers


def master_chunks(units: list[FlatUnit], masters: dict | None) -> list[np.ndarray] | None:
    """This rank's chunk of the fp32 master weights of 16-bit parameters (chapter 10), or None."""
    if masters is None:
        return None
    return [u.flatten([masters[id(p)] for p in u.params], dtype=np.float32)[u.lo:u.hi].copy() for u in units]


class LiveBytes:
    """Bytes of short-lived buffers alive right now, and the most ever alive at once (the peak)."""

    def __init__(self):
        self.now = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += int(nbytes)
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= int(nbytes)


# ----------------------------------------------------------------------------- the optimizer


class ShardedAdamW:
    """AdamW on this rank's chunks only: 2 x Ψ/N moments instead of 2 x Ψ (stage 1's saving).

    `params[u]` and `grads[u]` are unit u's owned chunks (views or arrays, updated in place).
    Bias correction uses the global step; weight decay follows each element's parameter.
    With `masters` (fp32 copies of 16-bit chunks, chapter 10) AdamW updates the masters, from
    fp32 gradients handed to `step`, and writes them, rounded, into `params`: with the moments,
    12 bytes per owned element.
    """

    def __init__(self, units: list[FlatUnit], params: list, grads: list, weight_decay: float,
                 masters: list | None = None, betas=BETAS, eps: float = EPS):
        self.units, self.params, self.grads, self.masters = units, params, grads, masters
        self.weight_decay, self.betas, self.eps = weight_decay, tuple(betas), eps
        self.segments = [u.decay_segments() for u in units]
        updated = masters if masters is not None else params
        self.exp_avg = [np.zeros_like(p) for p in updated]
        self.exp_avg_sq = [np.zeros_like(p) for p in updated]
        self.step_count = 0

    def grad_norm(self, groups: list, weights: list | None = None, grads: list | None = None) -> float:
        """The whole model's gradient norm from the chunks: each rank sums its squares (the padding
        adds zeros), an all-reduce over each of `groups` adds the partial sums: [the group of the
        chunks], or in a mesh [dp, tp, pp]. `weights[u]`: 1 where an element
        counts on this rank, 0 where another rank counts it (a replicated parameter, once)."""
        grads = self.grads if grads is None else grads
        weights = weights or [None] * len(grads)
        squares = np.array([sum(float(np.dot(g, g)) if w is None else float(np.dot(g * w, g))
                                for g, w in zip(grads, weights))])
        for group in groups:
            all_reduce(squares, op="sum", group=group)
        return math.sqrt(float(squares[0]))

    def clip_to(self, max_norm: float, total_norm: float, grads: list | None = None) -> None:
        """Scale the chunks as optim.clip_grad_norm_ scales whole gradients."""
        scale = max_norm / (total_norm + 1e-6)
        if scale < 1.0:
            for g in self.grads if grads is None else grads:
                g *= scale

    def clip_grad_norm_(self, max_norm: float, groups: list, weights: list | None = None) -> float:
        """Clip the chunks by the whole model's norm (`grad_norm`); returns the norm."""
        total = self.grad_norm(groups, weights)
        self.clip_to(max_norm, total)
        return total

    def step(self, lr: float, grads: list | None = None) -> None:
        """AdamW on the owned chunks (`grads`: fp32 gradients, with masters; default the chunks')."""
        self.step_count += 1
        grads = self.grads if grads is None else grads
        updated = self.masters if self.masters is not None else self.params
        for u in range(len(self.units)):
            p, g, m, v = updated[u], grads[u], self.exp_avg[u], self.exp_avg_sq[u]
            for a, b, decay in self.segments[u]:
                adamw_update(p[a:b], g[a:b], m[a:b], v[a:b], self.step_count, lr, self.betas, self.eps,
                             self.weight_decay if decay else 0.0)
            if self.masters is not None:
                self.params[u][...] = p  # the master, rounded to the 16-bit chunk

    def nbytes(self) -> int:
        return self.master_nbytes() + sum(m.nbytes + v.nbytes for m, v in zip(self.exp_avg, self.exp_avg_sq))

    def master_nbytes(self) -> int:
        return sum(m.nbytes for m in self.masters) if self.masters is not None else 0


def mixed_precision_step(optimizer: ShardedAdamW, scaler, settings, step: int, everyone, norm_groups: list,
                         norm_weights: list | None = None) -> bool:
    """Chapter 10 on chunks (every ZeRO trainer's): fp32 copies of this rank's gradient chunks,
    unscaled; all ranks in `everyone` agree on an overflow (each saw only its chunks); clip by the
    whole model's norm (`norm_groups`, `norm_weights` as in `grad_norm`); AdamW on the fp32
    masters, rounded into the 16-bit chunks. Returns True if the step was skipped."""
    grads = [g.astype(np.float32) for g in optimizer.grads]
    found_inf = any_rank(scaler.unscale_(grads), everyone)
    skipped = scaler.should_skip(found_inf)
    if not skipped:
        if settings.clip:
            optimizer.clip_to(settings.clip, optimizer.grad_norm(norm_groups, norm_weights, grads), grads)
        optimizer.step(settings.lr_at(step), grads)
    scaler.update(found_inf)
    scaler.record(step, skipped)
    return skipped


# ----------------------------------------------------------------------------- checkpoints


def chunk_state(units: list[FlatUnit], optimizer: ShardedAdamW, tp_rank: int = 0, copies=()) -> dict[str, Piece]:
    """This rank's chunks as pieces of the serial run's arrays (minidist/training/reshard.py): for each
    parameter its chunk cuts through, the flat range it holds of its weights, moments and masters
    (of its tensor-parallel box at `tp_rank`, chapter 9), and the step. No messages. `copies`:
    parameters whose pieces another rank writes (a pipeline's second tied embedding)."""
    kinds = [("param", optimizer.params), ("exp_avg", optimizer.exp_avg), ("exp_avg_sq", optimizer.exp_avg_sq)]
    kinds += [("master", optimizer.masters)] if optimizer.masters is not None else []
    state = {"step": whole(np.array(optimizer.step_count))}
    for u, unit in enumerate(units):
        for i, (name, p, shape) in enumerate(zip(unit.names, unit.params, unit.shapes)):
            start, stop = max(int(unit.offsets[i]), unit.lo), min(int(unit.offsets[i + 1]), unit.hi)
            if start >= stop or any(p is copy for copy in copies):
                continue  # my chunk does not reach this parameter
            box, flat = box_of(p, shape, tp_rank), (start - int(unit.offsets[i]), stop - int(unit.offsets[i]))
            for kind, arrays in kinds:
                mine = arrays[u][start - unit.lo:stop - unit.lo]
                state[f"{kind}.{name}"] = Piece(mine, global_shape(p, shape), box, flat)
    return state


def load_chunk_state(units: list[FlatUnit], optimizer: ShardedAdamW, param_buffers: list, read,
                     tp_rank: int = 0) -> None:
    """Put `chunk_state` back from `read(name)`, the whole global arrays: each unit is laid out
    flat as at initialisation and this rank keeps its chunk; `param_buffers` that hold the full
    unit (stages 1 and 2) take all of it, so no all-gather is needed. No messages."""
    for u, unit in enumerate(units):
        def flat(kind: str, dtype) -> np.ndarray:
            pieces = [checked(cut(read(f"{kind}.{name}"), box_of(p, shape, tp_rank)), np.empty(shape, dtype),
                              f"{kind}.{name}") for name, p, shape in zip(unit.names, unit.params, unit.shapes)]
            return unit.flatten(pieces, dtype)

        weights = flat("param", param_buffers[u].dtype)
        param_buffers[u][...] = weights if param_buffers[u].size == unit.padded else weights[unit.lo:unit.hi]
        optimizer.exp_avg[u][...] = flat("exp_avg", optimizer.exp_avg[u].dtype)[unit.lo:unit.hi]
        optimizer.exp_avg_sq[u][...] = flat("exp_avg_sq", optimizer.exp_avg_sq[u].dtype)[unit.lo:unit.hi]
        if optimizer.masters is not None:
            optimizer.masters[u][...] = flat("master", optimizer.masters[u].dtype)[unit.lo:unit.hi]
    optimizer.step_count = int(read("step"))
