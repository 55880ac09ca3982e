"""Hidden checks of the layer partition (chapter 4): deeper models than the visible tests (13 to
96 blocks) over every stage count, and a few layouts written out."""
import pytest

from minidist.parallel.pipeline_stage import partition


@pytest.mark.parametrize("n_layer", [13, 18, 25, 31, 48, 96])
def test_deep_models_over_every_stage_count(n_layer):
    """Every p from 1 to n_layer: p consecutive ranges covering the blocks, the first n_layer % p
    of them one block longer than the others."""
    for stages in range(1, n_layer + 1):
        ranges = partition(n_layer, stages)
        starts = [0] + [end for _, end in ranges[:-1]]
        assert [start for start, _ in ranges] == starts and ranges[-1][1] == n_layer, (n_layer, stages)
        base, extra = divmod(n_layer, stages)
        sizes = [end - start for start, end in ranges]
        assert sizes == [base + 1] * extra + [base] * (stages - extra), (n_layer, stages)


def test_layouts_written_out():
    """7 blocks over 3 stages, 30 over 4, 96 over 8, 10 over 6, and one stage or one block per stage."""
    assert partition(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert partition(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert partition(96, 8) == [(12 * r, 12 * r + 12) for r in range(8)]
    assert partition(10, 6) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9), (9, 10)]
    assert partition(5, 1) == [(0, 5)]
    assert partition(5, 5) == [(r, r + 1) for r in range(5)]
