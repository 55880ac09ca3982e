"""Hidden checks of the ring all-reduce (chapter 7): float data, world sizes and counts the visible tests do not try."""
import numpy as np
import pytest

from minidist.comm import algorithms as alg
from minidist.comm import sim


@pytest.mark.parametrize("n, count", [(3, 2), (3, 31), (6, 5), (9, 100)])
def test_ring_all_reduce_of_floats(n, count):
    rng = np.random.default_rng(n * 100 + count)
    xs = [rng.standard_normal(count) for _ in range(n)]
    final = sim.simulate(alg.all_reduce_ring, [x.copy() for x in xs], np.add)[-1]
    for got in final:
        np.testing.assert_allclose(got, np.sum(xs, axis=0), rtol=1e-12, atol=1e-12)
    assert all(np.array_equal(final[0], got) for got in final)  # every rank holds the same bits
