"""Graded check for sendrecv (chapter 2), under real mpiexec: 3 ranks pass 4 MB round a ring and
2 ranks swap, each with one sendrecv. Messages this large are not buffered by MPI, so a sendrecv
that sends (blocking) before it receives leaves every rank waiting for its neighbour: a deadlock,
which fails here when its timeout runs out."""
import numpy as np

from minidist.comm.launch import run


def ring_of_sendrecvs():
    from minidist.comm import get_world, sendrecv

    world = get_world()
    n, r = world.size, world.rank
    mine = np.full(1 << 19, float(r))              # 4 MB of float64
    theirs = np.empty_like(mine)
    sendrecv(mine, (r + 1) % n, theirs, (r - 1) % n, tag=7, group=world, timeout=20)
    return float(theirs.min()), float(theirs.max())


def test_a_ring_of_large_sendrecvs_completes_with_the_neighbours_data():
    for n in (2, 3):
        for r, (low, high) in enumerate(run(ring_of_sendrecvs, n, timeout=60)):
            assert low == high == (r - 1) % n, f"rank {r} of {n} received {low}..{high}"
