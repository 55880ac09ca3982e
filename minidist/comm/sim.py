"""A simulated world in one process, for stepping a collective rank by rank (chapter 07).

One idea: the algorithms of algorithms.py are generators that post messages and yield; they
do not care who delivers the messages. Here one Python process plays all N ranks: it runs
N copies of the same generator, delivers every posted message by copying bytes, resumes
every rank whose messages have arrived, and records every rank's buffer after each step.

    from minidist.comm import algorithms as alg, sim
    steps = sim.simulate(alg.all_reduce_ring, [np.full(4, 2**r) for r in range(4)], np.add)
    steps[k][r]     # rank r's array after step k (steps[0] is the start)

It is exactly the code that runs under MPI, just without processes, which makes it the place
to *look* at a schedule (the chapter 07 notebook draws the ring from it). Every number a
chapter states still comes from the real run under mpiexec (`launch.run`).
"""
from __future__ import annotations

from collections import defaultdict, deque

import numpy as np


class _Msg:
    __slots__ = ("op", "rank", "peer", "array", "done")

    def __init__(self, op, rank, peer, array):
        self.op, self.rank, self.peer, self.array, self.done = op, rank, peer, array, False


class _SimCtx:
    """What an algorithm sees of its rank: rank, size, send, recv (like driver._Ctx)."""

    def __init__(self, world, rank):
        self.world, self.rank, self.size = world, rank, world.size
        self.tag, self.kind = 0, "sim"

    def send(self, array, peer):
        return self.world.post(_Msg("send", self.rank, peer, array))

    def recv(self, array, peer):
        return self.world.post(_Msg("recv", self.rank, peer, array))


class SimWorld:
    def __init__(self, size: int):
        self.size = size
        self.sends = defaultdict(deque)  # (src, dst) -> posted sends, in order
        self.recvs = defaultdict(deque)  # (src, dst) -> posted receives, in order
        self.bytes_sent = [0] * size
        self.messages = [0] * size

    def post(self, msg):
        if msg.op == "send":
            self.sends[(msg.rank, msg.peer)].append(msg)
            self.bytes_sent[msg.rank] += msg.array.nbytes
            self.messages[msg.rank] += 1
        else:
            self.recvs[(msg.peer, msg.rank)].append(msg)
        return msg

    def deliver(self) -> int:
        """Match posted sends with posted receives (in order, per pair) and copy the bytes."""
        moved = 0
        for pair, sends in self.sends.items():
            recvs = self.recvs[pair]
            while sends and recvs:
                s, r = sends.popleft(), recvs.popleft()
                if s.array.nbytes != r.array.nbytes:
                    raise ValueError(f"rank {s.rank} sends {s.array.nbytes} bytes to rank {r.rank}, "
                                     f"which expects {r.array.nbytes}")
                r.array.view(np.uint8)[...] = s.array.view(np.uint8)
                s.done = r.done = True
                moved += 1
        return moved


def simulate(algorithm, arrays, *args) -> list[list[np.ndarray]]:
    """Run `algorithm(ctx, arrays[r], *args)` for every rank r in lockstep; return the list
    of snapshots [step][rank] (copies), step 0 being the arrays before any message."""
    world = SimWorld(len(arrays))
    ranks = [algorithm(_SimCtx(world, r), a, *args) for r, a in enumerate(arrays)]
    pending = [None] * len(ranks)
    alive = list(range(len(ranks)))
    snapshots = [[a.copy() for a in arrays]]
    started = False
    while alive:
        progressed = False
        for r in list(alive):  # resume every rank whose messages have all arrived
            if pending[r] is None or all(m.done for m in pending[r]):
                try:
                    pending[r] = next(ranks[r])
                except StopIteration:
                    alive.remove(r)
                    pending[r] = None
                progressed = True
        if started and progressed:
            snapshots.append([a.copy() for a in arrays])
        started = True
        if not world.deliver() and not progressed and alive:
            raise RuntimeError(f"deadlock: ranks {alive} wait for messages nobody sends")
    world_stats = {"bytes_sent": world.bytes_sent, "messages": world.messages}
    simulate.last_traffic = world_stats  # for a notebook's curiosity
    return snapshots
