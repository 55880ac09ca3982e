"""Zero-bubble pipelines (chapter 11): ZB-H1 as data on chapter 5's simulator, its idle time against the formula."""
import pytest

from minidist.future.zero_bubble import (describe, idle_per_rank, idle_theory, in_flight, is_weight, simulate_split,
                                         span, zb_h1, zb_h1_ranks)
from minidist.parallel.schedules import BACKWARD, FORWARD, bubble_fraction, make_schedule

TIMES = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0)]


def one_f_one_b(p, m):
    return [make_schedule("1f1b", r, p, m) for r in range(p)]


@pytest.mark.parametrize("times", TIMES)
@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_idle_time_of_every_rank_is_the_formula(p, m, times):
    zb = idle_per_rank(simulate_split(zb_h1_ranks(p, m), *times))
    plain = idle_per_rank(simulate_split(one_f_one_b(p, m), *times))
    assert zb == pytest.approx([idle_theory(p, *times, split=True)] * p, abs=1e-12)       # (p-1)(F + B - W)
    assert plain == pytest.approx([idle_theory(p, *times, split=False)] * p, abs=1e-12)   # (p-1)(F + B + W)


def test_equal_times_leave_a_third_of_the_bubble():
    p, m = 4, 8
    zb, plain = simulate_split(zb_h1_ranks(p, m)), simulate_split(one_f_one_b(p, m))
    assert span(zb) == 3 * m + (p - 1) == 27 and span(plain) == 3 * (m + p - 1) == 33
    assert bubble_fraction(zb) == pytest.approx(3 / 27) and bubble_fraction(plain) == pytest.approx(3 / 11)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16)])
def test_each_micro_batch_runs_f_b_w_once_in_order_and_memory_stays_at_p(p, m):
    for rank, schedule in enumerate(zb_h1_ranks(p, m)):
        order = [("W" if is_weight(i) else i.kind, i.micro) for i in schedule if i.kind in (FORWARD, BACKWARD)]
        for micro in range(m):
            assert [kind for kind, i in order if i == micro] == [FORWARD, BACKWARD, "W"]
        assert in_flight(schedule) == p  # 1F1B's first stage holds p; no ZB-H1 rank holds more
    assert [in_flight(s) for s in one_f_one_b(p, m)] == [p - r for r in range(p)]


def test_rank_r_defers_r_weight_passes():
    assert describe(zb_h1_ranks(2, 4)) == ("rank 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3\n"
                                           "rank 1: F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3")
    assert describe([zb_h1(0, 1, 3)]) == "rank 0: F0 B0 W0 F1 B1 W1 F2 B2 W2"  # one stage: nothing to wait for


def test_formula_refuses_slow_weight_passes():
    with pytest.raises(ValueError, match="T_W <= T_B"):
        idle_theory(4, 1.0, 1.0, 2.0, split=True)
