"""The collectives' hot-path shortcuts (minidist/comm/fast_paths.py, chapter 7) give the plain
path's bits and counters, under real mpiexec; off by one switch."""
import numpy as np

from minidist.comm.launch import run

SIZES = [1, 7, 256, 2047]  # elements: up to just below the staging size in float32


def both_paths_program():
    from mpi4py import MPI

    import minidist.comm as dist
    from minidist.comm import fast_paths, traffic

    world, out = dist.get_world(), {}
    rng = np.random.default_rng(world.rank)
    for dtype in (np.float32, np.float64, np.int64):
        for op in ("sum", "max", "avg"):
            if op == "avg" and dtype is np.int64:
                continue
            for n in SIZES:
                x = (rng.standard_normal(n) * 100).astype(dtype)
                results, counters = [], []
                for fast in (True, False):
                    fast_paths.use_fast_paths(fast)
                    y = x.copy()
                    traffic.reset()
                    dist.all_reduce(y, op=op, algorithm="recursive_doubling")
                    results.append(y)
                    counters.append(traffic.snapshot())
                expected = np.empty_like(x)
                MPI.COMM_WORLD.Allreduce(x, expected, op=MPI.MAX if op == "max" else MPI.SUM)
                if op == "avg":
                    expected = expected / 2
                out[(np.dtype(dtype).name, op, n)] = {
                    "same bits": results[0].tobytes() == results[1].tobytes(),
                    "same counters": counters[0] == counters[1],
                    "error": float(np.max(np.abs(results[0] - expected))) if n else 0.0,
                    "counters": counters[0]}
    fast_paths.use_fast_paths(True)
    return out


def test_the_two_rank_exchange_equals_the_plain_path_and_mpi():
    for rank in run(both_paths_program, 2, timeout=120):
        for key, result in rank.items():
            assert result["same bits"] and result["same counters"], (key, result)
            assert result["error"] <= 1e-12 * (1 if key[0] != "float32" else 1e6), (key, result)
        counts = rank[("float64", "sum", 256)]["counters"]["all_reduce.recursive_doubling"]
        assert (counts["calls"], counts["messages"], counts["bytes_sent"]) == (1, 1, 256 * 8)


def test_the_switch_and_where_the_shortcut_applies():
    from minidist.comm import fast_paths

    class Two:
        size, cache = 2, {}

    small, staged = np.zeros(100), np.zeros(1024)  # 800 bytes; 8 KB, the plain path's staging size
    assert fast_paths.shortcut(Two(), small, "recursive_doubling", False, False) is fast_paths.exchange_two
    assert fast_paths.shortcut(Two(), staged, "recursive_doubling", False, False) is None
    assert fast_paths.shortcut(Two(), small, "ring", False, False) is None
    assert fast_paths.shortcut(Two(), small, "recursive_doubling", True, False) is None  # async
    assert fast_paths.shortcut(Two(), small, "recursive_doubling", False, True) is None  # a trace records
    assert fast_paths.shortcut(Two(), small, "shared_memory", False, False) is None  # no window made yet
    fast_paths.use_fast_paths(False)
    try:
        assert fast_paths.shortcut(Two(), small, "recursive_doubling", False, False) is None
    finally:
        fast_paths.use_fast_paths(True)


WINDOW_SIZES = [1, 7, 2047, 16384, 40000]  # up to the window's small size (64 KB) and one above it


def window_program():
    from mpi4py import MPI

    import minidist.comm as dist
    from minidist.comm import fast_paths, shared_memory, traffic

    world, out = dist.get_world(), {}
    rng = np.random.default_rng(world.rank)
    dist.all_reduce(np.zeros(1 << 18, np.float32), algorithm="shared_memory")  # the window grown to a piece
    for dtype in (np.float32, np.float64, np.int64, np.float16):
        for op in ("sum", "max", "avg"):
            if op == "avg" and dtype is np.int64:
                continue
            for n in WINDOW_SIZES:
                x = (rng.standard_normal(n) * (100 if dtype is not np.float16 else 1)).astype(dtype)
                results, counters, straight, small = [], [], [], []
                for fast in (True, False):
                    fast_paths.use_fast_paths(fast)
                    shared = shared_memory.window(world)
                    way = fast_paths.shortcut(world, x, "shared_memory", False, False)
                    straight.append(way is not None)
                    if way is not None:
                        small.append(way is fast_paths.window_small)
                    y = x.copy()
                    traffic.reset()
                    dist.all_reduce(y, op=op, algorithm="shared_memory")
                    results.append(y)
                    counters.append(traffic.snapshot())
                expected = np.empty_like(x, dtype=np.float64)
                MPI.COMM_WORLD.Allreduce(x.astype(np.float64), expected, op=MPI.MAX if op == "max" else MPI.SUM)
                if op == "avg":
                    expected = expected / world.size
                out[(np.dtype(dtype).name, op, n)] = {
                    "straight": straight, "small": small, "one piece": x.nbytes <= shared.capacity, "same bits": results[0].tobytes() == results[1].tobytes(),
                    "same counters": counters[0] == counters[1],
                    "error": float(np.max(np.abs(results[0] - expected) / np.maximum(1.0, np.abs(expected))))}
    fast_paths.use_fast_paths(True)
    # a blocking call behind an asynchronous one in flight takes the plain path, which finishes that one first
    a, b = np.full(5000, world.rank, np.float64), np.full(10, world.rank, np.float64)
    work = dist.all_reduce(a, algorithm="shared_memory", async_op=True)
    out["behind async straight"] = fast_paths.shortcut(world, b, "shared_memory", False, False) is not None
    dist.all_reduce(b, algorithm="shared_memory")
    work.wait()
    total = sum(range(world.size))
    out["behind async ok"] = bool(np.all(a == total) and np.all(b == total))
    return out


def test_the_window_driven_straight_equals_the_plain_path_and_mpi():
    from minidist.comm import shared_memory

    for n in (2, 3, 4):
        for rank in run(window_program, n, timeout=180):
            for key, result in rank.items():
                if not isinstance(key, tuple):
                    continue
                assert result["straight"] == [result["one piece"], False], (n, key, result)
                nbytes = key[2] * np.dtype(key[0]).itemsize
                assert result["small"] == ([nbytes <= shared_memory.SMALL] if result["one piece"] else []), (n, key, result)
                assert result["same bits"] and result["same counters"], (n, key, result)
                bound = {"float64": 1e-12, "int64": 0.0, "float32": 1e-4, "float16": 5e-3}[key[0]]  # addends up to 400
                assert result["error"] <= bound, (n, key, result)
            assert rank["behind async straight"] is False and rank["behind async ok"]
            assert sum(r["straight"][0] for k, r in rank.items() if isinstance(k, tuple)) >= 40  # not vacuous
