"""Hand-written collectives against MPI's own, under real mpiexec with 1, 2, 3 and 4 ranks,
on one node and on several (4 ranks as 2 nodes x 2 over TCP sockets, and as 3 + 1).

Each layout is ONE launch (mpiexec costs ~0.5 s+ a time): the rank program
`check_everything` below runs every case and returns, per case, whether it matched MPI's
built-in counterpart and the numbers if not. The pytest tests then assert per group, so a
failure names the collective, algorithm, op, dtype and count. The shared-memory all-reduce
runs on groups whose ranks share a node, as MPI reports it; on a group that spans nodes it
must refuse with a ValueError.
"""

import numpy as np
import pytest

from conftest import layout, ranks_share_a_node

from minidist.comm.launch import run

# One node (or MINIDIST_NODES); the quick tier launches 2 and 3 ranks (a power of two and not)
ONE_NODE = [layout(1, full=True), layout(2), layout(3), layout(4, full=True)]
SEVERAL_NODES = [layout(4, nodes=2, tcp=True, full=True), layout(4, nodes=[3, 1], full=True)]
LAYOUTS = ONE_NODE + SEVERAL_NODES
DTYPES = ["float16", "float32", "float64", "int32", "int64"]
TOL = {"float16": 4e-3, "float32": 2e-6, "float64": 1e-13}  # relative to sum |x_i|


def counts_for(n):
    """Zero, one, fewer than N, not divisible by N, and large-ish."""
    return sorted({0, 1, max(n - 1, 1), 2 * n + 1, 1001, 30_011})


# ------------------------------------------------------------------- the rank program

