"""Hidden checks of the mesh's groups and coordinates (chapter 9): the 36 meshes of up to 3
pipeline stages, 3 replicas and 2 tensor ranks with a context-parallel axis of 2 or 3 (the
visible tests have none), groups of several axes named in any order, axes left out of `sizes`,
and coordinates where every axis is above 1.

The expected groups are built here cell by cell from the row-major numbering over
(pp, dp, cp, tp), tp fastest, not by the same reshaping the library does."""
import itertools

import pytest

from minidist.parallel.mesh import AXES, axis_groups, coordinates, layout, rank_of

SHAPES = [(pp, dp, cp, tp) for pp in (1, 2, 3) for dp in (1, 2, 3) for cp in (2, 3) for tp in (1, 2)]
MANY = [("dp", "cp"), ("cp", "dp"), ("tp", "pp"), ("tp", "cp"), ("cp", "pp"), ("dp", "pp"), ("tp", "dp"),
        ("pp", "cp", "tp"), AXES, AXES[::-1], ()]  # flattened groups, the axes named in any order


def expected_groups(shape, vary):
    """Sorted groups of ranks that differ only along `vary`, each in ascending (world) order."""
    cells = list(itertools.product(*(range(s) for s in shape)))  # row-major: the rank is the index
    held = [i for i, axis in enumerate(AXES) if axis not in vary]
    groups = {}
    for rank, cell in enumerate(cells):
        groups.setdefault(tuple(cell[i] for i in held), []).append(rank)
    return sorted(tuple(g) for g in groups.values())


def ids(shape):
    return "pp{}-dp{}-cp{}-tp{}".format(*shape)


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_groups_coordinates_and_layout_of_a_mesh(shape):
    """For one pp x dp x cp x tp mesh: the groups of every axis and of several axes together
    (members in world order, the axes named in any order, size-1 axes left out of `sizes`),
    each rank's coordinates and rank_of back (pp x dp x tp, cp folded away), and the layout's
    places: coordinates, and groups in which a rank's index is its coordinate."""
    pp, dp, cp, tp = shape
    world = pp * dp * cp * tp
    sizes = {axis: s for axis, s in zip(AXES, shape) if s > 1}  # axes missing from it have size 1
    for vary in [*AXES, *MANY]:
        got = axis_groups(sizes, vary)
        assert sorted(got) == expected_groups(shape, (vary,) if isinstance(vary, str) else vary), (shape, vary)
        assert all(list(g) == sorted(g) for g in got), (shape, vary, got)
    for rank, cell in enumerate(itertools.product(range(pp), range(dp), range(tp))):
        assert coordinates(rank, dp_size=dp, tp_size=tp) == cell, (shape, rank)
        assert rank_of(*coordinates(rank, dp_size=dp, tp_size=tp), dp_size=dp, tp_size=tp) == rank
    table = layout(world, dp=dp, tp=tp, pp=pp, cp=cp)
    for rank, (place, cell) in enumerate(zip(table, itertools.product(*(range(s) for s in shape)), strict=True)):
        assert (place.pp, place.dp, place.cp, place.tp) == cell, (shape, rank)
        for axis, coordinate in zip(AXES, cell):
            group = getattr(place, f"{axis}_group")
            if axis == "cp" and cp == 1:
                assert group is None
                continue
            assert group.index(rank) == coordinate and group in expected_groups(shape, (axis,)), (shape, rank, axis)


def test_sixteen_ranks_with_every_axis_of_two_by_hand():
    """pp = dp = cp = tp = 2, written out: tp pairs adjacent, cp pairs 2 apart, dp pairs 4
    apart, pp pairs 8 apart, and dp x cp groups of four (the ranks gradients are averaged over)."""
    sizes = dict(pp=2, dp=2, cp=2, tp=2)
    assert axis_groups(sizes, "tp") == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert sorted(axis_groups(sizes, "cp")) == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]
    assert sorted(axis_groups(sizes, "dp")) == [(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]
    assert sorted(axis_groups(sizes, "pp")) == [(0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15)]
    assert sorted(axis_groups(sizes, ("cp", "dp"))) == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]
    assert [coordinates(r, dp_size=2, tp_size=4) for r in (0, 5, 11, 14)] == [(0, 0, 0), (0, 1, 1), (1, 0, 3), (1, 1, 2)]
