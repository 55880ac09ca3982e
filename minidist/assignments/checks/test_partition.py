"""Graded check for the layer partition (chapter 4): every model depth and stage count from 1 to 12,
against the rule: consecutive ranges that cover every block once, sizes differing by at most one,
the first n_layer % p stages the ones with a block more (the last stage, which also runs the head
and the loss, stays light)."""
import pytest

from minidist.parallel.pipeline_stage import partition


@pytest.mark.parametrize("n_layer", range(1, 13))
def test_ranges_are_consecutive_balanced_and_front_loaded(n_layer):
    for stages in range(1, n_layer + 1):
        ranges = partition(n_layer, stages)
        assert len(ranges) == stages
        assert ranges[0][0] == 0 and ranges[-1][1] == n_layer
        assert all(end == start for (_, end), (start, _) in zip(ranges, ranges[1:]))  # consecutive
        sizes = [end - start for start, end in ranges]
        extra = n_layer % stages
        assert sizes == [n_layer // stages + 1] * extra + [n_layer // stages] * (stages - extra), (n_layer, stages)