def check_everything(seed):
    from mpi4py import MPI

    import minidist.comm as dist
    from minidist.comm import traffic
    from minidist.comm.algorithms import chunk_bounds

    comm, w = MPI.COMM_WORLD, dist.get_world()
    n, r = w.size, w.rank
    one_node = ranks_share_a_node(comm)
    mpi_local = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on my node: shared memory works there
    local = dist.World(comm.Split_type(MPI.COMM_TYPE_SHARED))
    rng = np.random.default_rng(seed + 7919 * r)
    mpi_op = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
    results = []  # (group, case, ok, detail)

    def data(count, dtype):
        if dtype.startswith("int"):
            return rng.integers(-1000, 1000, count).astype(dtype)
        return (rng.standard_normal(count) * 10).astype(dtype)

    def oracle_reduce(x, op, scatter=False, mpi=comm):
        """MPI's Allreduce / Reduce_scatter on `mpi`; float16 goes through float64 (no MPI float16 op)."""
        wide = x.astype(np.float64) if x.dtype == np.float16 else x
        if scatter:
            counts = [b - a for a, b in chunk_bounds(x.size, n)]
            out = np.empty(counts[r], wide.dtype)
            comm.Reduce_scatter(wide, out, counts, op=mpi_op[op])
        else:
            out = np.empty_like(wide)
            mpi.Allreduce(wide, out, op=mpi_op[op])
        scale = np.empty(x.shape)
        mpi.Allreduce(np.abs(x.astype(np.float64)), scale)  # sum of |x_i| for the tolerance
        if scatter:
            a, b = chunk_bounds(x.size, n)[r]
            scale = scale[a:b]
        if op == "avg":
            out = out / mpi.Get_size()
            scale = scale / mpi.Get_size()
        return out, scale

    def compare(group, case, got, want, scale, dtype, op):
        exact = op in ("max", "min") or dtype.startswith("int")
        want = want.astype(dtype) if exact else want
        if got.shape != want.shape:
            results.append((group, case, False, f"shape {got.shape} != {want.shape}"))
            return
        if exact:
            bad = int(np.sum(got != want))
            results.append((group, case, bad == 0, f"{bad} elements differ"))
        else:
            err = np.abs(got.astype(np.float64) - want.astype(np.float64))
            limit = TOL[dtype] * (scale + 1.0)
            worst = float(np.max(err / limit)) if err.size else 0.0
            results.append((group, case, worst <= 1.0, f"worst error / tolerance = {worst:.3g}"))

    def same_on_all_ranks(x, mpi=comm):
        """Every replica must hold identical bytes (data parallelism relies on it)."""
        import zlib
        return len(set(mpi.allgather(zlib.crc32(x.tobytes())))) == 1

    def refuses_across_nodes(group, case, call):
        """The shared-memory all-reduce on a group that spans nodes: a ValueError on every rank."""
        try:
            call()
            results.append((group, case + " across nodes", False, "did not raise"))
        except ValueError as error:
            results.append((group, case + " across nodes", "one machine" in str(error), str(error)))

    # all_reduce: every algorithm x op x dtype x count
    for algo in ["naive", "tree", "recursive_doubling", "halving_doubling", "ring", "shared_memory", "auto"]:
        for dtype in DTYPES:
            for op in ["sum", "avg", "max", "min"]:
                for count in counts_for(n):
                    case = f"{algo} {op} {dtype} count={count}"
                    x = data(count, dtype)
                    if op == "avg" and dtype.startswith("int"):
                        try:
                            dist.all_reduce(x.copy(), op, algorithm=algo)
                            results.append(("all_reduce", case, False, "int avg did not raise"))
                        except TypeError:
                            results.append(("all_reduce", case, True, ""))
                        continue
                    if algo == "shared_memory" and not one_node and count > 0:
                        refuses_across_nodes("all_reduce", case, lambda: dist.all_reduce(x.copy(), op, algorithm=algo))
                        continue
                    want, scale = oracle_reduce(x, op)
                    got = x.copy().reshape(-1, 1) if count % 2 else x.copy()  # 2-D arrays too
                    out = dist.all_reduce(got, op, algorithm=algo)
                    assert out is got
                    compare("all_reduce", case, got.reshape(-1), want, scale, dtype, op)
                    if not same_on_all_ranks(got):
                        results.append(("all_reduce", case + " identical on ranks", False, "ranks differ"))

    # reduce and broadcast (roots away from 0), both algorithms
    root = n // 2
    for algo in ["tree", "naive"]:
        for dtype in DTYPES:
            for count in counts_for(n):
                for op in ["sum", "max", "min"]:
                    x = data(count, dtype)
                    want, scale = oracle_reduce(x, op)
                    got = x.copy()
                    dist.reduce(got, dst=root, op=op, algorithm=algo)
                    case = f"{algo} {op} {dtype} count={count} dst={root}"
                    if r == root:
                        compare("reduce", case, got, want, scale, dtype, op)
                    else:
                        results.append(("reduce", case + " input kept", bool(np.array_equal(got, x)), "non-root changed"))
                x = data(count, dtype)
                want = x.copy()
                comm.Bcast(want.view(np.uint8), root=root)
                got = x.copy()
                dist.broadcast(got, src=root, algorithm=algo)
                results.append(("broadcast", f"{algo} {dtype} count={count} src={root}",
                                bool(np.array_equal(got, want)), "differs from MPI Bcast"))

    # reduce_scatter, all_gather, all_to_all
    for dtype in DTYPES:
        for count in counts_for(n):
            for op in ["sum", "avg", "max", "min"]:
                if op == "avg" and dtype.startswith("int"):
                    continue
                x = data(count, dtype)
                want, scale = oracle_reduce(x, op, scatter=True)
                keep = x.copy()
                got = dist.reduce_scatter(x, op)
                compare("reduce_scatter", f"{op} {dtype} count={count}", got, want, scale, dtype, op)
                results.append(("reduce_scatter", f"{op} {dtype} count={count} input kept",
                                bool(np.array_equal(x, keep)), "input changed"))
            # all_gather with a different count on every rank, then with `out` (array_split parts)
            mine = data(count + r, dtype)
            sizes = comm.allgather(mine.size)
            want = np.empty(sum(sizes), dtype)
            displs = np.cumsum([0] + sizes[:-1])
            isz = want.itemsize
            comm.Allgatherv(mine.view(np.uint8), [want.view(np.uint8), [s * isz for s in sizes],
                                                  [d * isz for d in displs], MPI.BYTE])
            got = dist.all_gather(mine)
            results.append(("all_gather", f"{dtype} counts={sizes}", bool(np.array_equal(got, want)), "differs"))
            a, b = chunk_bounds(count, n)[r]
            part = data(b - a, dtype)
            want = np.empty(count, dtype)
            comm.Allgatherv(part.view(np.uint8), [want.view(np.uint8), [(q - p) * isz for p, q in chunk_bounds(count, n)],
                                                  [p * isz for p, q in chunk_bounds(count, n)], MPI.BYTE])
            out = np.empty(count, dtype)
            got = dist.all_gather(part, out=out)
            results.append(("all_gather", f"{dtype} out= count={count}", got is out and bool(np.array_equal(out, want)), "differs"))
            # all_to_all: chunk j of my array goes to rank j (MPI Alltoallv on bytes)
            x = data(count, dtype)
            bounds = chunk_bounds(count, n)
            mine_n = bounds[r][1] - bounds[r][0]
            want = np.empty(n * mine_n, dtype)
            comm.Alltoallv([x.view(np.uint8), [(q - p) * isz for p, q in bounds], [p * isz for p, q in bounds], MPI.BYTE],
                           [want.view(np.uint8), [mine_n * isz] * n, [k * mine_n * isz for k in range(n)], MPI.BYTE])
            got = dist.all_to_all(x)
            results.append(("all_to_all", f"{dtype} count={count}", bool(np.array_equal(got, want)), "differs"))

    # groups: even and odd ranks each reduce among themselves, checked against MPI's Split;
    # then the ranks of each node (where shared memory works whatever the layout)
    sub, mpi_sub = w.split(color=r % 2), comm.Split(r % 2, r)
    sub_one_node = ranks_share_a_node(mpi_sub)
    for group, mpi_group, name in [(sub, mpi_sub, "split"), (local, mpi_local, "node")]:
        x = data(1000, "float64")
        want = np.empty_like(x)
        mpi_group.Allreduce(x, want)
        for algo in ["ring", "shared_memory"]:
            case = f"{algo} {name} size {group.size}"
            if algo == "shared_memory" and name == "split" and not sub_one_node:
                refuses_across_nodes("groups", case, lambda: dist.all_reduce(x.copy(), group=sub, algorithm=algo))
                continue
            got = dist.all_reduce(x.copy(), group=group, algorithm=algo)
            results.append(("groups", case, group.size == mpi_group.Get_size() and
                            bool(np.allclose(got, want, rtol=1e-13)), f"max error {np.max(np.abs(got - want)):.3g}"))

    # shared memory beyond the cases above, among the ranks of my node: arrays larger than the
    # window (several pieces), then many asynchronous calls in flight at once, of mixed sizes
    for count in [1_200_007, 3_000_001]:  # float32: 4.8 MB (2 pieces) and 12 MB (3 pieces)
        x = data(count, "float32")
        want, scale = oracle_reduce(x, "sum", mpi=mpi_local)
        got = dist.all_reduce(x.copy(), group=local, algorithm="shared_memory")
        compare("shared_memory", f"pieces count={count}", got, want, scale, "float32", "sum")
        results.append(("shared_memory", f"pieces count={count} identical on ranks",
                        same_on_all_ranks(got, mpi_local), "ranks differ"))
    arrays = [data(c, "float64") for c in [5, 100_000, 7, 20_000, 300_001, 1]]
    wants = [oracle_reduce(a, "avg", mpi=mpi_local) for a in arrays]
    works = [dist.all_reduce(a, op="avg", group=local, algorithm="shared_memory", async_op=True) for a in arrays]
    m = np.eye(40)
    while not all(wk.test() for wk in works):
        m = m @ m  # compute between polls
    for i, (wk, a, (want, scale)) in enumerate(zip(works, arrays, wants)):
        compare("shared_memory", f"async {i} count={a.size}", wk.wait(), want, scale, "float64", "avg")
    return results, traffic_checks(dist, traffic, chunk_bounds, w, local), other_checks(dist, w, local, rng)


