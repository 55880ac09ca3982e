"""Verified groups and the choice of all-reduce algorithm (chapter 7), under real mpiexec.

A strategy verifies its group once when it is built (`World.verify`); its collectives then skip
the per-call consistency check. `choose_all_reduce` says what algorithm="auto" means, and
`all_reduce_algorithm(name)` sets the algorithm of every call that names none.
"""
import numpy as np
import pytest
from conftest import ranks_share_a_node

from minidist.comm.launch import run


def verified_program():
    import minidist.comm as dist
    from minidist.comm import all_reduce_algorithm, choose_all_reduce, traffic

    world = dist.get_world()
    out = {}
    x = np.arange(6.0) + world.rank
    expected = np.arange(6.0) * world.size + sum(range(world.size))

    traffic.reset()
    dist.all_reduce(x.copy(), group=world)  # a plain group: one check per call
    out["checks plain"] = "check" in traffic.snapshot()

    group = world.verify("six float64 values", [(6,), "float64"])
    traffic.reset()
    y = x.copy()
    dist.all_reduce(y, group=group)
    out["checks verified"] = "check" in traffic.snapshot()
    out["verified sum ok"] = bool(np.array_equal(y, expected))
    out["verified face"] = (group.rank, group.size, group.checked, world.checked)

    try:  # facts that differ between ranks fail on every rank, naming what differed
        world.verify("the shard shapes", [(world.rank,)])
        out["mismatch"] = None
    except ValueError as error:
        out["mismatch"] = str(error)

    out["one node"] = ranks_share_a_node(world.comm)  # as MPI reports it (MINIDIST_NODES may say otherwise)
    out["auto"] = choose_all_reduce("auto", world, 1 << 20)
    out["auto 48 bytes"] = choose_all_reduce("auto", world, 48)
    out["auto 4 MB"] = choose_all_reduce("auto", world, 4 << 20)
    out["auto 64 MB"] = choose_all_reduce("auto", world, 64 << 20)
    dist.all_reduce(big := np.full(1 << 20, float(world.rank)), group=group)  # 8 MB
    out["big sum ok"] = bool(np.all(big == sum(range(world.size))))
    out["auto x"], out["x bytes"] = choose_all_reduce("auto", world, x.nbytes), x.nbytes
    out["named"] = choose_all_reduce("ring", world, 1 << 20)
    traffic.reset()
    with all_reduce_algorithm("ring"):
        z = x.copy()
        dist.all_reduce(z, group=group)
        dist.all_reduce(x.copy(), group=group, algorithm="tree")  # a named algorithm wins
    out["default ring kinds"] = sorted(k for k in traffic.snapshot() if k.startswith("all_reduce."))
    out["default ring ok"] = bool(np.array_equal(z, expected))
    traffic.reset()
    dist.all_reduce(x.copy(), group=group)  # the default is back to auto after the block
    out["after kinds"] = sorted(k for k in traffic.snapshot() if k.startswith("all_reduce."))
    try:
        with all_reduce_algorithm("rign"):
            pass
    except ValueError as error:
        out["bad name"] = str(error)
    return out


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.full)])
def results(request):
    return request.param, run(verified_program, request.param, timeout=120)


def test_verified_group_skips_the_check_and_reduces_right(results):
    n, outs = results
    assert len(outs) == n
    for rank, out in enumerate(outs):
        assert out["checks plain"] is True
        assert out["checks verified"] is False
        assert out["verified sum ok"]
        assert out["verified face"] == (rank, n, False, True)


def test_verify_names_what_differs_on_every_rank(results):
    n, outs = results
    assert len(outs) == n
    for out in outs:
        assert out["mismatch"] is not None
        assert f"the shard shapes: not the same on every rank of this group of {n} (ranks [0] vs ranks [1]" in out["mismatch"]


def test_auto_is_shared_memory_on_one_machine_and_the_default_can_be_set(results):
    n, outs = results
    assert len(outs) == n
    for out in outs:
        if out["one node"]:
            assert out["auto"] == "shared_memory"
            # small arrays too: one handshake through the window beats a message (collectives.choose_all_reduce)
            assert out["auto 48 bytes"] == out["auto x"] == "shared_memory"
            assert out["after kinds"] == [f"all_reduce.{out['auto x']}"]
            # two ranks and a large array: messages, each copied once from process to process
            large = "halving_doubling" if n == 2 else "shared_memory"
            assert out["auto 4 MB"] == out["auto 64 MB"] == large
        else:  # across nodes, messages (which algorithm: tests/test_comm_hierarchical.py)
            assert out["auto"] != "shared_memory"
            assert out["after kinds"][0] == f"all_reduce.{out['auto 48 bytes']}"
        assert out["named"] == "ring"
        assert out["big sum ok"]
        assert out["default ring kinds"] == ["all_reduce.ring", "all_reduce.tree"]
        assert out["default ring ok"]
        assert "unknown all-reduce algorithm 'rign'" in out["bad name"]
