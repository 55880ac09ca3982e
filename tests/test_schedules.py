"""Pipeline schedules checked as data, without MPI (chapter 5): order, matching, deadlock, bubble, memory."""
import pytest

from minidist.parallel.schedules import (BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, STEP, Deadlock, Instruction,
                                         all_ranks, bubble_fraction, bubble_theory, check, make_schedule,
                                         interleaved, one_f_one_b, peak_in_flight, simulate)

LAYOUTS = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", LAYOUTS)
def test_every_schedule_is_a_correct_pipeline_step(name, p, m):
    check(all_ranks(name, p, m))  # order, matching sends/receives, runs to the end


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", LAYOUTS)
def test_ideal_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    # forward 1, backward 2 (backward costs about twice the forward), messages free
    events = simulate(all_ranks(name, p, m), forward=1.0, backward=2.0)
    assert bubble_fraction(events) == pytest.approx(bubble_theory(p, m), abs=1e-12)
    span = max(e[3] for ev in events for e in ev)
    assert span == pytest.approx((m + p - 1) * 3.0)  # (m + p - 1) slots of forward + backward


@pytest.mark.parametrize("p, m", LAYOUTS)
def test_activations_held_gpipe_m_and_1f1b_p_minus_rank(p, m):
    for r in range(p):
        assert peak_in_flight(make_schedule("gpipe", r, p, m)) == m
        assert peak_in_flight(make_schedule("1f1b", r, p, m)) == min(m, p - r)


def test_1f1b_warmup_is_p_minus_rank_minus_1_forwards():
    p, m = 4, 8
    for r in range(p):
        s = make_schedule("1f1b", r, p, m)
        compute = [i for i in s if i.kind in (FORWARD, BACKWARD)]
        first_backward = next(k for k, i in enumerate(compute) if i.kind == BACKWARD)
        assert first_backward == p - r  # p - r - 1 warm-up forwards plus the first steady one
        steady = compute[first_backward - 1:first_backward - 1 + 2 * (m - (p - r - 1))]
        assert [i.kind for i in steady] == [FORWARD, BACKWARD] * (m - (p - r - 1))


def test_a_shorter_warmup_costs_time_a_longer_one_only_memory():
    p, m = 4, 8
    def variant(extra):
        s = [list(one_f_one_b(r, p, m, warmup=p - r - 1 + extra)) for r in range(p)]
        check(s)
        return bubble_fraction(simulate(s)), [peak_in_flight(x) for x in s]
    (b_short, _), (b, mem), (b_long, mem_long) = variant(-1), variant(0), variant(1)
    assert b == pytest.approx(bubble_theory(p, m))
    assert b_short > b + 0.1  # stages idle while waiting for the first gradient
    assert b_long == pytest.approx(b) and all(x > y for x, y in zip(mem_long, mem))


def test_1f1b_deadlocks_with_blocking_sends_but_not_with_posted_ones():
    schedules = all_ranks("1f1b", 2, 2)
    simulate(schedules)  # posted (isend) sends: fine
    with pytest.raises(Deadlock, match="rank 0 waits at send_act 1; rank 1 waits at send_grad 0"):
        simulate(schedules, blocking_sends=True)
    simulate(all_ranks("gpipe", 4, 4), blocking_sends=True)  # GPipe receives every forward first


def test_naive_model_parallelism_is_m_equals_1():
    assert all_ranks("gpipe", 3, 1) == all_ranks("1f1b", 3, 1)
    events = simulate(all_ranks("gpipe", 3, 1))
    # one rank works at a time: no two compute events overlap in time
    work = sorted((e[2], e[3]) for ev in events for e in ev if e[1] in (FORWARD, BACKWARD))
    assert all(a[1] <= b[0] for a, b in zip(work, work[1:]))
    assert bubble_fraction(events) == pytest.approx(2 / 3)


def test_check_rejects_broken_schedules():
    good = all_ranks("gpipe", 2, 2)
    backward_first = [list(good[0]), good[1]]
    f0, b0 = backward_first[0].index(Instruction(FORWARD, 0)), backward_first[0].index(Instruction(BACKWARD, 0))
    backward_first[0][f0], backward_first[0][b0] = backward_first[0][b0], backward_first[0][f0]
    with pytest.raises(ValueError, match="backward 0 before its forward"):
        check(backward_first)
    unmatched = [good[0], [i for i in good[1] if i != Instruction(RECV_ACT, 1)]]
    with pytest.raises(ValueError, match="send_act 1 is not matched"):
        check(unmatched)
    no_step = [good[0][:-1], good[1]]
    with pytest.raises(ValueError, match="optimizer step"):
        check(no_step)
    # both ranks receive before they send: each waits for the other forever
    cycle = [[Instruction(RECV_GRAD, 0), Instruction(FORWARD, 0), Instruction(SEND_ACT, 0),
              Instruction(BACKWARD, 0), Instruction(STEP)],
             [Instruction(RECV_ACT, 0), Instruction(FORWARD, 0), Instruction(BACKWARD, 0),
              Instruction(SEND_GRAD, 0), Instruction(STEP)]]
    with pytest.raises(Deadlock):
        check(cycle)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        make_schedule("zb", 0, 2, 2)
    with pytest.raises(ValueError, match="microbatches >= 1"):
        make_schedule("1f1b", 0, 2, 0)
    with pytest.raises(ValueError, match="0 <= rank < stages"):
        make_schedule("gpipe", 2, 2, 4)


