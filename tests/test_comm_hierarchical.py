"""The hierarchical all-reduce and the two-level cost model (chapter 07, topology), under real
mpiexec on made-up nodes: MPICH's host file and fork launcher on this one machine
(`launch.run(nodes=...)`), so `Split_type(COMM_TYPE_SHARED)` sees several machines.

Each layout is ONE launch: the rank program `check_hierarchical` runs every case and returns,
per case, whether it matched MPI's Allreduce, plus its traffic counters and what "auto" chose.
"""
import numpy as np
import pytest

from minidist.comm import cost
from minidist.comm.algorithms import chunk_bounds
from minidist.comm.launch import run

DTYPES = ["float16", "float32", "float64", "int32", "int64"]
TOL = {"float16": 4e-3, "float32": 2e-6, "float64": 1e-13}  # relative to sum |x_i|
COUNTS = [0, 1, 7, 1001]  # zero, one, fewer than the ranks of a node times nodes, not divisible
TRAFFIC_COUNT = 1000      # divisible by 1, 2, 3, 4: the flat ring's chunks are all equal


# ------------------------------------------------------------------- the rank program

def check_hierarchical(seed):
    from mpi4py import MPI

    import minidist.comm as dist
    from minidist.comm import traffic

    world = dist.get_world()
    rng = np.random.default_rng(seed + 7919 * world.rank)
    mpi_op = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
    results = []  # (case, ok, detail)

    def data(count, dtype):
        if dtype.startswith("int"):
            return rng.integers(-1000, 1000, count).astype(dtype)
        return (rng.standard_normal(count) * 10).astype(dtype)

    def check(group, case, x, got, op):
        """got (our result) against MPI's Allreduce of x over `group` (float16 through float64)."""
        wide = x.astype(np.float64) if x.dtype == np.float16 else x
        want, scale = np.empty_like(wide), np.empty(x.shape)
        group.comm.Allreduce(wide, want, op=mpi_op[op])
        group.comm.Allreduce(np.abs(x.astype(np.float64)), scale)
        if op == "avg":
            want, scale = want / group.size, scale / group.size
        same = len(set(group.comm.allgather(got.tobytes()))) == 1  # every rank the same bits
        if op in ("max", "min") or x.dtype.kind == "i":
            bad = int(np.sum(got != want.astype(x.dtype)))
            results.append((case, bad == 0 and same, f"{bad} elements differ, identical on ranks: {same}"))
        else:
            err = np.abs(got.astype(np.float64) - want) / (TOL[str(x.dtype)] * (scale + 1.0))
            worst = float(err.max()) if err.size else 0.0
            results.append((case, worst <= 1.0 and same, f"worst error / tolerance = {worst:.3g}, same: {same}"))

    subgroup = world.split(color=int(world.rank == 2))  # {0, 1, 3, ...} and {2}
    for name, group in [("world", world), ("subgroup", subgroup)]:
        for dtype in DTYPES:
            for op in ["sum", "avg", "max", "min"]:
                if op == "avg" and dtype.startswith("int"):
                    continue
                for count in COUNTS:
                    x = data(count, dtype)
                    got = x.copy()
                    out = dist.all_reduce(got, op, group=group, algorithm="hierarchical")
                    results.append((f"{name} {op} {dtype} count={count} returns its array", out is got, ""))
                    check(group, f"{name} {op} {dtype} count={count}", x, got, op)
        xs = [data(count, "float64") for count in (1001, 7, 30_011)]  # three calls in flight at once
        works = [dist.all_reduce(x.copy(), "avg", group=group, algorithm="hierarchical", async_op=True) for x in xs]
        for i, (x, work) in enumerate(zip(xs, works)):
            check(group, f"{name} async {i} count={x.size}", x, work.wait(), "avg")

    # what "auto" picks, and that a call naming no algorithm runs it
    chosen = {"world": dist.choose_all_reduce("auto", world, 1 << 20),
              "subgroup": dist.choose_all_reduce("auto", subgroup, 1 << 20),
              "alternate": dist.choose_all_reduce("auto", world.split(color=world.rank % 2), 1 << 20)}
    traffic.reset()
    dist.all_reduce(np.ones(10))
    chosen["world call kinds"] = sorted(k for k in traffic.snapshot() if k.startswith("all_reduce."))

    # traffic of one hierarchical and one flat ring all-reduce of TRAFFIC_COUNT float64
    counted = {}
    for algorithm in ["hierarchical", "ring"]:
        traffic.reset()
        dist.all_reduce(np.ones(TRAFFIC_COUNT), algorithm=algorithm)
        counted[algorithm] = traffic.snapshot()
    return results, chosen, counted