def traffic_checks(dist, traffic, chunk_bounds, w, local):
    """Bytes and messages each algorithm sent on this rank, for one call of count elements
    (the shared-memory all-reduce among the ranks of my node, `local`)."""
    n, out = w.size, {}
    count = 10_007  # not divisible by 2, 3, 4: exercises chunk rounding
    x = np.ones(count, np.float64)
    for name, call in [("all_reduce.ring", lambda: dist.all_reduce(x.copy(), algorithm="ring")),
                       ("all_reduce.naive", lambda: dist.all_reduce(x.copy(), algorithm="naive")),
                       ("all_reduce.tree", lambda: dist.all_reduce(x.copy(), algorithm="tree")),
                       ("all_reduce.recursive_doubling", lambda: dist.all_reduce(x.copy(), algorithm="recursive_doubling")),
                       ("all_reduce.halving_doubling", lambda: dist.all_reduce(x.copy(), algorithm="halving_doubling")),
                       ("all_reduce.shared_memory", lambda: dist.all_reduce(x.copy(), group=local, algorithm="shared_memory")),
                       ("small shared_memory", lambda: dist.all_reduce(x[:1000].copy(), group=local, algorithm="shared_memory")),
                       ("reduce_scatter.ring", lambda: dist.reduce_scatter(x)),
                       ("all_gather.ring", lambda: dist.all_gather(x[slice(*chunk_bounds(count, n)[w.rank])],
                                                                   out=np.empty(count)))]:
        traffic.reset()
        call()
        kind = name.replace("small ", "all_reduce.")
        out[name] = traffic.snapshot().get(kind, {"bytes_sent": 0, "messages": 0, "bytes_received": 0})
    out["gather"] = traffic.gather()
    out["chunks"] = [b - a for a, b in chunk_bounds(count, n)]
    out["local"] = (local.rank, [b - a for a, b in chunk_bounds(count, local.size)])
    out["S"] = x.nbytes
    return out


