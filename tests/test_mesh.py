"""The device mesh (chapter 9): the pure layout, its checks, its command line, and its groups
under real mpiexec with 4 and 8 ranks."""
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.comm.launch import run
from minidist.core.model import GPTConfig
from minidist.parallel.mesh import axis_groups, check_mesh, coordinates, format_table, layout, rank_of

FACTORISATIONS = [  # (world, dp, tp, pp)
    (1, 1, 1, 1),
    (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2),
    (4, 2, 2, 1), (4, 1, 2, 2), (4, 2, 1, 2), (4, 4, 1, 1), (4, 1, 1, 4),
    (8, 2, 2, 2), (8, 1, 2, 4), (8, 2, 1, 4), (8, 1, 8, 1), (8, 1, 1, 8),
]


def _partition(groups, ranks):
    """The distinct groups cover `ranks` exactly once each."""
    distinct = sorted(set(groups))
    flat = sorted(r for g in distinct for r in g)
    return flat == sorted(ranks)


@pytest.mark.parametrize("world,dp,tp,pp", FACTORISATIONS)
def test_layout_groups_partition_the_world(world, dp, tp, pp):
    table = layout(world, dp=dp, tp=tp, pp=pp)
    assert len(table) == world
    ranks = list(range(world))
    for rank, place in enumerate(table):
        assert place.rank == rank
        assert coordinates(rank, dp_size=dp, tp_size=tp) == (place.pp, place.dp, place.tp)
        assert rank_of(place.pp, place.dp, place.tp, dp_size=dp, tp_size=tp) == rank  # round trip
        assert 0 <= place.pp < pp and 0 <= place.dp < dp and 0 <= place.tp < tp
        # a rank's position in each group is its coordinate on that axis
        assert place.tp_group.index(rank) == place.tp
        assert place.dp_group.index(rank) == place.dp
        assert place.pp_group.index(rank) == place.pp
        # tensor-parallel ranks are consecutive
        assert place.tp_group == tuple(range(place.tp_group[0], place.tp_group[0] + tp))
        assert (len(place.dp_group), len(place.pp_group)) == (dp, pp)
    for name in ("tp_group", "dp_group", "pp_group"):
        assert _partition([getattr(p, name) for p in table], ranks), name
        for place in table:  # every member of my group holds the same group
            assert all(getattr(table[r], name) == getattr(place, name) for r in getattr(place, name))
    # the embedding group: first and last stage with the same (dp, tp); none on middle stages
    ends = [p.rank for p in table if p.pp in (0, pp - 1)]
    assert _partition([p.embedding for p in table if p.embedding is not None], ends)
    for place in table:
        if pp == 1:
            assert place.embedding == (place.rank,)
        elif place.pp in (0, pp - 1):
            assert place.embedding == (place.pp_group[0], place.pp_group[-1])
        else:
            assert place.embedding is None
    # every cell of the grid is one rank
    assert sorted((p.pp, p.dp, p.tp) for p in table) == sorted(np.ndindex(pp, dp, tp))


def test_layout_of_eight_ranks_is_megatrons():
    """dp=2, tp=2, pp=2: the grid Megatron-LM's tp-dp-pp order and PyTorch's row-major mesh give."""
    table = layout(8, dp=2, tp=2, pp=2)
    assert sorted({p.tp_group for p in table}) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert sorted({p.dp_group for p in table}) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert sorted({p.pp_group for p in table}) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    grid = np.arange(8).reshape(2, 2, 2)  # PyTorch: mesh[pp, dp, tp], row-major
    for p in table:
        assert grid[p.pp, p.dp, p.tp] == p.rank
    text = format_table(table)
    assert len(text.splitlines()) == 9
    assert text.splitlines()[8].split() == ["7", "1", "1", "1", "6,7", "5,7", "3,7", "3,7"]


CONFIG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16)


