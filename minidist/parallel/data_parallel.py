"""Data parallelism (数据并行): every rank holds the whole model and a slice of the batch.

Chapter 3. N replicas start from the same weights (broadcast from rank 0, then verified), each
runs forward and backward on its B/N rows of the global batch, and the gradients are averaged
with an all-reduce. Since the loss is a mean over the batch, the average of the N slice
gradients *is* the gradient of the whole batch, so every replica applies the serial update and
the replicas never drift apart.

Two wrappers, one per way of averaging, read in this order:

- `NaiveDistributedDataParallel`: after backward, one blocking all-reduce per parameter. Many
  small messages, and the network idles while backward computes (and vice versa).
- `DistributedDataParallel` (bucketed and overlapped, as PyTorch's is): parameters are grouped,
  in the reverse order backward produces their gradients, into flat buckets of about
  `bucket_cap_bytes`. A gradient hook (`Tensor.register_post_accumulate_grad_hook`) notices when
  a bucket's last gradient is complete and starts that bucket's non-blocking all-reduce at once,
  while backward carries on with earlier layers. `finish_gradient_synchronization()` waits for
  the stragglers before the optimizer step.

Gradient accumulation: inside `with ddp.no_sync():` nothing is communicated; the last
micro-step, outside `no_sync`, communicates the accumulated sum once. `DataParallelTrainer` is
the serial training step on top of either wrapper; balance.py splits the batch by speed on top
of it (section 7).

The all-reduce is chapter 7's: on one machine `algorithm="auto"` (the default, None, means the
process's choice) goes through the shared-memory window (minidist/comm/shared_memory.py), and
`with all_reduce_algorithm("ring"):` runs the same training over chapter 7's ring of messages.
The bucketed wrapper's buckets themselves live in shared memory there (`registered_buckets`,
minidist/comm/registered.py), so that their all-reduce copies nothing in or out.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np

from minidist.plan import memory
from minidist.comm import all_reduce, any_rank, broadcast, registered
from minidist.comm.world import World, resolve
from minidist.core.data import accuracy
from minidist.precision.mixed_precision import Precision
from minidist.core.model import GPT, GPTConfig
from minidist.core.tensor import graph_bytes
from minidist.timeline import Timeline
from minidist.training.train import (OptimSettings, Trainer, load_training_state, make_optimizer, training_state)


class NaiveDistributedDataParallel:
    """Wrap a model so that its gradients are averaged over the data-parallel group, plainly.

        ddp = NaiveDistributedDataParallel(model, group)
        logits, loss = ddp(x_slice, y_slice)
        loss.backward()
        ddp.finish_gradient_synchronization() # one all-reduce per parameter: every p.grad is
        optimizer.step()                      # now the global-batch gradient
    """

    def __init__(self, module, group: World | None = None, algorithm: str | None = None, timeline=None):
        self.module = module
        self.params = module.parameters()
        self.algorithm = algorithm  # None: the process's default (`all_reduce_algorithm`, chapter 7)
        self.timeline = timeline  # optional: records when each all-reduce runs
        self.require_sync = True
        # every later collective follows from these facts: checked once here, not on every call (chapter 7)
        self.group = resolve(group).verify("the data-parallel gradients", self.facts())
        self._broadcast_parameters()

    def facts(self) -> list:
        """What every rank must agree on for its all-reduces to match: shapes, dtypes, algorithm."""
        return [self.algorithm] + [(p.shape, p.dtype.str) for p in self.params]

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
            broadcast(p.data, src=0, group=self.group)
        checksums = [float(np.sum(p.data, dtype=np.float64)) for p in self.params]
        self.group.verify("the replicas' weights after the broadcast", checksums)

    # -- gradient accumulation
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-steps before the last one): nothing is sent.
        The naive wrapper sends only in finish_gradient_synchronization, after the last one."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    # -- averaging after backward
    def finish_gradient_synchronization(self) -> None:
        """One blocking all-reduce per parameter; afterwards each p.grad holds the average."""
        if self.group.size == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = np.zeros_like(p.data)  # unused in this step: contributes nothing
            start = time.perf_counter()
            all_reduce(p.grad, op="avg", group=self.group, algorithm=self.algorithm)
            self._record("all_reduce", start)

    def _record(self, name: str, start, end=None) -> None:
        if self.timeline is not None:
            self.timeline.add(name, "comm", start, end or time.perf_counter())


class Bucket:
    """A flat buffer holding the gradients of a few parameters side by side."""

    def __init__(self, index: int, params: list, dtype, buffer: np.ndarray | None = None):
        self.index = index
        self.params = params
        sizes = [p.size for p in params]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        self.buffer = np.zeros(int(self.offsets[-1]), dtype=dtype) if buffer is None else buffer
        # parameter i's slot in the buffer, shaped like the parameter
        self.views = [self.buffer[a:b].reshape(p.shape) for p, a, b in zip(params, self.offsets, self.offsets[1:])]
        self.ready = 0  # gradients complete in this step
        self.work = None  # the all-reduce in flight
        self.started = self.finished = None  # when it started, when it was first seen complete


def make_buckets(params: list, cap_bytes: int, dtype=None) -> list[Bucket]:
    """Group parameters, last first (backward's order), into buckets of about cap_bytes, in the
    parameters' dtype or `dtype` (fp32 gradients of 16-bit weights, chapter 10)."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.data.nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.data.nbytes
    if current:
        buckets.append(current)
    return [Bucket(i, ps, dtype or ps[0].dtype) for i, ps in enumerate(buckets)]


class DistributedDataParallel(NaiveDistributedDataParallel):
    """The naive wrapper with buckets: each bucket's all-reduce starts during backward.

        ddp = DistributedDataParallel(model, group)
        logits, loss = ddp(x_slice, y_slice)
        loss.backward()                       # buckets' all-reduces start during backward
        ddp.finish_gradient_synchronization() # now every p.grad is the global-batch gradient
        optimizer.step()
    """

    def __init__(self, module, group: World | None = None, bucket_cap_bytes: int = 1 << 20,
                 algorithm: str | None = None, timeline=None, grad_dtype=None, registered_buckets: bool = True):
        # grad_dtype=float32 with 16-bit weights: gradients accumulate and travel in fp32
        # (Megatron-LM's --accumulate-allreduce-grads-in-fp32): 4 bytes each, no 16-bit sums
        self.buckets = make_buckets(module.parameters(), bucket_cap_bytes, grad_dtype)
        self.hook_seconds = 0.0  # time spent in the gradient hooks (launching, progressing all-reduces)
        super().__init__(module, group, algorithm, timeline)  # the ranks agree on the buckets' sizes now
        if registered_buckets and self.group.size > 1:
            self._register_buckets()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for b in self.buckets:  # backward writes each gradient straight into its bucket (PyTorch's
            for p, view in zip(b.params, b.views):  # gradient_as_bucket_view): no copy before the all-reduce
                p.grad_buffer = view
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def facts(self) -> list:
        return super().facts() + [("bucket", b.buffer.size, b.buffer.dtype.str) for b in self.buckets]

    def _register_buckets(self) -> None:
        """The speed switch `registered_buckets`: when every rank shares this machine, the buckets
        live in shared memory (minidist/comm/registered.py), so that their all-reduce reads the
        peers' gradients where backward wrote them and copies nothing in or out (chapter 7).
        The same sums in the same order as the shared-memory window: the same bits."""
        buffers = registered.allocate(self.group, [(b.buffer.size, b.buffer.dtype) for b in self.buckets])
        if buffers is not None:
            self.buckets = [Bucket(b.index, b.params, b.buffer.dtype, buffer)
                            for b, buffer in zip(self.buckets, buffers)]

    # -- overlapped averaging, driven by gradient hooks
    def _grad_ready(self, p) -> None:
        """Called by backward as soon as `p`'s gradient is complete (a post-accumulate hook).
        Count it against its bucket; when every parameter of the bucket is ready, launch the
        bucket's all-reduce (`_launch`) without waiting for it: backward goes on computing the
        earlier layers' gradients while this bucket travels (chapter 3, overlap)."""
        if not self.require_sync or self.group.size == 1:
            return  # nothing to average with (or accumulating locally under no_sync)
        started = time.perf_counter()
        ### BEGIN SOLUTION assignment=ddp_bucket_hook
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)
        ### END SOLUTION
        self._progress()
        # the rank that finishes backward last adds its peers' waiting halves here: communication, not compute
        self.hook_seconds += time.perf_counter() - started

    def _launch(self, bucket: Bucket) -> None:
        """Start averaging one bucket over the data-parallel group, asynchronously. Every slot of
        the bucket's flat buffer must first hold its parameter's gradient (zeros for a parameter
        that got none this step, so that it adds nothing); then one non-blocking all-reduce
        ("avg", this DDP's `algorithm`) of the whole buffer, kept in `bucket.work` to be waited
        for in finish_gradient_synchronization."""
        ### BEGIN SOLUTION assignment=ddp_bucket_hook
        for p, slot in zip(bucket.params, bucket.views):
            if p.grad is None:
                slot[...] = 0.0  # unused in this step: contributes nothing
            elif p.grad is not slot:  # e.g. after someone replaced .grad: copy it in
                slot[...] = p.grad
        bucket.started, bucket.finished = time.perf_counter(), None
        bucket.work = all_reduce(bucket.buffer, op="avg", group=self.group, algorithm=self.algorithm, async_op=True)
        ### END SOLUTION

    def _progress(self) -> None:
        """Let in-flight all-reduces take their next steps (MPI progresses only when asked)."""
        for b in self.buckets:
            if b.work is not None and not b.finished and b.work.test():
                b.finished = time.perf_counter()

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket; afterwards each p.grad holds the average over all ranks."""
        if self.group.size == 1:
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


class DataParallelTrainer(Trainer):
    """The serial training step, data-parallel: each rank trains on its slice of the batch.

    `overlap` picks the wrapper: `DistributedDataParallel` (bucketed, the default) or
    `NaiveDistributedDataParallel`. With `accumulation` k > 1, a rank's slice is processed in k
    micro-batches; gradients are averaged over ranks once, after the last. global batch =
    micro-batch x k x dp. The slices are even unless `rows` gives the rows of every rank
    (section 7: each rank's loss is weighted by its rows, so the update is still the serial one).
    """

    name = "dp"

    def __init__(self, config: GPTConfig, settings: OptimSettings, task, batch_size: int, seed: int = 0,
                 group: World | None = None, overlap: bool = True, bucket_cap_bytes: int = 1 << 20,
                 accumulation: int = 1, algorithm: str | None = None, rows: list[int] | None = None,
                 precision: str = "fp32", fp32_grads: bool = False, registered_buckets: bool = True):
        self.world = resolve(group)
        dp = self.world.size
        if rows is None and batch_size % (dp * accumulation):
            raise ValueError(f"global batch {batch_size} is not divisible by dp={dp} x accumulation "
                             f"steps={accumulation} = {dp * accumulation}")
        self.task, self.batch_size, self.accumulation = task, batch_size, accumulation
        self.rows = list(rows) if rows is not None else [batch_size // dp] * dp
        if len(self.rows) != dp or sum(self.rows) != batch_size or min(self.rows) < accumulation:
            raise ValueError(f"rows per rank {self.rows}: need {dp} counts of at least accumulation="
                             f"{accumulation} rows each, summing to the global batch {batch_size}")
        # the statistics' all-reduce closing every step follows from these: checked once (chapter 7)
        self.group = self.world.verify("the data-parallel step", [type(self).__name__, batch_size, accumulation,
                                                                  self.rows])
        self.settings, self.amp = settings, Precision(precision, settings)
        self.precision, self.scaler = self.amp.name, self.amp.scaler
        self.timeline = Timeline()
        self.model = GPT(config, seed=seed)
        # chapter 10: 16-bit weights (so 16-bit gradients, and buckets) before DDP sees them
        masters = self.amp.cast(self.model)
        if overlap:
            self.ddp = DistributedDataParallel(self.model, self.world, bucket_cap_bytes, algorithm, self.timeline,
                                               np.float32 if fp32_grads else None, registered_buckets)
        else:
            self.ddp = NaiveDistributedDataParallel(self.model, self.world, algorithm, self.timeline)
        self.optimizer = make_optimizer(self.model, settings, masters)
        self.activation_bytes = 0

    def step(self, step: int):
        """One optimizer step on the global batch; returns (global mean loss, accuracy)."""
        x, y = self.task.get_batch(step, self.batch_size, self.world.rank, self.world.size, counts=self.rows)
        self.optimizer.zero_grad()
        loss, acc = self.forward_backward(x, y)
        self.ddp.finish_gradient_synchronization()
        self.optimizer_step(step)
        loss, acc = self.sum_over_ranks([loss, acc])
        return float(loss), float(acc)

    def forward_backward(self, x, y) -> tuple[float, float]:
        """Forward and backward over this rank's rows, in `accumulation` micro-batches; returns
        this rank's share of the global mean loss and accuracy."""
        dp, B, k = self.world.size, self.batch_size, self.accumulation
        loss_sum, acc_sum = 0.0, 0.0
        first = sum(self.rows[:self.world.rank])  # the global batch's row this rank's micro-batch starts at
        for i, (mx, my) in enumerate(zip(np.array_split(x, k), np.array_split(y, k))):
            sync = contextlib.nullcontext() if i == k - 1 else self.ddp.no_sync()
            share = len(mx) / B  # of the global batch: the loss is a mean over all B rows
            with sync, self.masks(first):
                first += len(mx)
                with self.timeline.span(f"forward {i}", "forward"), self.amp.autocast():
                    logits, loss = self.ddp(mx, my)
                if not self.activation_bytes:  # every step builds the same graph: measure it once
                    self.activation_bytes = graph_bytes(loss)
                with self.timeline.span(f"backward {i}", "backward"):
                    # the all-reduce averages (sums and divides by dp), so scale by share x dp:
                    # 1/k for an even split, as one big batch
                    self.amp.scale(loss * (len(mx) * dp / B)).backward()
            loss_sum += loss.item() * share
            acc_sum += accuracy(np.asarray(logits.data, dtype=np.float32), my) * share
        return loss_sum, acc_sum

    def masks(self, first: int):
        """Around the micro-batch that starts at the global batch's row `first`: the dropout
        masks as each replica's generators draw them (every replica draws its own rows' worth
        from the same seed). `BalancedDataParallelTrainer` makes them follow the rows instead."""
        return contextlib.nullcontext()

    def optimizer_step(self, step: int) -> None:
        with self.timeline.span("optimizer", "optimizer"):
            # the replicas hold equal gradients, but they agree on a skip all the same (chapter 10)
            self.amp.step(self.optimizer, step, agree=lambda found_inf: any_rank(found_inf, self.group))

    def sum_over_ranks(self, values: list[float]) -> np.ndarray:
        """Every rank's `values` added up (float64): the step's global loss and accuracy."""
        totals = np.array(values, dtype=np.float64)
        all_reduce(totals, op="sum", group=self.group)
        return totals

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

    def global_state(self) -> dict:
        """This replica's whole training state (every rank holds a full copy: the checkpoint
        keeps one, rank 0's)."""
        return training_state(self.model, self.optimizer, self.scaler)

    def load_global_state(self, read) -> None:
        load_training_state(self.model, self.optimizer, read, self.scaler)

    def report(self) -> dict:
        return self.amp.report()