def other_checks(dist, w, local, rng):
    import time

    from minidist.comm import p2p

    n, r, out = w.size, w.rank, {}
    # point-to-point: a ring shift with sendrecv, float16 and int64
    for dtype in ["float16", "int64"]:
        mine = np.arange(5, dtype=dtype) + r
        got = dist.sendrecv(mine, (r + 1) % n, np.empty_like(mine), (r - 1) % n, tag=3)
        out[f"sendrecv {dtype}"] = got.tolist()
    # mismatched arguments: every rank must raise, naming every rank's count / dtype
    for what in ["count", "dtype"]:
        x = np.zeros(10 + (r if what == "count" else 0), dtype=np.float32 if (what == "dtype" and r == n - 1) else np.float64)
        try:
            dist.all_reduce(x)
            out[f"mismatch {what}"] = None
        except dist.CollectiveMismatch as exc:
            out[f"mismatch {what}"] = str(exc)
    # async: two all-reduces in flight at once while this rank computes, then wait
    a, b = rng.standard_normal(300_000), rng.standard_normal(1000)
    want_a, want_b = dist.all_reduce(a.copy(), algorithm="ring"), dist.all_reduce(b.copy(), algorithm="tree")
    wa = dist.all_reduce(a, async_op=True, algorithm="ring")
    wb = dist.all_reduce(b, async_op=True, algorithm="tree")
    polls, m = 0, np.eye(60)
    while not (wa.test() and wb.test()):
        m = m @ m  # "backward compute" between polls
        polls += 1
    out["async"] = (bool(np.array_equal(wa.wait(), want_a) and np.array_equal(wb.wait(), want_b)),
                    wa.is_completed() and wb.is_completed(), polls)
    # barrier: nobody leaves before the last rank (which is late by 0.3 s) arrives
    if r == n - 1:
        time.sleep(0.3)
    t = time.perf_counter()
    dist.barrier()
    out["barrier_wait"] = time.perf_counter() - t
    # timeout messages: the last rank never joins an all-reduce, by messages and by shared
    # memory (among the ranks of my node)
    out["local"] = (local.rank, local.size)
    if n > 1:
        out["timeout"] = skipped_call_message(dist, p2p, w, "ring")
        if local.size > 1:
            out["shm timeout"] = skipped_call_message(dist, p2p, local, "shared_memory")
        dist.barrier()  # the late rank must not run ahead into the next launch's calls
    return out


