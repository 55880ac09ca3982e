"""Registered buffers (chapter 7, minidist/comm/registered.py) under real mpiexec with 2, 3, 4
ranks: the all-reduce of an array that lives in shared memory equals MPI's own Allreduce and,
bit for bit, the shared-memory window's; its traffic is the ring's 2(N-1)/N x S per rank; calls
on different buffers run independently; a rank that never comes is named in the timeout.
"""
import numpy as np
import pytest
from conftest import layout

from minidist.comm.launch import run

# (elements, dtype, op), each above the 64 KB up to which the window's one handshake is kept:
# float64 summed, float32 averaged, fp16 summed in fp32, ints' max
SHAPES = [(9000, "float64", "sum"), (70001, "float32", "avg"), (40999, "float16", "sum"), (8197, "int64", "max")]
ROUNDS = 3


def data(rank, round_, count, dtype):
    """What `rank` puts in an array in `round_`: different on every rank and in every round."""
    rng = np.random.default_rng(1000 * round_ + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-10**6, 10**6, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def registered_rank_program():
    import time

    from mpi4py import MPI

    from minidist import comm as dist
    from minidist.comm import registered, shared_memory, traffic, waiting

    world = dist.get_world()
    out = {"rounds": [], "one_machine": shared_memory.window_or_none(world) is not None}
    arrays = registered.allocate(world, [(count, np.dtype(dtype)) for count, dtype, _ in SHAPES])
    if arrays is None:  # ranks on several machines: nothing to register with
        return out
    out["zeroed"] = all(not a.any() for a in arrays)
    out["found"] = [registered.find(a) is not None for a in arrays]
    out["slice_found"] = registered.find(arrays[0][:10]) is not None
    small = registered.allocate(world, [(100, np.dtype("float64"))])[0]  # 800 bytes: the window's one handshake
    small[...] = world.rank + 1.0
    traffic.reset()
    dist.all_reduce(small, op="sum")
    out["small"] = (small.copy(), traffic.snapshot()["total"]["messages"])
    # from 4 MB `auto` sends a plain array on 2 ranks as messages (halving-doubling); a registered one
    # has no copies to lose to them, so it stays registered: two flags
    large = registered.allocate(world, [((4 << 20) // 4 + 16, np.dtype("float32"))])[0]
    large[...] = world.rank + 1.0
    traffic.reset()
    dist.all_reduce(large, op="sum")
    counted = traffic.snapshot()
    out["large"] = (bool(np.all(large == world.size * (world.size + 1) / 2)), counted["total"]["messages"],
                    dist.choose_all_reduce("auto", world, large.nbytes),
                    sorted(k for k, v in counted.items() if k.startswith("all_reduce.") and v["bytes_sent"] > 0))
    mpi_ops = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}
    for round_ in range(ROUNDS):
        for a, (count, dtype, _) in zip(arrays, SHAPES):
            a[...] = data(world.rank, round_, count, dtype)
        window = [a.copy() for a in arrays]  # the same sums through the window's copies
        wide = [a.astype(np.float64) if a.dtype.kind == "f" else a.copy() for a in arrays]
        mpi = [np.empty_like(w) for w in wide]
        for w, m, (_, _, op) in zip(wide, mpi, SHAPES):
            world.comm.Allreduce(w, m, op=mpi_ops[op])
            if op == "avg":
                m /= world.size
        traffic.reset()
        # asynchronous, started in one order and finished in the other: each buffer has its own flags
        works = [dist.all_reduce(a, op=op, async_op=True) for a, (_, _, op) in zip(arrays, SHAPES)]
        for work in reversed(works):
            work.wait()
        sent = traffic.snapshot()["total"]["bytes_sent"]
        for w, (_, _, op) in zip(window, SHAPES):
            dist.all_reduce(w, op=op, algorithm="shared_memory")
        out["rounds"].append({"registered": [a.copy() for a in arrays], "window": window, "mpi": mpi, "sent": sent})
    # a rank that arrives but reduces late: nobody may leave before its chunk is written
    dist.set_check(False)  # the consistency check would make every rank wait for the others first
    arrays[0][...] = world.rank + 1.0
    if world.rank == world.size - 1:
        work = dist.all_reduce(arrays[0], op="sum", async_op=True)  # arrives, then does nothing for a while
        time.sleep(0.3)
        work.wait()
    else:
        time.sleep(0.1)  # so that the late rank's arrival comes first, and it cannot reduce at once
        dist.all_reduce(arrays[0], op="sum")
    out["late_reducer"] = arrays[0].copy()
    sliced = arrays[1][:5000]  # a part of a registered array is not registered: the window takes it
    sliced[...] = world.rank + 1.0
    dist.all_reduce(sliced, op="sum")
    out["slice_sum"] = float(sliced[0])
    # a rank that never comes: the others' wait names it
    old = waiting.set_wait_policy(timeout=0.5)
    try:
        if world.rank != world.size - 1:
            dist.all_reduce(arrays[3], op="max")
        out["timeout"] = None
    except dist.CommTimeout as exc:
        out["timeout"] = str(exc)
    finally:
        waiting.set_wait_policy(**old)
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=[layout(2), layout(3), layout(4, full=True)])
def launched(request):
    n, nodes, tcp = request.param
    return n, run(registered_rank_program, n, timeout=180, nodes=nodes, tcp=tcp)


def test_registered_all_reduce_equals_mpi_and_the_window_bit_for_bit(launched):
    n, outs = launched
    assert len(outs) == n and all(o["one_machine"] for o in outs)
    for rank, o in enumerate(outs):
        assert o["zeroed"] and o["found"] == [True] * len(SHAPES) and not o["slice_found"]
        assert len(o["rounds"]) == ROUNDS
        for round_, got in enumerate(o["rounds"]):
            for i, (count, dtype, op) in enumerate(SHAPES):
                mine, window, mpi = got["registered"][i], got["window"][i], got["mpi"][i]
                assert mine.dtype == np.dtype(dtype) and mine.shape == (count,)
                assert np.array_equal(mine, window), (n, rank, round_, dtype, op)  # the same bits
                if dtype == "float16":  # summed in fp32, rounded once
                    np.testing.assert_allclose(mine.astype(np.float64), mpi, rtol=1e-3, atol=2e-3)
                elif dtype == "float32":
                    np.testing.assert_allclose(mine, mpi, rtol=1e-5, atol=1e-6)
                else:
                    np.testing.assert_allclose(mine, mpi, rtol=1e-12, atol=0)
                if round_ > 0:  # every round's inputs differ, so a stale result cannot pass
                    assert not np.array_equal(mine, o["rounds"][round_ - 1]["registered"][i])
    for round_ in range(ROUNDS):  # every rank holds the same result
        for i in range(len(SHAPES)):
            assert all(np.array_equal(o["rounds"][round_]["registered"][i], outs[0]["rounds"][round_]["registered"][i])
                       for o in outs)


def test_registered_traffic_is_the_rings(launched):
    """Each rank writes its chunk into N-1 arrays and the others read the rest of its array:
    2(N-1)/N x S per rank, 2(N-1) x S over the group, exactly."""
    n, outs = launched
    total_bytes = sum(count * np.dtype(dtype).itemsize for count, dtype, _ in SHAPES)
    for round_ in range(ROUNDS):
        sent = [o["rounds"][round_]["sent"] for o in outs]
        assert sum(sent) == 2 * (n - 1) * total_bytes
        assert all(abs(s - 2 * (n - 1) / n * total_bytes) <= 2 * 8 * len(SHAPES) for s in sent), sent


def test_nobody_leaves_before_a_late_rank_has_written_its_chunk(launched):
    n, outs = launched
    for o in outs:
        assert np.array_equal(o["late_reducer"], np.full(SHAPES[0][0], n * (n + 1) / 2))


def test_a_small_registered_array_keeps_the_windows_one_handshake(launched):
    n, outs = launched
    for o in outs:
        values, messages = o["small"]
        assert np.array_equal(values, np.full(100, n * (n + 1) / 2)) and messages == 1


def test_auto_keeps_a_large_registered_array_registered(launched):
    n, outs = launched
    for o in outs:
        right, messages, plain_choice, kinds = o["large"]
        assert right and messages == 2 and kinds == ["all_reduce.shared_memory"]
        assert plain_choice == ("halving_doubling" if n == 2 else "shared_memory")  # what a plain array would get


def test_a_slice_of_a_registered_array_goes_through_the_window(launched):
    n, outs = launched
    assert [o["slice_sum"] for o in outs] == [n * (n + 1) / 2] * n


def test_a_rank_that_never_comes_is_named(launched):
    n, outs = launched
    assert outs[-1]["timeout"] is None
    for rank, o in enumerate(outs[:-1]):
        msg = o["timeout"]
        assert msg is not None and f"rank {rank} of {n}" in msg and "shared-memory all_reduce" in msg
        assert f"waiting for rank(s) [{n - 1}] to arrive" in msg
