"""Hidden checks of one_f_one_b and in_1f1b_order (chapter 5): pipeline depths and micro-batch counts
the visible tests do not use (one stage, fewer micro-batches than stages, up to 8 stages). Each
case checks the whole behaviour on its layout: every rank's order of forwards and backwards
written out, a correct pipeline step, the activations held, a warm-up count passed by the caller
(clamped to 0..m), and interleaved 1F1B, which walks its virtual micro-batches in the same order."""
import pytest

from minidist.parallel import schedules as S

LAYOUTS = [(1, 5), (2, 3), (2, 5), (2, 7), (3, 2), (3, 5), (3, 6), (3, 9), (4, 12), (5, 1), (5, 2), (5, 4),
           (5, 5), (5, 7), (5, 10), (5, 16), (6, 3), (6, 6), (6, 11), (6, 12), (7, 2), (7, 6), (7, 7), (7, 14),
           (7, 20), (8, 3), (8, 8), (8, 16)]


def written_out(count: int, warmup: int) -> list[tuple[str, int]]:
    """1F1B on one stage: `warmup` forwards; then for each micro-batch j in turn, the next forward
    (while any is left) and backward j."""
    order = [(S.FORWARD, i) for i in range(warmup)]
    for j in range(count):
        if warmup + j < count:
            order.append((S.FORWARD, warmup + j))
        order.append((S.BACKWARD, j))
    return order


def compute(schedule) -> list[tuple[str, int]]:
    return [(ins.kind, ins.micro) for ins in schedule if ins.kind in (S.FORWARD, S.BACKWARD)]


@pytest.mark.parametrize("stages, microbatches", LAYOUTS)
def test_one_f_one_b_on_a_layout(stages, microbatches):
    """On every rank r: min(p - r - 1, m) warm-up forwards, then one forward / one backward, then
    the cool-down, as written out; the ranks together make a correct pipeline step (matched
    messages, no deadlock) holding min(m, p - r) micro-batches' activations on rank r. A warm-up
    passed by the caller is taken (below 0 as 0, above m as m), and still makes a correct step.
    Interleaved 1F1B (2 and 3 chunks per rank, where m is a multiple of p) is correct and walks
    its virtual micro-batches in the same order, with its own warm-up."""
    p, m = stages, microbatches
    every = [list(S.one_f_one_b(r, p, m)) for r in range(p)]
    S.check(every)
    for r, schedule in enumerate(every):
        assert compute(schedule) == written_out(m, min(p - r - 1, m)), f"rank {r}"
        assert S.peak_in_flight(schedule) == min(m, p - r), f"rank {r}"
    for extra in (-3, 1, 2, m + 2):  # a warm-up passed by the caller: p - r - 1 + extra
        every = [list(S.one_f_one_b(r, p, m, warmup=p - r - 1 + extra)) for r in range(p)]
        S.check(every)
        for r, schedule in enumerate(every):
            taken = min(max(0, p - r - 1 + extra), m)
            assert compute(schedule) == written_out(m, taken), f"rank {r}, warm-up {p - r - 1 + extra}"
    if m % p == 0:
        for v in (2, 3):
            every = [list(S.interleaved(r, p, m, v)) for r in range(p)]
            S.check(every)
            for r, schedule in enumerate(every):
                warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)
                kinds = [kind for kind, _ in compute(schedule)]
                assert kinds == [kind for kind, _ in written_out(m * v, warmup)], f"rank {r}, v={v}"
