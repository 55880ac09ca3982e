"""The polite, timed wait: how a rank waits for other ranks (chapter 02).

One idea: a rank that waits must neither burn a core nor wait forever. Every wait of
minidist.comm ends here: a point-to-point message (p2p.py), each step of a collective
(collectives.py), the flags of the shared-memory all-reduce (shared_memory.py), and the
duplication of a group's communicator for its collectives (world.py). `wait` waits for
`Request`s (a posted MPI request, plus what is needed to explain a timeout), `poll` for raw MPI
requests, `poll_until` for any condition.

Why a *polite* wait. MPICH's blocking calls (`Recv`, `Wait`, `Barrier`) busy-poll: a waiting
rank burns 100% of a core. On a 2-core machine running 4 ranks, the ranks that wait steal the
CPU from the rank that computes and make it about twice as slow (`python -m minidist.bench
collectives --wait-demo` measures it).

The polite wait polls `Testall()` in three phases: for the first `busy` seconds (5 us) it
polls flat out, because inside a collective the peer is often just a few microseconds
behind; until `spin` it gives the core away with `sched_yield` between polls (cheap if
nobody else needs the core, quick to notice a message); after that it sleeps, with an
exponential back-off up to `max_sleep` (1 ms), so a long wait costs next to no CPU. `spin` is
1 ms when the ranks on this machine outnumber its cores and 50 ms when each has its own
(`_default_spin`: there, sleeping only adds latency).

Why only 5 us of flat-out polling: with 4 ranks on 2 cores the peer we wait for often shares
our core and cannot run until we yield; every microsecond spent spinning delays it.

Every wait has a `timeout`: instead of hanging forever it raises `CommTimeout`, naming this rank, the
peer, the tag and what it waited for.

Configure with `set_wait_policy(...)` or the environment variables MINIDIST_WAIT_BUSY,
MINIDIST_WAIT_SPIN, MINIDIST_WAIT_MAX_SLEEP (seconds), MINIDIST_TIMEOUT (seconds, default 300) and
MINIDIST_POLITE=0 (fall back to MPI's spinning `Waitall`, for comparison).
"""
from __future__ import annotations

import contextlib
import os
import time

from mpi4py import MPI

from minidist import timeline
from minidist.comm.errors import CommTimeout


