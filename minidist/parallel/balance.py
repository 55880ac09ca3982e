"""Stragglers: the slowest rank sets the pace of synchronous data parallelism.

Chapter 3, section 7. Every rank waits for every other at the gradient all-reduce, so a step
takes as long as its slowest rank. With an even split of the global batch that is whichever
core happens to be slow right now: on a shared machine the cores take turns being slower, and
on a cluster one machine may simply be slower than the rest, step after step.

The cure is to split the global batch *unevenly*, by speed. The update stays the serial one,
whatever the split: the loss is a mean over all B rows, so if rank r holds n_r rows and `loss_r`
is the mean over them,

    loss = sum_r (n_r / B) loss_r        and so    grad = sum_r (n_r / B) grad_r.

Each rank scales its loss by n_r * N / B before backward, and the usual averaging all-reduce
(sum / N) then gives exactly that weighted sum. An even split makes every factor 1.

`RowBalancer` chooses the split. Each rank measures two things per step: the seconds its
forward and backward took (which grow with its rows) and the seconds of the rest of its busy
step (the optimizer: the same work on every rank, but a slow core is slow at it too). The
numbers travel in the all-reduce that already closes every step, so every rank gets the same
numbers, computes the same split for the next step, and no extra message is sent.

It pays against a rank that stays slow (`python -m minidist.bench dp --slow 1:3` measures it);
against cores that take turns it can lose a little, since the last steps' timings cannot predict
the next. So balancing is a choice (`BalancedDataParallelTrainer`, the demo's `--balance`), not
the default.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np

from minidist.core.fused import dropout_rows
from minidist.parallel.data_parallel import DataParallelTrainer
from minidist.training.reshard import whole
from minidist.training.train import generators


def even_split(batch_size: int, world_size: int) -> list[int]:
    return [batch_size // world_size] * world_size


def balanced_split(batch_size: int, per_row: list[float], fixed: list[float], min_rows: int = 1) -> list[int]:
    """Rows per rank that make the slowest rank as fast as it can be.

    Rank r is modelled as taking `fixed[r] + rows * per_row[r]` seconds. Every rank first gets
    `min_rows`; each remaining row then goes, one at a time, to the rank that would finish it
    soonest. For a maximum of increasing linear costs this greedy choice is optimal, and it is
    deterministic (ties go to the lowest rank), so every rank computes the same split.
    """
    n = len(per_row)
    if batch_size < n * min_rows:
        raise ValueError(f"global batch {batch_size} cannot give each of {n} ranks {min_rows} rows")
    rows = [min_rows] * n
    for _ in range(batch_size - n * min_rows):
        finish = [fixed[r] + (rows[r] + 1) * per_row[r] for r in range(n)]
        rows[int(np.argmin(finish))] += 1
    return rows


class RowBalancer:
    """Keeps each rank's speed (smoothed over steps) and proposes the next step's split.

        balancer = RowBalancer(batch_size=16, world_size=2)
        balancer.rows                              # [8, 8] to start with
        balancer.update(compute_s, fixed_s)        # every rank's seconds of the last step
        balancer.rows                              # e.g. [9, 7] when rank 1 was the slow one

    `smoothing` weighs the newest measurement: a core's slowness lasts several steps here, but
    a single step's time is noisy. `margin`: the split changes only when the model predicts the
    slowest rank at least that much faster, so that noise does not move rows back and forth
    (chapter 3, section 7: a smaller margin chases jitter).
    """

    def __init__(self, batch_size: int, world_size: int, min_rows: int = 1, smoothing: float = 0.5,
                 margin: float = 0.10):
        self.batch_size, self.world_size, self.min_rows = batch_size, world_size, min_rows
        self.smoothing, self.margin = smoothing, margin
        self.rows = even_split(batch_size, world_size)
        self.per_row: np.ndarray | None = None
        self.fixed: np.ndarray | None = None

    def update(self, compute_seconds, fixed_seconds) -> list[int]:
        per_row = np.asarray(compute_seconds, dtype=np.float64) / np.asarray(self.rows)
        fixed = np.asarray(fixed_seconds, dtype=np.float64)
        if self.per_row is None:
            self.per_row, self.fixed = per_row, fixed
        else:
            a = self.smoothing
            self.per_row = a * per_row + (1 - a) * self.per_row
            self.fixed = a * fixed + (1 - a) * self.fixed
        proposal = balanced_split(self.batch_size, list(self.per_row), list(self.fixed), self.min_rows)
        if self.predicted(proposal) < (1 - self.margin) * self.predicted(self.rows):
            self.rows = proposal
        return self.rows

    def predicted(self, rows) -> float:
        """Seconds of the slowest rank with these rows, by the model."""
        return float(np.max(self.fixed + np.asarray(rows) * self.per_row))


class BalancedDataParallelTrainer(DataParallelTrainer):
    """`DataParallelTrainer` whose split of the batch follows each rank's measured speed.

        trainer = BalancedDataParallelTrainer(config, settings, task, batch_size=16)
        trainer.step(0)      # rows [8, 8]: nothing measured yet
        trainer.rows         # e.g. [10, 6] for the next step, when rank 1 was the slow one

    Same arguments as `DataParallelTrainer` (`rows` sets the first step's split); the step is
    the plain one, with its two phases timed and the seconds added to its closing all-reduce.
    `report()` gives the split of every step (the demo's `rows_per_rank`).
    """

    def __init__(self, config, settings, task, batch_size: int, **kwargs):
        super().__init__(config, settings, task, batch_size, **kwargs)
        self.balancer = RowBalancer(batch_size, self.world.size, min_rows=self.accumulation)
        self.balancer.rows = list(self.rows)
        self.compute_seconds = self.fixed_seconds = 0.0  # this rank's, in the last step
        self.splits: list[list[int]] = []  # the rows per rank of every step, for report()

    def step(self, step: int):
        self.splits.append(list(self.rows))
        return super().step(step)

    def report(self) -> dict:
        return {**super().report(), "rows_per_rank": self.splits}  # the demo's --json key

    def global_state(self) -> dict:
        """The replica's state, and the balancer's — the next split and the smoothed speeds — as
        this rank's own (local) arrays: they belong to this layout, and come back only on it."""
        unmeasured = np.full(self.world.size, np.nan)  # before the first step
        balancer = {"balancer.rows": np.array(self.rows),
                    "balancer.per_row": unmeasured if self.balancer.per_row is None else self.balancer.per_row,
                    "balancer.fixed": unmeasured if self.balancer.fixed is None else self.balancer.fixed}
        return {**super().global_state(), **{k: whole(v, local=True) for k, v in balancer.items()}}

    def load_global_state(self, read) -> None:
        rows, per_row, fixed = (read.local(f"balancer.{k}") for k in ("rows", "per_row", "fixed"))
        if rows is not None:  # saved by this layout (another starts from the even split)
            if rows.shape != (self.world.size,) or rows.sum() != self.batch_size:
                raise ValueError(f"checkpoint array balancer.rows: {rows.tolist()} is no split of {self.batch_size} "
                                 f"rows over {self.world.size} ranks")
            for name, speeds in (("per_row", per_row), ("fixed", fixed)):
                if speeds is None or speeds.shape != (self.world.size,):
                    raise ValueError(f"checkpoint array balancer.{name}: shape {np.shape(speeds)}, this job needs "
                                     f"({self.world.size},)")
        super().load_global_state(read)
        if rows is not None:
            self.rows = self.balancer.rows = [int(r) for r in rows]
            measured = not np.isnan(per_row).any()
            self.balancer.per_row, self.balancer.fixed = (per_row.copy(), fixed.copy()) if measured else (None, None)

    @contextlib.contextmanager
    def masks(self, first: int):
        """Dropout masks that follow the rows, not the split: every micro-batch draws the whole
        batch's masks from where the step's generators started, and keeps its own rows
        (`dropout_rows`). A row's mask is then the serial run's, whichever rank and micro-batch
        the timing put it in, so a balanced run with dropout is deterministic and equals
        serial to rounding (the sums' order follows the split)."""
        for generator, state in self.step_generators:
            generator.bit_generator.state = state
        with dropout_rows(first, self.batch_size):
            yield

    def forward_backward(self, x, y) -> tuple[float, float]:
        # each micro-batch starts its draws from here; the last one leaves them one batch on, as serial's
        self.step_generators = [(g, g.bit_generator.state) for _, g in generators(self.model)]
        started, self.ddp.hook_seconds = time.perf_counter(), 0.0  # the bucketed wrapper's hooks add to it
        means = super().forward_backward(x, y)
        # all-reduce work done in backward's hooks is communication, not this rank's speed (section 7)
        self.compute_seconds = time.perf_counter() - started - self.ddp.hook_seconds
        return means

    def optimizer_step(self, step: int) -> None:
        started = time.perf_counter()
        super().optimizer_step(step)
        self.fixed_seconds = time.perf_counter() - started

    def sum_over_ranks(self, values: list[float]) -> np.ndarray:
        """The plain sum, with every rank's seconds riding along: rank r fills slots r, the sum
        gathers them. Every rank gets the same numbers, so every rank picks the same split."""
        n, dp, rank = len(values), self.world.size, self.world.rank
        seconds = np.zeros(2 * dp)
        seconds[rank], seconds[dp + rank] = self.compute_seconds, self.fixed_seconds
        totals = super().sum_over_ranks([*values, *seconds])
        self.rows = self.balancer.update(totals[n:n + dp], totals[n + dp:])
        return totals[:n]