def skipped_call_message(dist, p2p, w, algorithm):
    """The CommTimeout text on ranks 0..N-2 of an all-reduce that rank N-1 never joins (None on
    rank N-1). A fresh group, so the skipped call cannot disturb later calls; its first
    collective (which every rank makes) sets up its communicator and shared window. The
    mismatch check is off: otherwise it would be the check that waits."""
    sub = w.split(0)
    dist.all_reduce(np.zeros(1), group=sub, algorithm=algorithm)
    old, check = p2p.set_wait_policy(timeout=0.5), dist.set_check(False)
    try:
        if w.rank != w.size - 1:
            dist.all_reduce(np.zeros(4), group=sub, algorithm=algorithm)
        return None
    except dist.CommTimeout as exc:
        return str(exc)
    finally:
        p2p.set_wait_policy(**old)
        dist.set_check(check)


# ------------------------------------------------------------------- the pytest side

_cache = {}


def results_for(launch):
    """Every rank's results of one launch, `layout(n, nodes, tcp)`; made once per layout."""
    n, nodes, tcp = launch
    key = repr(launch)
    if key not in _cache:
        _cache[key] = run(check_everything, n, 1234, timeout=240, echo=False, nodes=nodes, tcp=tcp)
    return _cache[key]


def several(*sizes):
    """The one-node layouts of these world sizes, then every layout on several nodes."""
    return [p for p in ONE_NODE if p.values[0][0] in sizes] + SEVERAL_NODES


GROUPS = ["all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather", "all_to_all", "groups", "shared_memory"]


@pytest.mark.parametrize("launch", LAYOUTS)
@pytest.mark.parametrize("group", GROUPS)
def test_matches_mpi(launch, group):
    per_rank = [res[0] for res in results_for(launch)]
    cases = [(rank, case, detail) for rank, res in enumerate(per_rank) for g, case, ok, detail in res
             if g == group and not ok]
    checked = sum(1 for res in per_rank for g, *_ in res if g == group)
    assert checked > 0
    assert not cases, f"{len(cases)} of {checked} cases failed, e.g. {cases[:5]}"


@pytest.mark.parametrize("launch", several(2, 3, 4))
def test_traffic_matches_formulas(launch):
    n = launch[0]
    assert len(results_for(launch)) == n
    for r, (_, t, _) in enumerate(results_for(launch)):
        S, c = t["S"], [k * 8 for k in t["chunks"]]  # chunk bytes
        ring = t["all_reduce.ring"]
        # ring all-reduce: every chunk but my own in reduce-scatter, every chunk but my
        # right neighbour's in all-gather: 2S - c[r] - c[r+1], i.e. 2(N-1)/N S up to rounding
        assert ring["bytes_sent"] == 2 * S - c[r] - c[(r + 1) % n]
        assert abs(ring["bytes_sent"] - 2 * (n - 1) / n * S) <= 2 * 8
        assert ring["messages"] == 2 * (n - 1)
        assert ring["bytes_received"] == 2 * S - c[r] - c[(r - 1) % n]
        assert t["reduce_scatter.ring"]["bytes_sent"] == S - c[r]
        assert abs(t["reduce_scatter.ring"]["bytes_sent"] - (n - 1) / n * S) <= 8
        assert t["all_gather.ring"]["bytes_sent"] == S - c[(r + 1) % n]
        # shared memory among the L ranks of my node, large (80 KB): others read their chunks of
        # my slot and my chunk of the result, like the ring's 2(L-1)/L S; small (8 KB): everyone
        # reads my whole slot
        mine, local_chunks = t["local"]
        L, cl = len(local_chunks), [k * 8 for k in local_chunks]
        shm = t["all_reduce.shared_memory"]
        assert shm["bytes_sent"] == shm["bytes_received"] == (S - cl[mine]) + (L - 1) * cl[mine]
        assert abs(shm["bytes_sent"] - 2 * (L - 1) / L * S) <= 2 * L * 8
        assert t["small shared_memory"]["bytes_sent"] == (L - 1) * 8000
        naive = t["all_reduce.naive"]
        assert naive["bytes_sent"] == ((n - 1) * S if r == 0 else S)
        assert naive["bytes_received"] == ((n - 1) * S if r == 0 else S)
    ranks = [res[1] for res in results_for(launch)]
    # tree: every rank but the root sends S once going up and receives S once coming down
    assert sum(t["all_reduce.tree"]["bytes_sent"] for t in ranks) == 2 * (n - 1) * ranks[0]["S"]
    # recursive doubling: P log2 P exchanges of S among the power of two P, plus 2 per extra rank
    p = 1 << (n.bit_length() - 1)
    expected = (p * (p.bit_length() - 1) + 2 * (n - p)) * ranks[0]["S"]
    assert sum(t["all_reduce.recursive_doubling"]["bytes_sent"] for t in ranks) == expected
    # halving-doubling: the ring's 2(P-1)/P S per rank among the P, plus 2 S per extra rank
    assert sum(t["all_reduce.halving_doubling"]["bytes_sent"] for t in ranks) == (2 * (p - 1) + 2 * (n - p)) * ranks[0]["S"]
    if p == n:
        for t in ranks:
            hd = t["all_reduce.halving_doubling"]
            assert abs(hd["bytes_sent"] - 2 * (n - 1) / n * t["S"]) <= 2 * 8 * (n.bit_length() - 1)
            assert hd["messages"] == 2 * (n.bit_length() - 1)
    # traffic.gather(): one entry per rank, in rank order, with the demo's fields
    gathered = ranks[0]["gather"]
    assert [g["rank"] for g in gathered] == list(range(n))
    assert all(g["bytes_sent"] > 0 and g["messages"] > 0 for g in gathered)


