"""Resharding: a rank's arrays as pieces of the serial model's arrays, and back (chapters 2 and 8).

The one idea: whatever the layout, the training state is the serial run's. So a checkpoint names
every array by its *global* name (the serial model's), gives its *global* shape, and says which
piece of it each rank holds; and loading gives a rank whole global arrays, from which it cuts its
own piece exactly as it cut the serial model's initial weights (`model.init_weights`, then shard).
Any layout then resumes any other's checkpoint, as PyTorch's Distributed Checkpoint and
DeepSpeed's universal checkpoints do.

    param.h.0.attn.q_proj.weight   (32, 32)   the weights, by the serial model's names
    exp_avg.<name>, exp_avg_sq.<name>         AdamW's two moments (fp32 in 16-bit runs)
    master.<name>                             the fp32 master of a 16-bit weight (chapter 10)
    step                           ()         the optimizer's step count
    scaler.<key>                              the fp16 loss scaler's state (chapter 10)

Where a `Piece` sits in its global array, two descriptors cover every layout:

    box=None, flat=None                whole: serial, data parallelism, a pipeline stage's blocks
    box=((0, 16), (0, 32))             a tensor-parallel shard: rows 0-15 of a (32, 32) matrix
    flat=(0, 2048)                     a ZeRO chunk: elements 0-2047 of the array, flattened
    box=..., flat=...                  a ZeRO chunk of a tensor-parallel shard (chapter 9):
                                       elements of the box, flattened in C order

`local` pieces are not the serial run's: each rank's random generators belong to its layout (a
tensor-parallel rank draws other attention masks than the serial model). A checkpoint keeps them
per rank; they come back on the same layout (a dropout run resumes bit for bit), and on another
the new layout's generators keep their own seeds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Piece:
    """This rank's values of the global array `shape`, at `box` (then `flat`) in it."""

    array: np.ndarray
    shape: tuple
    box: tuple | None = None    # ((start, stop), ...) per dimension; None: all of it
    flat: tuple | None = None   # (start, stop) of the box's elements in C order; None: all of them
    local: bool = False         # this rank's own (a generator): not a piece of the serial state

    def where(self) -> dict:
        """The manifest's words for it: global shape and dtype, and box / flat where not whole."""
        out = {"shape": [int(n) for n in self.shape], "dtype": np.asarray(self.array).dtype.name}
        if self.box is not None:
            out["box"] = [[int(a), int(b)] for a, b in self.box]
        if self.flat is not None:
            out["flat"] = [int(a) for a in self.flat]
        return out


def whole(array, local: bool = False) -> Piece:
    """A piece that is the whole array."""
    array = np.asarray(array)
    return Piece(array, array.shape, local=local)


def box_of(p, shape, tp_rank: int) -> tuple | None:
    """Where the tensor-parallel shard `p` of local `shape` sits in its full parameter: tp rank r
    holds the r-th of equal blocks along `p.partition_dim` (chapter 6). None for a whole one."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    box = [(0, int(n)) for n in shape]
    n = int(shape[p.partition_dim])
    box[p.partition_dim] = (tp_rank * n, (tp_rank + 1) * n)
    return tuple(box)


def global_shape(p, shape) -> tuple:
    """The serial model's shape of parameter `p` (a tensor-parallel shard knows its full shape)."""
    return tuple(getattr(p, "full_shape", shape))


def extent(shape, box=None, flat=None) -> tuple:
    """The shape of the piece's own array: the box's sides, or with `flat` its range's length."""
    if flat is not None:
        return (int(flat[1]) - int(flat[0]),)
    return tuple(int(n) for n in shape) if box is None else tuple(int(b) - int(a) for a, b in box)


def _index(box) -> tuple:
    return tuple(slice(a, b) for a, b in box) if box is not None else (...,)


def cut(full: np.ndarray, box=None, flat=None) -> np.ndarray:
    """The piece of `full` at `box`, then `flat`: what a rank keeps of a global array."""
    piece = full[_index(box)]
    return piece if flat is None else piece.reshape(-1)[flat[0]:flat[1]]


def paste(full: np.ndarray, covered: np.ndarray, array: np.ndarray, box=None, flat=None) -> None:
    """Write `array` into `full` at `box`, then `flat`, marking the elements in `covered`.
    Raises ValueError if any was already written: pieces of one array never overlap."""
    region, seen = full[_index(box)], covered[_index(box)]
    if flat is None:
        values, marks = array.reshape(region.shape), np.ones(region.shape, dtype=bool)
        if (seen & marks).any():
            raise ValueError("overlaps another piece")
        region[...], seen[...] = values, True
        return
    values, marks = region.reshape(-1).copy(), seen.reshape(-1).copy()
    if marks[flat[0]:flat[1]].any():
        raise ValueError("overlaps another piece")
    values[flat[0]:flat[1]], marks[flat[0]:flat[1]] = array, True
    region[...], seen[...] = values.reshape(region.shape), marks.reshape(seen.shape)


def assemble(shape, dtype, pieces) -> np.ndarray:
    """The whole array from its pieces, [(array, box, flat)]: every element written exactly once
    (ValueError otherwise, saying how much is missing)."""
    full, covered = np.zeros(shape, dtype), np.zeros(shape, dtype=bool)
    for array, box, flat in pieces:
        paste(full, covered, array, box, flat)
    if not covered.all():
        raise ValueError(f"its pieces cover {int(covered.sum())} of its {covered.size} elements")
    return full


def checked(piece: np.ndarray, like: np.ndarray, name: str) -> np.ndarray:
    """`piece`, refused unless its shape and dtype are exactly those of `like` (what this rank
    holds): a cut array must never load by broadcasting, nor a float32 one into float64."""
    if piece.shape != np.shape(like) or piece.dtype != np.asarray(like).dtype:
        raise ValueError(f"checkpoint array {name}: this rank's piece is {piece.shape} {piece.dtype}, "
                         f"it holds {np.shape(like)} {np.asarray(like).dtype}")
    return piece


class InMemory:
    """A `read` over whole global arrays in memory (`checkpointing.snapshot` makes one): the same
    face as a checkpoint on disk, for tests and notebooks that resume without files."""

    def __init__(self, arrays: dict[str, np.ndarray], local: dict[str, np.ndarray]):
        self.arrays, self.own = arrays, local

    def __call__(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise ValueError(f"the saved state has no array {name}")
        return self.arrays[name]

    def local(self, name: str) -> np.ndarray | None:
        return self.own.get(name)
