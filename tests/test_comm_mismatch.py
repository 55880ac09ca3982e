"""A collective called with arguments that do not fit together raises on every rank, naming what
each rank passed (chapter 7, comm/consistency.py), under real mpiexec: here the algorithm and
the op, which each rank must also agree on."""
import numpy as np
import pytest

from minidist.comm.launch import run


def mismatch_program():
    import minidist.comm as dist

    world = dist.get_world()
    out = {}
    last = world.rank == world.size - 1
    try:  # the last rank asks for another algorithm: a ring and a tree cannot meet
        dist.all_reduce(np.ones(10), algorithm="tree" if last else "ring")
        out["algorithm"] = None
    except dist.CollectiveMismatch as error:
        out["algorithm"] = str(error)
    try:  # the last rank asks for another op
        dist.all_reduce(np.ones(10), op="max" if last else "sum")
        out["op"] = None
    except dist.CollectiveMismatch as error:
        out["op"] = str(error)
    x = np.full(4, float(world.rank))  # and the group still works afterwards
    dist.all_reduce(x, algorithm="ring")
    out["after"] = x.tolist()
    return out


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.full)])
def test_algorithm_and_op_mismatches_raise_on_every_rank_showing_each_ranks_arguments(n):
    outs = run(mismatch_program, n, timeout=120)
    assert len(outs) == n
    for rank, out in enumerate(outs):
        msg = out["algorithm"]
        assert msg is not None, f"rank {rank} did not raise"
        assert f"rank {n - 1}: all_reduce(count=10, dtype=float64, op=sum, algorithm=tree)" in msg
        assert "rank 0: all_reduce(count=10, dtype=float64, op=sum, algorithm=ring)" in msg
        msg = out["op"]
        assert msg is not None, f"rank {rank} did not raise"
        assert f"rank {n - 1}: all_reduce(count=10, dtype=float64, op=max" in msg
        assert "rank 0: all_reduce(count=10, dtype=float64, op=sum" in msg
        assert out["after"] == [float(sum(range(n)))] * 4
