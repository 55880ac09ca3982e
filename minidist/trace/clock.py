"""One time axis for every rank of a job (chapter 5: a trace is only as good as its clocks).

One idea: ranks on one machine read the same clock (CLOCK_MONOTONIC, `timeline.now`), so their
events line up as they are. Ranks on other machines do not: each machine's monotonic clock
starts at its own boot. At the start of a trace each rank measures how far its clock is from
rank 0's with a few ping-pongs, as NTP does (Cristian's algorithm):

    rank r notes t1, sends a ping;  rank 0 answers with its clock t0;  rank r notes t2
    offset = t0 - (t1 + t2) / 2     (rank 0's clock minus mine, if the two legs took equally long)

The error is at most half the round trip, so of several ping-pongs the one with the smallest
round trip is kept. A rank on rank 0's machine measures it too (the trace shows the number,
a check of the method: a few microseconds at most) but applies none: its clock already is rank 0's.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minidist.comm.waiting import poll
from minidist.timeline import now

PINGS = 10
TAG = 31_337  # on the world's user communicator, before the job's own messages and after them


def align(comm: MPI.Comm, pings: int = PINGS) -> dict:
    """This rank's clock against rank 0's (collective: every rank of `comm` calls it).
    Returns {"offset": seconds to add to this rank's times (0 on rank 0's machine),
    "measured": the ping-pong's estimate, "round_trip": its smallest round trip, "same_machine"}."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    same_machine = bool(node.allreduce(int(comm.Get_rank() == 0), op=MPI.MAX))
    node.Free()
    measured, round_trip = 0.0, 0.0
    buffer = np.zeros(1)
    if comm.Get_rank() == 0:
        for peer in range(1, comm.Get_size()):  # one rank after another: each ping-pong alone on the wire
            for _ in range(pings):
                _exchange(comm.Irecv(buffer, peer, TAG))
                buffer[0] = now()
                _exchange(comm.Isend(buffer, peer, TAG))
    else:
        best = None
        for _ in range(pings):
            t1 = now()
            _exchange(comm.Isend(np.array([t1]), 0, TAG))
            _exchange(comm.Irecv(buffer, 0, TAG))
            t2 = now()
            if best is None or t2 - t1 < best[0]:
                best = (t2 - t1, buffer[0] - (t1 + t2) / 2)
        round_trip, measured = best
    return {"offset": 0.0 if same_machine else measured, "measured": measured, "round_trip": round_trip,
            "same_machine": same_machine}


def _exchange(request) -> None:
    poll([request])  # the polite wait (chapter 2): ranks waiting for their turn leave the cores alone
