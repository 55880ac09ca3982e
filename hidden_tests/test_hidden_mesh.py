"""Hidden checks of the mesh's groups (chapter 9): meshes of 12 and 6 ranks, every axis above 1."""
import pytest

from minidist.parallel.mesh import layout, rank_of


@pytest.mark.parametrize("dp, tp, pp", [(3, 2, 2), (2, 3, 1), (1, 2, 3)])
def test_groups_hold_the_ranks_that_differ_along_one_axis(dp, tp, pp):
    world = dp * tp * pp
    table = layout(world, dp=dp, tp=tp, pp=pp)
    for place in table:
        assert place.tp_group == tuple(rank_of(place.pp, place.dp, t, dp_size=dp, tp_size=tp) for t in range(tp))
        assert place.dp_group == tuple(rank_of(place.pp, d, place.tp, dp_size=dp, tp_size=tp) for d in range(dp))
        assert place.pp_group == tuple(rank_of(p, place.dp, place.tp, dp_size=dp, tp_size=tp) for p in range(pp))
    for axis in ("tp_group", "dp_group", "pp_group"):  # each axis's groups partition the world
        groups = {getattr(place, axis) for place in table}
        assert sorted(r for g in groups for r in g) == list(range(world))
