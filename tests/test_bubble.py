"""Where the bubble comes from (minidist/parallel/bubble.py, chapter 5): the schedule re-run with a
step's own costs. Checked on tables whose bubble is known by hand, and on a real 2-rank run
(the replay is computed from the run's own records: every key is there, in range)."""
import numpy as np
import pytest

from minidist.parallel import bubble
from minidist.parallel import schedules as S


def table(p, m, forward, backward, engine=0.0, v=1):
    """A cost table (p, v, 2, m, 2): the same compute on every micro-batch, `engine` after each."""
    costs = np.zeros((p, v, 2, m, 2))
    for r in range(p):
        costs[r, :, 0, :, bubble.COMPUTE] = forward[r]
        costs[r, :, 1, :, bubble.COMPUTE] = backward[r]
    costs[..., bubble.ENGINE] = engine
    return costs


@pytest.mark.parametrize("schedule, p, m", [("gpipe", 2, 4), ("1f1b", 2, 8), ("1f1b", 4, 4), ("gpipe", 3, 1)])
def test_equal_stages_free_messages_give_the_formula(schedule, p, m):
    costs = table(p, m, [1.0] * p, [2.0] * p)
    plans = S.all_ranks(schedule, p, m)
    assert bubble.stage_bubble(plans, costs) == pytest.approx(S.bubble_theory(p, m))
    assert bubble.replayed_bubble(plans, costs, 0.0) == pytest.approx(S.bubble_theory(p, m))
    assert bubble.replayed_bubble(plans, costs, 0.0, each=False) == pytest.approx(S.bubble_theory(p, m))


def test_a_slow_last_stage_by_hand():
    # p = 2, m = 1: F0 (1), F1 (3), B1 (3), B0 (1): span 8, busy 8 of 16
    costs = table(2, 1, [1.0, 3.0], [1.0, 3.0])
    assert bubble.stage_bubble(S.all_ranks("1f1b", 2, 1), costs) == pytest.approx(0.5)
    # GPipe, m = 2, rank 0 costs 1 a piece, rank 1 costs 2: rank 1 computes F0 F1 B0 B1 from 1 to 9,
    # rank 0's B1 follows rank 1's last backward: span 10, busy 4 + 8 = 12 of 20
    costs = table(2, 2, [1.0, 2.0], [1.0, 2.0])
    assert bubble.stage_bubble(S.all_ranks("gpipe", 2, 2), costs) == pytest.approx(1 - 12 / 20)


def test_messages_and_the_engine_lengthen_the_span_not_the_work():
    # p = 2, m = 1, every piece 1 s of compute + 0.25 s of engine, each receive 0.5 s:
    # F0 + engine, receive, F1 + engine, B1 + engine, receive, B0: span 1.25 + .5 + 1.25 + 1.25 + .5 + 1
    costs = table(2, 1, [1.0, 1.0], [1.0, 1.0], engine=0.25)
    costs[0, 0, 1, 0, bubble.ENGINE] = 0.0  # the rank's last compute: the span ends there
    costs[1, 0, 1, 0, bubble.ENGINE] = 0.0
    span = 1.25 + 0.5 + 1.25 + 1.0 + 0.5 + 1.0
    assert bubble.replayed_bubble(S.all_ranks("1f1b", 2, 1), costs, 0.5) == pytest.approx(1 - 4 / (2 * span))


def test_the_receive_cost_is_what_a_message_took_beyond_its_sender():
    posted = {0: 10.0, 2: 20.0, 5: 30.0}
    received = {0: (9.0, 10.5), 2: (21.0, 21.25), 5: (29.0, 30.75)}  # waited for the sender, arrived later
    rows = bubble.message_times(posted, {}, 8) + bubble.message_times({}, received, 8)  # two ranks' rows
    assert bubble.receive_seconds(rows) == pytest.approx(0.5)  # median of 0.5, 0.25, 0.75
    assert bubble.receive_seconds(np.zeros((4, 3))) == 0.0


def test_engine_time_is_the_gap_to_the_next_event_and_none_after_the_last():
    events = [("forward 0", "forward", 0.0, 1.0), ("recv grad 0", "wait", 1.2, 3.0),
              ("backward 0", "backward", 3.1, 4.0), ("wait sends", "wait", 4.5, 4.6)]
    costs = bubble.instruction_costs(events, [(0, 0, 0, 0), (0, 1, 0, 2)], 1, (2, 1, 2, 1, 2))
    assert costs[1, 0, 0, 0].tolist() == pytest.approx([1.0, 0.2])
    assert costs[1, 0, 1, 0].tolist() == pytest.approx([0.9, 0.0])
    assert not costs[0].any()


def test_the_pipeline_yardsticks_on_a_real_two_rank_run():
    """bench plan's engine yardstick under mpiexec: the engine's gap after a pass is short, the time
    from the drain to the step's end (the tied embedding's exchange, the norm's all-reduce, AdamW,
    the report) longer, and both are positive and well under a second on this tiny model."""
    from minidist.bench._yardsticks import time_pipeline_engine
    from minidist.comm.launch import run
    from minidist.core.model import GPTConfig
    config = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
    engine, drain = run(time_pipeline_engine, 2, config, 4, 2, 3, timeout=120)[0]
    assert 0.0 < engine < drain < 1.0


def test_the_message_yardstick_on_a_real_two_rank_run():
    """bench plan's message yardstick under mpiexec, at two sizes: a message waited for is noticed
    after its send (on the shared clock, later, and long before the sender's 5 ms of compute would
    pass again), and one posted before its receiver got there costs the receive far less than the
    millisecond the receiver was busy (it never waits for the post)."""
    from minidist.bench._yardsticks import time_pipeline_message
    from minidist.comm.launch import run
    noticed, taken_in = run(time_pipeline_message, 2, [1 << 15, 1 << 19], 5, timeout=120)[0]
    assert [len(times) for times in noticed + taken_in] == [5, 5, 5, 5]
    for delays, costs in zip(noticed, taken_in):
        assert 0.0 < min(delays) and float(np.median(delays)) < 0.005
        assert 0.0 < min(costs) and float(np.median(costs)) < 0.001
