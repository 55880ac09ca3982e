"""Hidden checks of the loss scaler's update (chapter 10): other growth and backoff factors and
intervals, factors that are not powers of two (every scale is a float32 value), overflows in
the middle of a count, and growth near the largest float32.

Worked by the rule: an overflow multiplies the scale by backoff and restarts the count; after
`growth_interval` clean steps in a row the scale is multiplied by growth and the count restarts;
each product is taken in float64 and rounded to float32, and a growth whose rounded product is
inf leaves the scale where it was (the count restarts all the same)."""
import numpy as np
import pytest

from minidist.precision.loss_scale import DynamicLossScaler

FP32_MAX = float(np.finfo(np.float32).max)  # (2 - 2^-23) x 2^127


def run(scaler, flags):
    scales, trackers = [], []
    for found_inf in flags:
        scaler.update(found_inf)
        scales.append(scaler.scale)
        trackers.append(scaler.growth_tracker)
    return scales, trackers


def by_the_rule(init, growth, backoff, interval, flags):
    """The scales and counts the rule gives, step by step, written out with NumPy's float32."""
    with np.errstate(over="ignore"):
        scale, count, scales, counts = float(np.float32(init)), 0, [], []
        for overflow in flags:
            if overflow:
                scale, count = float(np.float32(scale * backoff)), 0
            else:
                count += 1
                if count == interval:
                    grown, count = np.float32(scale * growth), 0
                    scale = float(grown) if np.isfinite(grown) else scale
            scales.append(scale)
            counts.append(count)
    return scales, counts


def test_growth_every_clean_step_and_a_quarter_on_overflow():
    """Interval 1: every clean step grows (x4), an overflow divides by 4."""
    scaler = DynamicLossScaler(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=1)
    # clean: 8 -> 32 -> 128; overflow: 128 -> 32; clean: 32 -> 128
    assert run(scaler, [False, False, True, False]) == ([32.0, 128.0, 32.0, 128.0], [0, 0, 0, 0])


def test_an_overflow_restarts_the_count():
    """Interval 3: two clean steps, an overflow (halved, count 0), then three clean steps grow."""
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    # F F T: two clean steps counted, then halved and the count restarts; F F F: grows on the third
    assert run(scaler, [False, False, True, False, False, False]) == (
        [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**10], [1, 2, 0, 1, 2, 0])


def test_an_overflow_on_the_step_that_would_grow():
    """Interval 2, x8 and /8: F T backs off instead of growing; F F then grows once, from there."""
    scaler = DynamicLossScaler(init_scale=64.0, growth_factor=8.0, backoff_factor=0.125, growth_interval=2)
    assert run(scaler, [False, True, False, True, False, False, False]) == (
        [64.0, 8.0, 8.0, 1.0, 1.0, 8.0, 8.0], [1, 0, 1, 0, 1, 0, 1])


def test_factors_that_are_not_powers_of_two_round_to_float32():
    """1000.3 x 1.1, x 1.1, x 0.7: each scale the float32 nearest the float64 product of the
    last one, never the float64 product itself."""
    scaler = DynamicLossScaler(init_scale=1000.3, growth_factor=1.1, backoff_factor=0.7, growth_interval=1)
    scales, trackers = run(scaler, [False, False, True])
    first = float(np.float32(float(np.float32(1000.3)) * 1.1))
    second = float(np.float32(first * 1.1))
    assert scales == [first, second, float(np.float32(second * 0.7))] and trackers == [0, 0, 0]
    assert scales[0] != float(np.float32(1000.3)) * 1.1  # the float64 product is not kept


def test_growth_near_the_largest_float32():
    """x3 from 2^126 gives 1.5 x 2^127 (finite), then 4.5 x 2^127 (inf in float32): it stays,
    and the count restarts each time. A product just above the largest float32, within half a
    unit of it, rounds down to the largest: that growth happens."""
    scaler = DynamicLossScaler(init_scale=2.0**126, growth_factor=3.0, growth_interval=2)
    assert run(scaler, [False] * 6) == ([2.0**126, 1.5 * 2.0**127] * 1 + [1.5 * 2.0**127] * 4, [1, 0, 1, 0, 1, 0])
    scaler = DynamicLossScaler(init_scale=2.0**127, growth_factor=2 - 2.0**-23 + 2.0**-26, growth_interval=1)
    assert 2.0**127 * scaler.growth_factor > FP32_MAX
    assert run(scaler, [False, False]) == ([FP32_MAX, FP32_MAX], [0, 0])
    assert run(scaler, [True]) == ([float(np.float32(FP32_MAX * 0.5))], [0])


@pytest.mark.parametrize("seed", range(8))
def test_long_runs_with_odd_factors_near_the_top(seed):
    """40 steps from a scale one or two growths below the largest float32, with factors that are
    not powers of two and intervals 2 to 4: clean steps first (growth until it would reach inf),
    then overflows at random (a third of the steps), some in the middle of a count. The rule,
    step by step."""
    rng = np.random.default_rng(seed)
    growth, backoff, interval = float(rng.uniform(1.2, 3.0)), float(rng.uniform(0.3, 0.9)), int(rng.integers(2, 5))
    init = FP32_MAX / growth ** float(rng.uniform(0.2, 1.5))
    flags = [False] * (2 * interval + 1) + [bool(f) for f in rng.random(40 - 2 * interval - 1) < 1 / 3]
    scaler = DynamicLossScaler(init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    got = run(scaler, flags)
    assert got == by_the_rule(init, growth, backoff, interval, flags), (init, growth, backoff, interval, flags)
    assert all(np.isfinite(got[0])) and all(s == float(np.float32(s)) for s in got[0])