@pytest.mark.parametrize("kwargs,words", [
    (dict(world_size=4, dp=2, tp=1, pp=1), ["pp=1 x dp=2 x tp=1 = 2 ranks", "world has 4"]),
    (dict(world_size=8, dp=2, tp=2, pp=3), ["= 12 ranks", "world has 8"]),
    (dict(world_size=2, dp=0, tp=2, pp=1), ["dp must be an integer >= 1, got 0"]),
    (dict(world_size=3, dp=1, tp=3, pp=1, config=CONFIG), ["tp=3 does not divide n_head=4"]),
    (dict(world_size=4, dp=1, tp=1, pp=4, config=CONFIG), ["pp=4 stages but n_layer=2"]),
    (dict(world_size=2, dp=2, tp=1, pp=1, batch_size=5), ["global batch 5", "dp=2", "5 % 2 = 1"]),
    (dict(world_size=4, dp=2, tp=1, pp=2, batch_size=12, microbatches=4),
     ["batch of 6", "global 12 / dp=2", "4 micro-batches", "6 % 4 = 2"]),
    (dict(world_size=2, dp=1, tp=1, pp=2, batch_size=4, microbatches=0), ["microbatches must be", "got 0"]),
])
def test_check_names_the_numbers_in_one_line(kwargs, words):
    with pytest.raises(ValueError) as caught:
        check_mesh(**kwargs)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("device mesh: ")
    for word in words:
        assert word in message, (word, message)


def test_check_passes_a_good_mesh():
    check_mesh(8, dp=2, tp=2, pp=2, config=CONFIG, batch_size=8, microbatches=2)
    check_mesh(4, dp=1, tp=4, pp=1, config=CONFIG, batch_size=3, microbatches=3)
    with pytest.raises(ValueError, match="world has 4"):
        layout(4, dp=3)