def _default_spin() -> float:
    """How long a wait yields the core before it starts to sleep. Sleeping costs latency: the
    sleeper notices the message up to one back-off interval late (about 1 ms, where 50 ms of
    yielding notices it within about 0.1 ms). Yielding costs nothing when every rank has a core of
    its own; when ranks outnumber the cores, a rank that yields still takes turns on the core
    its busy neighbour needs, so it should go to sleep soon. MPICH's mpiexec tells each rank
    how many ranks share its machine (MPI_LOCALNRANKS)."""
    local_ranks = int(os.environ.get("MPI_LOCALNRANKS", "0"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    has_own_core = 0 < local_ranks <= cores
    return 0.05 if has_own_core else 0.001


class _Policy:
    busy = float(os.environ.get("MINIDIST_WAIT_BUSY", "0.000005"))
    spin = float(os.environ.get("MINIDIST_WAIT_SPIN", _default_spin()))
    max_sleep = float(os.environ.get("MINIDIST_WAIT_MAX_SLEEP", "0.001"))
    timeout = float(os.environ.get("MINIDIST_TIMEOUT", "300"))
    polite = os.environ.get("MINIDIST_POLITE", "1") != "0"


def set_wait_policy(busy=None, spin=None, max_sleep=None, timeout=None, polite=None) -> dict:
    """Change how every minidist wait behaves on this rank; returns the previous policy."""
    old = wait_policy()
    for name, value in dict(busy=busy, spin=spin, max_sleep=max_sleep, timeout=timeout, polite=polite).items():
        if value is not None:
            setattr(_Policy, name, value)
    return old


def wait_policy() -> dict:
    return dict(busy=_Policy.busy, spin=_Policy.spin, max_sleep=_Policy.max_sleep, timeout=_Policy.timeout, polite=_Policy.polite)


@contextlib.contextmanager
def waiting_as(**policy):
    """Inside the block every wait of this rank follows `policy` (`set_wait_policy`'s keywords);
    the previous policy comes back after it, also on an error."""
    previous = set_wait_policy(**policy)
    try:
        yield
    finally:
        set_wait_policy(**previous)


class Request:
    """A posted message: the MPI request plus what we need to explain a timeout."""

    __slots__ = ("mpi", "op", "peer", "tag", "nbytes", "kind", "world", "trace")

    def __init__(self, mpi, op, peer, tag, nbytes, kind, world):
        self.mpi, self.op, self.peer, self.tag = mpi, op, peer, tag
        self.nbytes, self.kind, self.world = nbytes, kind, world
        self.trace = None  # a receive a trace records, until it is seen complete (chapter 5)

    def test(self) -> bool:
        done = self.mpi.Test()
        if done and self.trace is not None and timeline.RECORDER is not None:
            timeline.RECORDER.completed([self], None)
        return done

    def wait(self, timeout=None):
        wait([self], timeout)

    def describe(self) -> str:
        if self.peer < 0:  # a request of one of MPI's own non-blocking collectives
            return self.kind
        where = "to" if self.op == "send" else "from"
        return f"{self.op} of {self.nbytes} bytes {where} rank {self.peer}, tag {self.tag} ({self.kind})"


def wait(requests, timeout: float | None = None):
    """Wait, politely and with a timeout, until every request in `requests` completes."""
    if isinstance(requests, Request):
        requests = [requests]
    if not requests:
        return
    raw = [r.mpi for r in requests]
    if MPI.Request.Testall(raw):  # the common case for small messages: already there
        blocked_since = None
    else:
        blocked_since = time.perf_counter()
        poll(raw, timeout, lambda: requests)
    if timeline.RECORDER is not None:  # a trace: the receives' ends of their arrows, and the wait
        timeline.RECORDER.completed(requests, blocked_since)


def poll(raw: list, timeout: float | None = None, explain=None):
    """The polite wait itself, on a list of raw MPI requests (the collectives call it directly,
    without building a `Request` per message). `explain()` returns the matching `Request`s,
    and is called only to word a timeout."""
    if not _Policy.polite and timeout is None:
        MPI.Request.Waitall(raw)  # MPI's own wait: spins at 100% CPU (for comparison only)
        return
    testall = MPI.Request.Testall
    poll_until(lambda: testall(raw), timeout,
               lambda waited: _raise_timeout(explain() if explain else [], raw, waited))


def poll_until(ready, timeout: float | None = None, on_timeout=None, busy: float | None = None):
    """Wait politely until `ready()` is true: flat out for `busy` seconds (default: the
    policy's), then yielding the core until `spin`, then sleeping with back-off. Requests use
    it through `poll`; the shared-memory all-reduce waits on flags in memory with it.
    `on_timeout(waited)` raises."""
    clock = time.perf_counter
    timeout = _Policy.timeout if timeout is None else timeout
    start = clock()
    busy_until = start + (_Policy.busy if busy is None else busy)
    spin_until = start + _Policy.spin
    if not _Policy.polite:
        busy_until = spin_until = start + timeout  # spin like MPI does (for comparison only)
    sleep = 1e-5
    while not ready():
        now = clock()
        if now < busy_until:
            continue  # a message from a busy peer usually arrives within microseconds
        if now - start > timeout:
            if on_timeout is not None:
                on_timeout(now - start)
            raise CommTimeout(f"rank {MPI.COMM_WORLD.Get_rank()} timed out after {now - start:.1f} s")
        if now < spin_until:
            os.sched_yield()  # give the core to a rank that has work, if any
        else:
            time.sleep(sleep)
            sleep = min(2 * sleep, _Policy.max_sleep)


def _raise_timeout(requests, raw, waited):
    pending = [r for r, m in zip(requests, raw) if m != MPI.REQUEST_NULL and not m.Test()]
    what = "; ".join(r.describe() for r in pending) or "requests that completed too late"
    world = MPI.COMM_WORLD
    rank, size = (requests[0].world.rank, requests[0].world.size) if requests else (world.Get_rank(), world.Get_size())
    for r in pending:  # withdraw posted receives so MPI can clean up
        if r.op == "recv" and r.peer >= 0:
            r.mpi.Cancel()
            r.mpi.Wait()
    raise CommTimeout(
        f"rank {rank} of {size} (world rank {world.Get_rank()}) timed out after "
        f"{waited:.1f} s waiting for {what}. Is that rank alive, and did it make the same call?"
    )
