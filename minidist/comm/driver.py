"""How one collective call runs (chapters 02 and 07): the call's context and the driving of its steps.

Every algorithm of algorithms.py is a generator: it posts a step's messages through a call
context (`_Ctx`: who am I, this call's tag, the traffic counters) and yields what that step must
wait for. `_run` drives such a generator to its end, waiting politely at every step, or hands it
to a `Work` that advances it only when asked (`test()`, `wait()`): MPI moves a message only
while a rank is inside an MPI call, so an asynchronous collective makes progress exactly when its
owner polls it (chapter 3's gradient hooks do, between layers). collectives.py builds each call
from these pieces.
"""
from __future__ import annotations

import copy

from mpi4py import MPI

from minidist import timeline
from minidist.comm import shared_memory, traffic
from minidist.comm.waiting import Request, _raise_timeout, poll, poll_until
from minidist.comm.world import World


class _Ctx:
    """What an algorithm needs: who am I, and how to post a message with this call's tag.

    This is the hot path of every collective, so it is lean: `send`/`recv` post straight on
    MPI and return the raw MPI request (no wrapper object per message), count the message
    with two integer additions, and note (request, op, peer, bytes) in `posted` so that a
    timeout can still name the peer it waited for."""

    __slots__ = ("world", "comm", "rank", "size", "tag", "kind", "counts", "posted", "call")

    def __init__(self, world: World, kind: str):
        self.world, self.comm = world, world.coll_comm
        self.rank, self.size = world.rank, world.size
        self.tag, self.kind = world.next_tag(), traffic.labelled(kind, world)
        self.counts = traffic.counter(self.kind)
        self.counts.calls += 1
        self.posted = []
        self.call = None  # (start, recorder, async) while a trace records this call (chapter 5)

    def send(self, array, peer):
        req = self.comm.Isend([array, _BYTE], peer, self.tag)  # slices of a contiguous flat array
        c = self.counts
        c.bytes_sent += array.nbytes
        c.messages += 1
        self.posted.append((req, "send", peer, array.nbytes))
        return req

    def recv(self, array, peer):
        req = self.comm.Irecv([array, _BYTE], peer, self.tag)
        c = self.counts
        c.bytes_received += array.nbytes
        c.messages_received += 1
        self.posted.append((req, "recv", peer, array.nbytes))
        return req

    def wait(self, pending, timeout=None):
        """Wait for one step's requests: a single Testall when they are already complete (the
        common case for small messages), else the polite wait of waiting.py. (The shared-memory
        all-reduce yields a FlagWait instead of requests: flags in memory, polled as politely.)"""
        if pending.__class__ is not list:  # a condition in shared memory (FlagWait, AfterWork)
            if not pending.test():
                poll_until(pending.test, timeout, pending.timed_out, busy=shared_memory.BUSY)
        elif not _testall(pending):
            poll(pending, timeout, lambda: self.explain(pending))
        self.posted.clear()  # this step is done; only the current step can time out

    def explain(self, pending):
        """`Request` objects for `pending` (only built to word a timeout)."""
        info = {id(req): (op, peer, nbytes) for req, op, peer, nbytes in self.posted}
        return [Request(req, *info[id(req)][:2], self.tag, info[id(req)][2], self.kind, self.world)
                for req in pending]


_BYTE = MPI.BYTE
_testall = MPI.Request.Testall  # one call for all of a step's requests: small ones are usually done already


def _ready(pending) -> bool:
    return _testall(pending) if pending.__class__ is list else pending.test()


class Work:
    """A collective in flight. `test()` advances it as far as possible without blocking and
    says whether it has finished; `wait()` finishes it and returns its result."""

    def __init__(self, ctx, steps, result, finish=None):
        self._ctx, self._steps, self._result, self._finish = ctx, steps, result, finish
        self._pending, self._done = None, False
        self.test()  # post the first step's messages right away

    def _advance(self, block: bool, timeout=None) -> bool:
        while not self._done:
            if self._pending:
                if block:
                    self._ctx.wait(self._pending, timeout)
                elif not _ready(self._pending):
                    return False
                else:
                    self._ctx.posted.clear()
            try:
                self._pending = next(self._steps)
            except StopIteration:
                self._done, self._pending = True, None
                if self._finish is not None:
                    self._finish()
                if self._ctx is not None and self._ctx.call is not None:  # a trace: the call's span ends
                    self._ctx.call[1].end_collective(self._ctx, self._result)
        return True

    def test(self) -> bool:
        return self._advance(block=False)

    is_completed = test

    def wait(self, timeout=None):
        self._advance(block=True, timeout=timeout)
        return self._result

    def timed_out(self, waited):
        """Raise the timeout of the step this call still waits for, after `waited` seconds (a
        call queued behind this one waited that long: shared_memory.AfterWork)."""
        pending = self._pending
        if pending.__class__ is list:
            _raise_timeout(self._ctx.explain(pending), pending, waited)
        pending.timed_out(waited)


def reused_context(owner, kind: str) -> _Ctx:
    """The call context of a call on `owner` (a shared window, registered buffers), made once and
    reused: calls through shared memory post no messages, so they need no fresh tag. A trace
    counts each call's bytes apart, so while one records, each call gets a copy."""
    if owner.ctx is None:
        owner.ctx = _Ctx(owner.world, kind)
    else:
        owner.ctx.counts.calls += 1
    return owner.ctx if timeline.RECORDER is None else copy.copy(owner.ctx)


def _run(ctx, steps, result, async_op, finish=None):
    """Drive a schedule: `steps` is an algorithm's generator (or None: nothing to send) and
    `finish` runs once it is done (e.g. the division of op="avg")."""
    if steps is None:
        steps = iter(())
    if ctx is not None and timeline.RECORDER is not None:  # a trace records the call (chapter 5)
        timeline.RECORDER.begin_collective(ctx, async_op)
    if async_op:
        return Work(ctx, steps, result, finish)
    for pending in steps:  # the blocking call: drive the schedule, waiting at every step
        ctx.wait(pending)
    if finish is not None:
        finish()
    if ctx is not None and ctx.call is not None:
        ctx.call[1].end_collective(ctx, result)
    return result