def _cli(*arguments):
    return subprocess.run([sys.executable, "-m", "minidist.parallel.mesh", *arguments], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_prints_the_table():
    proc = _cli("--dp", "2", "--tp", "2", "--pp", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 10  # a title, a header, 8 ranks
    assert lines[2].split() == ["0", "0", "0", "0", "0,1", "0,2", "0,4", "0,4"]
    assert lines[9].split() == ["7", "1", "1", "1", "6,7", "5,7", "3,7", "3,7"]
    assert _cli("--tp", "2", "--pp", "3", "--world", "6").stdout.splitlines()[5].split()[-1] == "-"


@pytest.mark.parametrize("arguments,flag", [
    (["--dp", "0"], "--dp"), (["--tp", "x"], "--tp"), (["--pp", "-1"], "--pp"),
    (["--dp", "2", "--world", "3"], "--world"), (["--world", "0"], "--world"),
])
def test_cli_bad_value_fails_in_one_line(arguments, flag):
    proc = _cli(*arguments)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert flag in lines[0] and "error" in lines[0]
    assert proc.stdout == ""


# ----------------------------------------------------------------------------- under mpiexec

def mesh_program(shapes):
    """Build each (dp, tp, pp) mesh on the whole world; report its groups' members (as world
    ranks) and the all-reduce of the world rank over each group."""
    import minidist.comm as dist
    from minidist.parallel.mesh import DeviceMesh

    world = dist.get_world()
    out = []
    for dp, tp, pp in shapes:
        mesh = DeviceMesh(world, dp=dp, tp=tp, pp=pp)
        row = {"coordinate": mesh.coordinate}
        for axis in ("tp", "dp", "pp", "embedding"):
            group = mesh.get_group(axis)
            if group is None:
                row[axis] = None
                continue
            total = np.array([float(world.rank)])
            dist.all_reduce(total, group=group)
            row[axis] = (tuple(group.comm.allgather(world.rank)), group.rank, float(total[0]))
        out.append(row)
    return out


def _check_ranks(results, shapes):
    world = len(results)
    for i, (dp, tp, pp) in enumerate(shapes):
        table = layout(world, dp=dp, tp=tp, pp=pp)
        for rank, per_shape in enumerate(results):
            assert len(per_shape) == len(shapes)
            got, place = per_shape[i], table[rank]
            assert got["coordinate"] == (place.pp, place.dp, place.tp)
            for axis, members, position in (("tp", place.tp_group, place.tp), ("dp", place.dp_group, place.dp),
                                            ("pp", place.pp_group, place.pp),
                                            ("embedding", place.embedding, None)):
                if members is None:
                    assert got[axis] is None, (rank, axis)
                    continue
                expected_position = members.index(rank) if position is None else position
                assert got[axis] == (members, expected_position, float(sum(members))), (dp, tp, pp, rank, axis)


def test_mesh_groups_on_four_ranks():
    shapes = [(2, 2, 1), (1, 2, 2), (2, 1, 2)]
    results = run(mesh_program, 4, shapes, timeout=120)
    assert len(results) == 4
    _check_ranks(results, shapes)


@pytest.mark.full
def test_mesh_groups_on_eight_ranks():
    shapes = [(2, 2, 2), (1, 2, 4)]  # the second has middle stages (no embedding group)
    results = run(mesh_program, 8, shapes, timeout=120)
    assert len(results) == 8
    _check_ranks(results, shapes)
    assert results[2][1]["embedding"] is None and results[0][1]["embedding"][0] == (0, 6)


def placement_program(dp, tp, pp):
    from mpi4py import MPI

    import minidist.comm as dist
    from minidist.parallel.mesh import DeviceMesh

    mesh = DeviceMesh(dist.get_world(), dp=dp, tp=tp, pp=pp)
    on_my_node = mesh.tp_group.comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    return on_my_node, mesh.tp_group.size, [len(node) for node in dist.get_world().nodes()]


@pytest.mark.full
def test_tensor_parallel_ranks_share_a_node_on_two_nodes():
    """Ranks fill each machine in turn and tp ranks are adjacent: with 2 ranks per machine, every
    tp=2 group lies inside one machine (chapter 7: its all-reduces stay off the slow links)."""
    results = run(placement_program, 4, 2, 2, 1, nodes=2, timeout=120)
    assert len(results) == 4
    for on_my_node, tp_size, nodes in results:
        assert nodes == [2, 2]
        assert tp_size == 2 and on_my_node == 2  # the whole tp group shares my node


# ----------------------------------------------------------------------------- named axes


def test_axis_groups_are_megatrons():
    """Megatron-LM's example in `parallel_state.initialize_model_parallel` (16 GPUs, tp 2, pp 4,
    hence dp 2): its tensor, pipeline and data groups, from the one function."""
    sizes = {"pp": 4, "dp": 2, "tp": 2}
    assert axis_groups(sizes, "tp") == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert axis_groups(sizes, "pp") == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    assert axis_groups(sizes, "dp") == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    # several axes flattened: the model-parallel group (tp x pp) and, with cp, dp x cp
    assert axis_groups(sizes, ("tp", "pp"))[0] == (0, 1, 4, 5, 8, 9, 12, 13)
    assert axis_groups({"dp": 2, "cp": 2, "tp": 2}, ("dp", "cp")) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    with pytest.raises(ValueError, match="no axis"):
        axis_groups(sizes, "xp")


@pytest.mark.parametrize("dp, cp, tp", [(2, 2, 1), (1, 4, 1), (2, 2, 2), (1, 2, 2)])
def test_context_parallel_axis_sits_between_dp_and_tp(dp, cp, tp):
    world = dp * cp * tp
    for place in layout(world, dp=dp, tp=tp, cp=cp):
        assert place.rank == (place.dp * cp + place.cp) * tp + place.tp  # tp fastest, then cp, then dp
        if cp > 1:
            assert place.cp_group.index(place.rank) == place.cp and len(place.cp_group) == cp


def expert_mesh_program(dp, ep):
    import minidist.comm as dist
    from minidist.parallel.mesh import DeviceMesh

    mesh = DeviceMesh(dist.get_world(), dp=dp, ep=ep)
    return {name: tuple(mesh[name].comm.allgather(dist.get_world().rank)) for name in ("ep", "expert_dp", "dp_cp")}


@pytest.mark.parametrize("world, ep", [(4, 2), pytest.param(4, 4, marks=pytest.mark.full),
                                       pytest.param(3, 1, marks=pytest.mark.full)])
def test_expert_groups_cut_the_dp_group_into_runs(world, ep):
    """Expert parallelism inside dp (as DeepSpeed-MoE and Megatron-Core place it): ep adjacent
    replicas share the experts, and the replicas of one expert shard lie ep apart."""
    results = run(expert_mesh_program, world, world, ep, timeout=120)
    for rank, groups in enumerate(results):
        assert groups["ep"] == tuple(range(rank // ep * ep, rank // ep * ep + ep))
        assert groups["expert_dp"] == tuple(range(rank % ep, world, ep))
        assert groups["dp_cp"] == tuple(range(world))
