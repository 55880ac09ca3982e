"""Datasets and samplers: where a training batch comes from, and which rows each rank gets.

Chapters 1 and 3. The one idea: **a batch is a pure function of (seed, step)**. Every rank can
compute the same global batch on its own, without any message, and take its contiguous slice of
rows. Concatenating the slices of all ranks gives back exactly the batch a single process would
use, which is what lets data parallelism reproduce the serial run (the book's first principle).

    task = make_task("sort", block_size=64, seed=0)            # built-in synthetic task
    task = make_task("input.txt", block_size=64, seed=0)       # any file, byte by byte
    x, y = task.get_batch(step, 16)                            # the serial batch
    x, y = task.get_batch(step, 16, rank=1, world_size=4)      # rows 4..7 of that same batch

Two sources, both byte-level (vocab 256, no tokenizer to download or explain):

- `SortTask`: "3142=1234". The model reads a few random digits and an "=", and must write them
  in sorted order. Loss is taken only on the answer (every other target is `IGNORE_INDEX`), so
  `accuracy` is a number a learner can watch climb from chance (~10%) to ~100% in a few hundred
  steps of the demo GPT.
- `TextData`: random windows of `block_size + 1` bytes of a file; y is x shifted by one.

Generating the whole global batch on every rank costs a little redundant work (microseconds
here), and buys the simplest possible proof that the slices agree with the serial run.
"""
from __future__ import annotations

import os

import numpy as np

VOCAB_SIZE = 256  # bytes
IGNORE_INDEX = -100  # targets with this value add nothing to the loss (as in PyTorch)


# ----------------------------------------------------------------------------- helpers


def encode(text: str) -> np.ndarray:
    """A string as its UTF-8 bytes, as int64 token ids."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def decode(ids) -> str:
    """Token ids (bytes) back to text; bytes that are not valid UTF-8 show as '\ufffd'."""
    ids = np.asarray(getattr(ids, "data", ids)).reshape(-1)
    return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")


def _rng(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    # SeedSequence mixes the tuple into independent streams: (seed, step) fully decides a batch.
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return np.random.default_rng([seed, step, stream])


def shard_rows(batch_size: int, rank: int, world_size: int, counts: list[int] | None = None) -> slice:
    """The contiguous rows of a global batch of B rows that a rank owns.

    By default [rank*B/W, (rank+1)*B/W): every rank the same number of rows. `counts` (rows per
    rank, summing to B) gives an uneven split instead, as a straggler-balancing trainer uses
    (chapter 3, section 7): rank r owns rows [sum(counts[:r]), sum(counts[:r+1]))."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")
    if counts is not None:
        if len(counts) != world_size or sum(counts) != batch_size or min(counts) < 1:
            raise ValueError(f"rows per rank {list(counts)} must be {world_size} positive counts summing to "
                             f"the global batch {batch_size}")
        start = sum(counts[:rank])
        return slice(start, start + counts[rank])
    if batch_size < 1 or batch_size % world_size:
        raise ValueError(f"global batch {batch_size} is not divisible by world size {world_size}: "
                         f"each rank must get the same number of rows (try {max(world_size, batch_size - batch_size % world_size)})")
    per_rank = batch_size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _logits_array(logits) -> np.ndarray:
    return np.asarray(getattr(logits, "data", logits))


def accuracy(logits, targets, ignore_index: int = IGNORE_INDEX) -> float:
    """Fraction of counted targets (those != ignore_index) where argmax(logits) is the target."""
    predictions = _logits_array(logits).argmax(axis=-1)
    targets = np.asarray(targets)
    counted = targets != ignore_index
    if predictions.shape != targets.shape:
        raise ValueError(f"accuracy: logits {_logits_array(logits).shape} do not match targets {targets.shape}")
    if not counted.any():
        return float("nan")
    return float((predictions == targets)[counted].mean())


def exact_match(logits, targets, ignore_index: int = IGNORE_INDEX) -> float:
    """Fraction of rows whose counted targets are *all* predicted correctly (a whole answer right).

    Under teacher forcing: each position sees the true previous tokens, as in training.
    """
    predictions = _logits_array(logits).argmax(axis=-1)
    targets = np.asarray(targets)
    counted = targets != ignore_index
    wrong = (predictions != targets) & counted
    rows = counted.reshape(len(targets), -1).any(axis=1)  # rows that have an answer at all
    if not rows.any():
        return float("nan")
    return float((~wrong.reshape(len(targets), -1).any(axis=1))[rows].mean())


# ----------------------------------------------------------------------------- the sorting task


