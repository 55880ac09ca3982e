"""Hidden checks of the loss scaler's update (chapter 10): other growth and backoff factors and intervals.

Worked by the rule: an overflow multiplies the scale by backoff and restarts the count; after
`growth_interval` clean steps in a row the scale is multiplied by growth and the count restarts."""
from minidist.precision.loss_scale import DynamicLossScaler


def run(scaler, flags):
    scales, trackers = [], []
    for found_inf in flags:
        scaler.update(found_inf)
        scales.append(scaler.scale)
        trackers.append(scaler.growth_tracker)
    return scales, trackers


def test_growth_every_clean_step_and_a_quarter_on_overflow():
    scaler = DynamicLossScaler(init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=1)
    # clean: 8 -> 32 -> 128; overflow: 128 -> 32; clean: 32 -> 128
    assert run(scaler, [False, False, True, False]) == ([32.0, 128.0, 32.0, 128.0], [0, 0, 0, 0])


def test_an_overflow_restarts_the_count():
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    # F F T: two clean steps counted, then halved and the count restarts; F F F: grows on the third
    assert run(scaler, [False, False, True, False, False, False]) == (
        [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**10], [1, 2, 0, 1, 2, 0])
