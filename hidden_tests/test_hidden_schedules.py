"""Hidden checks of one_f_one_b (chapter 5): pipeline depths and micro-batch counts the visible tests do not use."""
import pytest

from minidist.parallel import schedules as S


@pytest.mark.parametrize("stages, microbatches", [(3, 5), (5, 3), (4, 7), (2, 1)])
def test_one_f_one_b_is_a_correct_pipeline_step(stages, microbatches):
    every = [list(S.one_f_one_b(rank, stages, microbatches)) for rank in range(stages)]
    S.check(every)  # each micro-batch forward then backward once, matched messages, no deadlock
    for rank, schedule in enumerate(every):
        kinds = [ins.kind for ins in schedule if ins.kind in (S.FORWARD, S.BACKWARD)]
        warmup = min(stages - rank - 1, microbatches)
        assert kinds[:warmup] == [S.FORWARD] * warmup  # p - rank - 1 forwards before the first backward
        assert S.peak_in_flight(schedule) == min(stages - rank, microbatches)