_cache = {}
LAYOUTS = {"2x2 tcp": (4, 2, True), "3+1": (4, [3, 1], False), "one node": (3, 1, False)}
# the quick tier launches 2 nodes x 2 ranks; the full tier each layout
LAUNCHES = [pytest.param(name, marks=[] if name == "2x2 tcp" else [pytest.mark.full]) for name in LAYOUTS]


def results_for(layout):
    if layout not in _cache:
        n, nodes, tcp = LAYOUTS[layout]
        _cache[layout] = run(check_hierarchical, n, 1234, nodes=nodes, tcp=tcp, timeout=120, echo=False)
    return _cache[layout]


def node_of(layout):
    """[node index of world rank r], and the ranks per node."""
    n, nodes, _ = LAYOUTS[layout]
    from minidist.comm.launch import ranks_per_node
    per_node = ranks_per_node(n, nodes)
    return [i for i, p in enumerate(per_node) for _ in range(p)], per_node


def tree_children(vr, p):
    """Children of node-rank vr in the binomial tree rooted at 0 over p ranks (algorithms.py)."""
    low = vr & -vr if vr else 1 << max(p - 1, 0).bit_length()
    return sum(1 for k in range(p.bit_length() + 1) if (1 << k) < low and vr + (1 << k) < p)


# ------------------------------------------------------------------- the tests

@pytest.mark.parametrize("layout", LAUNCHES)
def test_matches_mpi_allreduce(layout):
    per_rank = [res[0] for res in results_for(layout)]
    assert len(per_rank) == LAYOUTS[layout][0]
    cases = [(rank, case, detail) for rank, res in enumerate(per_rank) for case, ok, detail in res if not ok]
    checked = sum(len(res) for res in per_rank)
    assert checked >= LAYOUTS[layout][0] * 2 * 2 * 18 * len(COUNTS)
    assert not cases, f"{len(cases)} of {checked} cases failed, e.g. {cases[:5]}"


@pytest.mark.parametrize("layout, world", [("2x2 tcp", "hierarchical"),
                                           pytest.param("3+1", "hierarchical", marks=pytest.mark.full),
                                           pytest.param("one node", "shared_memory", marks=pytest.mark.full)])
def test_auto_picks_hierarchical_exactly_across_nodes_with_neighbours(layout, world):
    """auto: shared memory on one node; hierarchical across nodes when some node holds two or
    more of the group's ranks; else (one rank per node) the alpha-beta pick among messages."""
    node, _ = node_of(layout)
    chosen = [res[1] for res in results_for(layout)]
    assert len(chosen) == LAYOUTS[layout][0]
    for rank, c in enumerate(chosen):
        assert c["world"] == world
        # the subgroup of rank 2 alone never communicates; the others' spans nodes in 2x2 and 3+1
        if rank != 2:
            members = [r for r in range(len(node)) if r != 2]
            spans = len({node[r] for r in members}) > 1
            assert c["subgroup"] == ("hierarchical" if spans else "shared_memory")
        # split by rank parity: {0, 2} and {1, 3}
        members = [r for r in range(len(node)) if r % 2 == rank % 2]
        nodes = [node[r] for r in members]
        if len(set(nodes)) == 1:
            assert c["alternate"] == "shared_memory"
        elif max(nodes.count(i) for i in set(nodes)) > 1:
            assert c["alternate"] == "hierarchical"
        else:  # one rank per node: the alpha-beta pick among message algorithms
            assert c["alternate"] == cost_pick(len(members))
        expected_kind = {"hierarchical": ["all_reduce.hierarchical", "all_reduce.hierarchical.between_nodes"],
                         "shared_memory": ["all_reduce.shared_memory"]}[world]
        leads = node.index(node[rank]) == rank
        kinds = c["world call kinds"]
        assert kinds == (expected_kind if leads or world != "hierarchical" else expected_kind[:1])


def cost_pick(n):
    from minidist.comm.collectives import auto_algorithm
    return auto_algorithm(1 << 20, n)


