"""Every collective algorithm in the in-process simulated world, for 1 to 8 ranks.

The same generator code as under MPI (algorithms.py), run by minidist.comm.sim: fast, so it
covers world sizes the MPI tests cannot afford (5, 6, 7, 8) and odd counts, against NumPy.
"""
import numpy as np
import pytest

from minidist.comm import algorithms as alg
from minidist.comm import sim

ALL_REDUCE = [alg.all_reduce_naive, alg.all_reduce_tree, alg.all_reduce_recursive_doubling,
              alg.all_reduce_halving_doubling, alg.all_reduce_ring]


def data(n, count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(-50, 50, count).astype(np.int64) for _ in range(n)]


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 5, 17])
def test_all_reduce_algorithms(n, count):
    for f in ALL_REDUCE:
        xs = data(n, count)
        want = np.sum(xs, axis=0)
        final = sim.simulate(f, [x.copy() for x in xs], np.add)[-1]
        for r, got in enumerate(final):
            assert np.array_equal(got, want), f"{f.__name__} rank {r}: {got} != {want}"
        mx = sim.simulate(f, [x.copy() for x in xs], np.maximum)[-1]
        assert all(np.array_equal(g, np.max(xs, axis=0)) for g in mx) or count == 0


@pytest.mark.parametrize("n", range(1, 9))
def test_ring_traffic_is_2_n_minus_1_over_n(n):
    count = 1000
    sim.simulate(alg.all_reduce_ring, data(n, count), np.add)
    S = count * 8
    for sent in sim.simulate.last_traffic["bytes_sent"]:
        assert abs(sent - 2 * (n - 1) / n * S) <= 2 * 8  # up to chunk rounding


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("root", [0, -1])
def test_broadcast_reduce_scatter_gather_all_to_all(n, root):
    root = root % n
    count = 2 * n + 3
    xs = data(n, count, seed=n)
    for f in (alg.broadcast_tree, alg.broadcast_naive):
        final = sim.simulate(f, [x.copy() for x in xs], root)[-1]
        assert all(np.array_equal(g, xs[root]) for g in final)
    for f in (alg.reduce_tree, alg.reduce_naive):
        final = sim.simulate(f, [x.copy() for x in xs], root, np.add)[-1]
        assert np.array_equal(final[root], np.sum(xs, axis=0))
    bounds = alg.chunk_bounds(count, n)
    total = np.sum(xs, axis=0)
    # the reference ring, and what a student copy of the course runs in its place (the in-place ring on a copy)
    for reduce_scatter in (alg.reduce_scatter_ring, alg._reduce_scatter_on_a_copy):
        outs = [np.empty(b - a, np.int64) for a, b in bounds]
        sim.simulate(lambda ctx, x, o=outs: reduce_scatter(ctx, x, np.add, o[ctx.rank]), [x.copy() for x in xs])
        assert all(np.array_equal(outs[r], total[a:b]) for r, (a, b) in enumerate(bounds))
    gathered = [np.zeros(count, np.int64) for _ in range(n)]
    for r, (a, b) in enumerate(bounds):
        gathered[r][a:b] = xs[r][a:b]
    final = sim.simulate(lambda ctx, o: alg.all_gather_ring(ctx, o, bounds), gathered)[-1]
    want = np.concatenate([xs[r][a:b] for r, (a, b) in enumerate(bounds)])
    assert all(np.array_equal(g, want) for g in final)
    part = [b - a for a, b in bounds]
    a2a = [np.empty(n * part[r], np.int64) for r in range(n)]
    sim.simulate(lambda ctx, x: alg.all_to_all_pairwise(ctx, x, a2a[ctx.rank]), [x.copy() for x in xs])
    for r, (a, b) in enumerate(bounds):
        assert np.array_equal(a2a[r], np.concatenate([xs[j][a:b] for j in range(n)]))