# ----------------------------------------------------------------------------- interleaved 1F1B

INTERLEAVED = [(p, v, m) for p in (2, 4) for v in (2, 3) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p, v, m", INTERLEAVED)
def test_interleaved_is_a_correct_pipeline_step_with_a_smaller_bubble(p, v, m):
    schedules = all_ranks("interleaved", p, m, v)
    check(schedules)  # every (micro-batch, chunk) forward before its backward, sends matched, no deadlock
    for r, s in enumerate(schedules):  # rank r runs forward and backward of every micro-batch on each of its v chunks
        assert sorted((i.micro, i.chunk) for i in s if i.kind == FORWARD) == [(k, c) for k in range(m) for c in range(v)]
    # a chunk is 1/v of a stage: forward 1/v, backward 2/v (the bubble does not depend on the unit)
    events = simulate(schedules, forward=1.0 / v, backward=2.0 / v)
    assert bubble_theory(p, m, v) == (p - 1) / (v * m + p - 1)
    assert bubble_fraction(events) == pytest.approx(bubble_theory(p, m, v), abs=1e-12)
    span = max(e[3] for ev in events for e in ev)
    assert span == pytest.approx((m + (p - 1) / v) * 3.0)  # the fill and drain shrink v-fold, the work does not
    assert bubble_fraction(events) < bubble_fraction(simulate(all_ranks("1f1b", p, m)))
    for ratio in (1.0, 3.0):  # the formula holds for any ratio of backward to forward time
        assert bubble_fraction(simulate(schedules, forward=1.0, backward=ratio)) == pytest.approx(bubble_theory(p, m, v))


def test_interleaved_layout_messages_and_warmup():
    p, m, v = 2, 4, 2
    schedules = all_ranks("interleaved", p, m, v)
    # groups of p micro-batches go through chunk 0, then chunk 1; backwards take the chunks in reverse
    compute = [[repr(i) for i in s if i.kind in (FORWARD, BACKWARD)] for s in schedules]
    assert compute[0] == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3".split()
    assert compute[1] == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3".split()
    # the pipeline wraps around: the last rank's chunk 0 sends to rank 0's chunk 1, and back
    assert Instruction(SEND_ACT, 0, 0) in schedules[1] and Instruction(RECV_ACT, 0, 1) in schedules[0]
    assert Instruction(SEND_GRAD, 0, 1) in schedules[0] and Instruction(RECV_GRAD, 0, 0) in schedules[1]
    assert Instruction(RECV_ACT, 0, 0) not in schedules[0] and Instruction(SEND_ACT, 0, 1) not in schedules[1]
    # v times the activation messages of 1F1B: every chunk boundary is a message, p v - 1 per micro-batch
    sends = lambda s: sum(i.kind == SEND_ACT for r in s for i in r)
    assert sends(schedules) == m * (p * v - 1) and sends(all_ranks("1f1b", p, m)) == m * (p - 1)
    # warm-up (Megatron-LM): (v - 1) p + 2 (p - r - 1) forwards before the steady state
    for p, v, m in [(4, 2, 8), (4, 3, 8)]:
        for r, s in enumerate(all_ranks("interleaved", p, m, v)):
            kinds = [i.kind for i in s if i.kind in (FORWARD, BACKWARD)]
            assert kinds.index(BACKWARD) == (v - 1) * p + 2 * (p - r - 1) + 1  # warm-up, then one steady forward
            # activations held, in (micro-batch, chunk) pairs of 1/v stage each: rank 0 holds p + (p - 1)/v stages' worth
            assert peak_in_flight(s) == min((v - 1) * p + 2 * (p - r - 1) + 1, m * v)


def test_interleaved_warmup_one_fewer_is_enough_with_free_messages():
    """Megatron-LM's warm-up keeps one forward more than the ideal timings need on every rank but
    the last: one fewer gives the same bubble with one chunk of activations less; two fewer stalls."""
    p, m, v = 4, 8, 2
    def variant(extra):
        s = [list(interleaved(r, p, m, v, warmup=(v - 1) * p + 2 * (p - r - 1) + (extra if r < p - 1 else 0)))
             for r in range(p)]
        check(s)
        return bubble_fraction(simulate(s)), [peak_in_flight(x) for x in s]
    (b2, _), (b1, mem1), (b0, mem0) = variant(-2), variant(-1), variant(0)
    assert b0 == pytest.approx(bubble_theory(p, m, v)) and b1 == pytest.approx(b0) and b2 > b0 + 0.1
    assert mem1 == [x - 1 for x in mem0[:-1]] + mem0[-1:]


def test_interleaved_needs_m_a_multiple_of_p():
    with pytest.raises(ValueError, match=r"m=6 is not a multiple of pp=4 \(6 % 4 = 2\)"):
        make_schedule("interleaved", 0, 4, 6, 2)
    with pytest.raises(ValueError, match="virtual_stages >= 1"):
        make_schedule("interleaved", 0, 2, 2, 0)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule 'interleaved'"):
        make_schedule("1f1b", 0, 2, 2, 2)
    # v = 1 is a plain pipeline: the bubble of 1F1B (with Megatron's longer warm-up)
    assert bubble_fraction(simulate(all_ranks("interleaved", 4, 8, 1))) == pytest.approx(bubble_theory(4, 8))