@pytest.mark.parametrize("launch", several(2, 3, 4))
def test_point_to_point_and_barrier(launch):
    n = launch[0]
    assert len(results_for(launch)) == n
    for r, (_, _, o) in enumerate(results_for(launch)):
        left = (r - 1) % n
        assert o["sendrecv float16"] == [float(left + i) for i in range(5)]
        assert o["sendrecv int64"] == [left + i for i in range(5)]
        if r != n - 1:
            assert o["barrier_wait"] > 0.2, "left the barrier before the late rank arrived"


@pytest.mark.parametrize("launch", several(2, 3, 4))
def test_mismatch_raises_on_every_rank(launch):
    n = launch[0]
    assert len(results_for(launch)) == n
    for r, (_, _, o) in enumerate(results_for(launch)):
        msg = o["mismatch count"]
        assert msg is not None, f"rank {r} did not raise"
        for k in range(n):
            assert f"rank {k}: all_reduce(count={10 + k}, dtype=float64" in msg
        msg = o["mismatch dtype"]
        assert msg is not None and f"rank {n - 1}: all_reduce(count=10, dtype=float32" in msg
        assert "rank 0: all_reduce(count=10, dtype=float64" in msg


@pytest.mark.parametrize("launch", several(2, 4))
def test_async_all_reduce_overlaps_and_matches(launch):
    assert len(results_for(launch)) == launch[0]
    for r, (_, _, o) in enumerate(results_for(launch)):
        same, completed, polls = o["async"]
        assert same and completed
        assert polls >= 1


@pytest.mark.parametrize("launch", several(2, 3))
def test_timeout_names_rank_peer_and_tag(launch):
    n = launch[0]
    outs = [res[2]["timeout"] for res in results_for(launch)]
    assert len(outs) == n
    assert outs[n - 1] is None  # the rank that skipped the call did not wait
    for r in range(n - 1):
        msg = outs[r]
        assert msg is not None, f"rank {r} did not time out"
        assert f"rank {r} of {n}" in msg and "timed out after 0.5 s" in msg
        assert "all_reduce.ring" in msg and "tag" in msg
        if r == 0:  # rank 0 receives from its left neighbour, the rank that never came
            assert f"from rank {n - 1}" in msg


@pytest.mark.parametrize("launch", several(2, 3))
def test_shared_memory_timeout_names_the_rank_that_never_came(launch):
    """Among the ranks of each node (all of them on one node), the last one skips the call."""
    outs = [res[2] for res in results_for(launch)]
    assert len(outs) == launch[0]
    checked = 0
    for o in outs:
        r, size = o["local"]
        if size == 1:  # alone on its node: nobody to wait for
            assert "shm timeout" not in o
            continue
        msg = o["shm timeout"]
        if r == size - 1:  # the rank that skipped the call did not wait
            assert msg is None
            continue
        assert msg is not None and f"rank {r} of {size}" in msg and "shared-memory all_reduce" in msg
        assert f"waiting for rank(s) [{size - 1}] to arrive" in msg
        checked += 1
    if all(o["local"][1] == len(outs) for o in outs):  # all on one node: every rank but the last waited
        assert checked == len(outs) - 1
