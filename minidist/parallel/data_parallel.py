"""Data parallelism (数据并行): every rank holds the whole model and a slice of the batch.

Chapter 3. N replicas start from the same weights (broadcast from rank 0, then verified), each
runs forward and backward on its B/N rows of the global batch, and the gradients are averaged
with an all-reduce. Since the loss is a mean over the batch, the average of the N slice
gradients *is* the gradient of the whole batch, so every replica applies the serial update and
the replicas never drift apart.

Two versions of the gradient averaging, for comparison:

- naive (`overlap=False`): after backward, one blocking all-reduce per parameter. Many small
  messages, and the network idles while backward computes (and vice versa).
- bucketed (`overlap=True`, as PyTorch DDP does): parameters are grouped, in the reverse order
  backward produces their gradients, into flat buckets of about `bucket_cap_bytes`. A gradient
  hook (`Tensor.register_post_accumulate_grad_hook`) notices when a bucket's last gradient is
  complete and starts that bucket's non-blocking all-reduce at once, while backward carries on
  with earlier layers. `finish_gradient_synchronization()` waits for the stragglers before the
  optimizer step.

Gradient accumulation: inside `with ddp.no_sync():` hooks only accumulate locally; the last
micro-step, outside `no_sync`, communicates the accumulated sum once.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np

from minidist.data import accuracy
from minidist.comm import all_reduce, broadcast, collectives, unchecked
from minidist.comm.world import World, resolve
from minidist.model import GPT, GPTConfig
from minidist.parallel.balance import RowBalancer, even_split
from minidist.tensor import graph_bytes
from minidist.timeline import Timeline
from minidist.train import OptimSettings, clip_and_step, make_optimizer
from minidist import memory


class Bucket:
    """A flat buffer holding the gradients of a few parameters side by side."""

    def __init__(self, index: int, params: list, dtype):
        self.index = index
        self.params = params
        sizes = [p.size for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self.buffer = np.zeros(int(self.offsets[-1]), dtype=dtype)
        # parameter i's slot in the buffer, shaped like the parameter
        self.views = [self.buffer[a:b].reshape(p.shape) for p, a, b in zip(params, self.offsets, self.offsets[1:])]
        self.ready = 0
        self.work = None


def make_buckets(params: list, cap_bytes: int) -> list[Bucket]:
    """Group parameters, last first (backward's order), into buckets of about cap_bytes."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.data.nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.data.nbytes
    if current:
        buckets.append(current)
    return [Bucket(i, ps, ps[0].dtype) for i, ps in enumerate(buckets)]


class DistributedDataParallel:
    """Wrap a model so that its gradients are averaged over the data-parallel group.

        ddp = DistributedDataParallel(model, group)
        logits, loss = ddp(x_slice, y_slice)
        loss.backward()                       # buckets' all-reduces start during backward
        ddp.finish_gradient_synchronization() # now every p.grad is the global-batch gradient
        optimizer.step()
    """

    def __init__(self, module, group: World | None = None, bucket_cap_bytes: int = 1 << 20,
                 overlap: bool = True, algorithm: str = "auto", timeline=None):
        self.module = module
        self.world = resolve(group)
        self.overlap = overlap
        self.algorithm = algorithm
        self.timeline = timeline  # optional: records when each bucket's communication runs
        self.require_sync = True
        self.hook_seconds = 0.0  # time spent in the gradient hooks (launching, progressing all-reduces)
        self.params = module.parameters()
        self._broadcast_parameters()
        self.buckets = make_buckets(self.params, bucket_cap_bytes) if overlap else []  # naive: none
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._check_same_buckets()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        if overlap:  # backward writes each gradient straight into its bucket (PyTorch's
            for b in self.buckets:  # gradient_as_bucket_view): no copy before the all-reduce
                for p, view in zip(b.params, b.views):
                    p.grad_buffer = view

    # -- the model's face
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def parameters(self):
        return self.params

    def named_parameters(self):
        return self.module.named_parameters()

    def state_dict(self):
        return self.module.state_dict()

    def zero_grad(self):
        self.module.zero_grad()

    # -- the same start everywhere
    def _broadcast_parameters(self) -> None:
        """Rank 0's weights to every rank, then a check that every replica now agrees."""
        for p in self.params:
            broadcast(p.data, src=0, group=self.world)
        checksums = [float(np.sum(p.data, dtype=np.float64)) for p in self.params]
        if not self._same_everywhere(checksums):
            raise RuntimeError("data parallel: replicas hold different weights after the broadcast")

    def _check_same_buckets(self) -> None:
        sizes = [b.buffer.size for b in self.buckets]
        collectives.check_consistent(self.world, "ddp buckets", len(sizes), np.float64)
        if not self._same_everywhere(sizes):
            raise RuntimeError(f"data parallel: ranks built different gradient buckets (rank {self.world.rank}: {sizes})")

    def _same_everywhere(self, values) -> bool:
        lowest = np.array(values, dtype=np.float64)
        highest = lowest.copy()
        all_reduce(lowest, op="min", group=self.world)
        all_reduce(highest, op="max", group=self.world)
        return bool(np.array_equal(lowest, highest))

    # -- gradient accumulation
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-steps before the last one)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    # -- overlapped averaging, driven by gradient hooks
    def _grad_ready(self, p) -> None:
        if not (self.overlap and self.require_sync) or self.world.size == 1:
            return  # nothing to average with (or accumulating locally under no_sync)
        started = time.perf_counter()
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
        self._progress()
        # communication work done inside backward: whichever rank finishes backward last finds
        # its peers' halves waiting and adds them up here, so its backward looks slower than it is
        self.hook_seconds += time.perf_counter() - started

    def _launch(self, bucket: Bucket) -> None:
        for p, slot in zip(bucket.params, bucket.views):
            if p.grad is None:
                slot[...] = 0.0  # unused in this step: contributes nothing
            elif p.grad is not slot:  # e.g. after someone replaced .grad: copy it in
                slot[...] = p.grad
        bucket.started, bucket.finished = time.perf_counter(), None
        bucket.work = self._all_reduce(bucket.buffer, async_op=True)

    def _progress(self) -> None:
        """Let in-flight all-reduces take their next steps (MPI progresses only when asked)."""
        for b in self.buckets:
            if b.work is not None and not getattr(b, "finished", None) and b.work.test():
                b.finished = time.perf_counter()

    def _all_reduce(self, array, async_op=False):
        # every rank has the same buckets (checked once at start): skip the per-call check
        with unchecked():
            return all_reduce(array, op="avg", group=self.world, algorithm=self.algorithm, async_op=async_op)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket; afterwards each p.grad holds the average over all ranks."""
        if self.world.size == 1:
            return
        if not self.overlap:
            for p in self.params:  # naive: one blocking all-reduce per parameter
                if p.grad is None:
                    p.grad = np.zeros_like(p.data)
                start = time.perf_counter()
                self._all_reduce(p.grad)
                self._record("all_reduce", start)
            return
        for bucket in self.buckets:
            if bucket.work is None:  # some parameter got no gradient this step
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            self._record(f"bucket {bucket.index}", bucket.started, bucket.finished)
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view  # the averaged gradient, read in place
            bucket.work, bucket.ready = None, 0

    def _record(self, name: str, start, end=None) -> None:
        if self.timeline is not None:
            self.timeline.add(name, "comm", start, end or time.perf_counter())


class DataParallelTrainer:
    """The serial training step, data-parallel: each rank trains on its slice of the batch.

    With `accumulation` k > 1, a rank's slice is processed in k micro-batches; gradients are
    averaged over ranks once, after the last. global batch = micro-batch x k x dp.

    The slices are even by default. `rows` fixes an uneven split (rows per rank), and
    `balance=True` re-splits every step by each rank's measured speed, so that a slow core gets
    fewer rows (balance.py, chapter 3 section 7). Either way the update is the serial one.
    """

    name = "dp"

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, overlap: bool = True, bucket_cap_bytes: int = 1 << 20,
                 accumulation: int = 1, algorithm: str = "auto", balance: bool = False,
                 rows: list[int] | None = None):
        self.world = resolve(group)
        dp = self.world.size
        if rows is None and batch_size % (dp * accumulation):
            raise ValueError(f"global batch {batch_size} is not divisible by dp={dp} x accumulation "
                             f"steps={accumulation} = {dp * accumulation}")
        self.task, self.batch_size, self.accumulation = task, batch_size, accumulation
        self.balancer = RowBalancer(batch_size, dp, min_rows=accumulation) if balance else None
        self.rows = list(rows) if rows is not None else even_split(batch_size, dp)
        if len(self.rows) != dp or sum(self.rows) != batch_size or min(self.rows) < accumulation:
            raise ValueError(f"rows per rank {self.rows}: need {dp} counts of at least accumulation="
                             f"{accumulation} rows each, summing to the global batch {batch_size}")
        self.settings = settings
        self.timeline = Timeline()
        self.model = GPT(config, seed=seed)
        self.ddp = DistributedDataParallel(self.model, self.world, bucket_cap_bytes, overlap, algorithm,
                                           timeline=self.timeline)
        self.optimizer = make_optimizer(self.model, settings)
        self.activation_bytes = 0

    def step(self, step: int):
        """One optimizer step on the global batch; returns (global mean loss, accuracy)."""
        dp, rank, B = self.world.size, self.world.rank, self.batch_size
        x, y = self.task.get_batch(step, B, rank, dp, counts=self.rows)
        k = self.accumulation
        micro_x, micro_y = np.array_split(x, k), np.array_split(y, k)
        self.optimizer.zero_grad()
        loss_sum, acc_sum = 0.0, 0.0  # this rank's share of the global means
        started, self.ddp.hook_seconds = time.perf_counter(), 0.0
        for i in range(k):
            sync = contextlib.nullcontext() if i == k - 1 else self.ddp.no_sync()
            share = len(micro_x[i]) / B  # of the global batch: the loss is a mean over all B rows
            with sync:
                with self.timeline.span(f"forward {i}", "forward"):
                    logits, loss = self.ddp(micro_x[i], micro_y[i])
                if not self.activation_bytes:  # every step builds the same graph: measure it once
                    self.activation_bytes = graph_bytes(loss)
                with self.timeline.span(f"backward {i}", "backward"):
                    # the all-reduce averages (sums and divides by dp), so scale by share x dp:
                    # 1/k for an even split, as one big batch
                    (loss * (len(micro_x[i]) * dp / B)).backward()
            loss_sum += loss.item() * share
            acc_sum += accuracy(logits.data, micro_y[i]) * share
        computed = time.perf_counter() - started - self.ddp.hook_seconds  # forward + backward arithmetic
        self.ddp.finish_gradient_synchronization()
        started = time.perf_counter()
        with self.timeline.span("optimizer", "optimizer"):
            clip_and_step(self.optimizer, self.optimizer.params(), self.settings, step)
        stats = np.zeros(2 + (2 * dp if self.balancer else 0))
        stats[:2] = loss_sum, acc_sum
        if self.balancer:  # every rank's seconds ride along: rank r fills slots r, the sum gathers them
            stats[2 + rank], stats[2 + dp + rank] = computed, time.perf_counter() - started
        with unchecked():  # same length on every rank, every step (and the check would be a second wait)
            all_reduce(stats, op="sum", group=self.world)
        if self.balancer:  # every rank has the same numbers, so every rank picks the same split
            self.rows = self.balancer.update(stats[2:2 + dp], stats[2 + dp:])
        return float(stats[0]), float(stats[1])

    def memory(self) -> dict:
        ledger = memory.ledger(self.model, self.optimizer, self.activation_bytes)
        # bytes of DDP's buckets beyond the gradients: none. Backward writes every gradient
        # into its bucket (Tensor.grad_buffer), so `grads` already counts the buckets' bytes
        # (and the naive version has no buckets)
        ledger["buckets"] = 0
        return ledger

    def num_parameters(self) -> int:
        return self.model.num_parameters()

    def state_dict(self) -> dict:
        return self.model.state_dict()