@pytest.mark.parametrize("layout", LAUNCHES)
def test_traffic_matches_formula(layout):
    """Inside a node: the tree reduce sends S from every rank but the leader, the tree broadcast
    S to each child, so rank v of a node of p sends S (v > 0) + S x children(v) and receives the
    same. Between nodes: only the leaders, a ring over the L leaders, 2S - c_j - c_{j+1} bytes
    (c: the leaders' chunk bytes), summing to cost.bytes_between_nodes."""
    node, per_node = node_of(layout)
    L, S = len(per_node), TRAFFIC_COUNT * 8
    counted = [res[2]["hierarchical"] for res in results_for(layout)]
    assert len(counted) == LAYOUTS[layout][0]
    c = [(b - a) * 8 for a, b in chunk_bounds(TRAFFIC_COUNT, L)]
    between_total = 0
    for rank, t in enumerate(counted):
        first = node.index(node[rank])
        vr, p = rank - first, per_node[node[rank]]
        inside = S * (vr > 0) + S * tree_children(vr, p)
        assert t["all_reduce.hierarchical"]["bytes_sent"] == inside
        assert t["all_reduce.hierarchical"]["bytes_received"] == inside
        assert t["all_reduce.hierarchical"]["calls"] == 1
        between = t.get("all_reduce.hierarchical.between_nodes", {"bytes_sent": 0, "bytes_received": 0})
        j = node[rank]
        expected = 2 * S - c[j] - c[(j + 1) % L] if vr == 0 and L > 1 else 0
        assert between["bytes_sent"] == expected
        assert between["bytes_received"] == (2 * S - c[j] - c[(j - 1) % L] if expected else 0)
        between_total += between["bytes_sent"]
    if len(set(per_node)) == 1:  # the model's uniform layout
        assert between_total == cost.bytes_between_nodes("hierarchical", per_node[0], L, S)


def test_flat_ring_sends_more_between_nodes_measured():
    """The flat ring's bytes between nodes (those sent by ranks whose right neighbour lives on
    another node) against the formula, and against the hierarchical all-reduce's, on 2x2."""
    node, per_node = node_of("2x2 tcp")
    n, L, S = len(node), len(per_node), TRAFFIC_COUNT * 8
    counted = [res[2]["ring"]["all_reduce.ring"] for res in results_for("2x2 tcp")]
    assert len(counted) == n
    crossing = sum(t["bytes_sent"] for r, t in enumerate(counted) if node[r] != node[(r + 1) % n])
    assert crossing == cost.bytes_between_nodes("ring", per_node[0], L, S) == 3 * S
    hierarchical = [res[2]["hierarchical"] for res in results_for("2x2 tcp")]
    between = sum(t.get("all_reduce.hierarchical.between_nodes", {}).get("bytes_sent", 0) for t in hierarchical)
    assert between == 2 * S < crossing


# ------------------------------------------------------------------- the two-level model

def test_two_level_model():
    S = 64 << 20
    fast, slow = dict(alpha_inside=1e-6, beta_inside=0.1e-9), dict(alpha_between=20e-6, beta_between=1e-9)
    # one node: the flat ring is the one-level ring on the inside link; hierarchical is the tree
    assert cost.predict_two_level("ring", 4, 1, S, **fast, **slow) == pytest.approx(
        cost.predict("all_reduce", "ring", 4, S, 1e-6, 0.1e-9))
    assert cost.predict_two_level("hierarchical", 4, 1, S, **fast, **slow) == pytest.approx(
        cost.predict("all_reduce", "tree", 4, S, 1e-6, 0.1e-9))
    # bytes between machines: L x 2(N-1)/N S against L x 2(L-1)/L S
    for p, L in [(2, 2), (4, 2), (8, 4)]:
        n = p * L
        ring, hier = (cost.bytes_between_nodes(a, p, L, S) for a in ("ring", "hierarchical"))
        assert ring == pytest.approx(L * 2 * (n - 1) / n * S)
        assert hier == pytest.approx(2 * (L - 1) * S)
        assert hier < ring
        assert cost.bytes_between_nodes("ring", p * L, 1, S) == 0.0
    # large arrays: hierarchical wins on 2x2 exactly when beta_between > 4 beta_inside
    for ratio, wins in [(3.0, False), (5.0, True), (50.0, True)]:
        slow_b = dict(alpha_between=20e-6, beta_between=ratio * 0.1e-9)
        t_ring = cost.predict_two_level("ring", 2, 2, S, **fast, **slow_b)
        t_hier = cost.predict_two_level("hierarchical", 2, 2, S, **fast, **slow_b)
        assert (t_hier < t_ring) == wins, ratio
    # small arrays: fewer steps between machines, 2(L-1) instead of 2(N-1)
    t_ring = cost.predict_two_level("ring", 4, 2, 8, **fast, **slow)
    t_hier = cost.predict_two_level("hierarchical", 4, 2, 8, **fast, **slow)
    assert t_hier < t_ring
    (k_in, _), (k_out, b_out), _ = cost.two_level_terms("hierarchical", 4, 2, S)
    assert (k_in, k_out, b_out) == (4, 2, S)
    with pytest.raises(ValueError, match="tree"):
        cost.two_level_terms("tree", 2, 2, S)