class SortTask:
    """Sort `length` random digits: the row "3142=1234" with the loss on "1234" only.

    Each row is left-aligned and padded with spaces to block_size + 1 bytes; x is the first
    block_size bytes and y the next-byte targets, with every target outside the answer set to
    IGNORE_INDEX. The input has `length` digits drawn from the first `num_digits` of "0123456789".
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, block_size: int, seed: int = 0, length: int = 8, num_digits: int = 10):
        if not 1 <= num_digits <= 10:
            raise ValueError(f"num_digits must be in 1..10, got {num_digits}")
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        needed = 2 * length + 1  # digits, "=", answer; x and y are that row minus one byte
        if block_size + 1 < needed:
            raise ValueError(f"sort task with {length} digits needs rows of {needed} bytes, so "
                             f"block_size >= {needed - 1}; got block_size {block_size}")
        self.block_size, self.seed = block_size, seed
        self.length, self.num_digits = length, num_digits
        self.answer_length = length  # tokens to generate for a sample

    def _problems(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(0, self.num_digits, size=(n, self.length))

    def _rows(self, digits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n, L = digits.shape
        rows = np.full((n, self.block_size + 1), ord(" "), dtype=np.int64)
        rows[:, :L] = ord("0") + digits
        rows[:, L] = ord("=")
        rows[:, L + 1:2 * L + 1] = ord("0") + np.sort(digits, axis=1)
        x, y = rows[:, :-1].copy(), rows[:, 1:].copy()
        # y[:, t] is the byte after x[:, t]: the answer bytes sit at y[:, L : 2L] (after "=" at x[:, L])
        mask = np.full(y.shape, True)
        mask[:, L:2 * L] = False
        y[mask] = IGNORE_INDEX
        return x, y

    def get_batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1, counts=None):
        """(x, y), int64 arrays of shape (batch_size // world_size, block_size): this rank's rows
        (`counts`: rows per rank, for an uneven split; see `shard_rows`)."""
        rows = shard_rows(batch_size, rank, world_size, counts)
        digits = self._problems(_rng(self.seed, step), batch_size)  # the whole global batch...
        return self._rows(digits[rows])                             # ...and this rank's slice

    def sample_prompt(self, seed: int = 0) -> tuple[np.ndarray, str]:
        """A fresh problem: the prompt ids ("3142=") and the answer the model should write ("1234")."""
        digits = self._problems(_rng(self.seed, seed, stream=1), 1)[0]
        prompt = "".join(map(str, digits)) + "="
        return encode(prompt), "".join(map(str, np.sort(digits)))

    def format_sample(self, prompt_ids, generated_ids, expected: str) -> str:
        """'3142 -> 1234 (expected 1234)' for a prompt and the ids the model generated after it."""
        return f"{decode(prompt_ids).rstrip('=')} -> {decode(generated_ids)} (expected {expected})"

    def __repr__(self):
        return f"SortTask(length={self.length}, num_digits={self.num_digits}, block_size={self.block_size}, seed={self.seed})"


# ----------------------------------------------------------------------------- text from a file


class TextData:
    """Byte-level language modelling on any file: random windows of block_size + 1 bytes."""

    vocab_size = VOCAB_SIZE

    def __init__(self, path: str, block_size: int, seed: int = 0, sample_length: int = 64):
        with open(path, "rb") as f:
            self.data = np.frombuffer(f.read(), dtype=np.uint8)
        if len(self.data) < block_size + 1:
            shorter = f" or a block_size <= {len(self.data) - 1}" if len(self.data) >= 2 else ""
            raise ValueError(f"{path} has {len(self.data)} bytes, fewer than block_size + 1 = "
                             f"{block_size + 1} that one training window needs; use a longer file{shorter}")
        self.path, self.block_size, self.seed = path, block_size, seed
        self.answer_length = sample_length

    def get_batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1, counts=None):
        """(x, y), int64 arrays of shape (batch_size // world_size, block_size): this rank's rows
        (`counts`: rows per rank, for an uneven split; see `shard_rows`)."""
        rows = shard_rows(batch_size, rank, world_size, counts)
        starts = _rng(self.seed, step).integers(0, len(self.data) - self.block_size, size=batch_size)[rows]
        windows = self.data[starts[:, None] + np.arange(self.block_size + 1)].astype(np.int64)
        return windows[:, :-1], windows[:, 1:]

    def sample_prompt(self, seed: int = 0) -> tuple[np.ndarray, str]:
        """A random stretch of the file as the prompt, and the text that really follows it."""
        prompt_length = min(self.block_size // 2, len(self.data) - 1)
        start = int(_rng(self.seed, seed, stream=1).integers(0, len(self.data) - prompt_length))
        prompt = self.data[start:start + prompt_length].astype(np.int64)
        return prompt, decode(self.data[start + prompt_length:start + prompt_length + self.answer_length])

    def format_sample(self, prompt_ids, generated_ids, expected: str) -> str:
        return f"{decode(prompt_ids)!r} -> {decode(generated_ids)!r} (file has {expected!r})"

    def __repr__(self):
        return f"TextData({self.path!r}, {len(self.data)} bytes, block_size={self.block_size}, seed={self.seed})"


def make_task(name_or_path: str, block_size: int, seed: int = 0):
    """"sort" (or "sort:LENGTH" / "sort:LENGTH:NUM_DIGITS") for the synthetic task; otherwise a file path."""
    if name_or_path == "sort" or name_or_path.startswith("sort:"):
        numbers = name_or_path.split(":")[1:]
        try:
            kwargs = dict(zip(("length", "num_digits"), map(int, numbers)))
        except ValueError:
            raise ValueError(f"bad task {name_or_path!r}: expected 'sort', 'sort:LENGTH' or 'sort:LENGTH:NUM_DIGITS'") from None
        return SortTask(block_size, seed, **kwargs)
    if not os.path.isfile(name_or_path):
        raise FileNotFoundError(f"no task or file named {name_or_path!r} (built-in tasks: 'sort')")
    return TextData(name_or_path, block_size, seed)
