"""Dynamic loss scaling (chapter 10): the rule by hand, the fp32 arithmetic, and torch's GradScaler.

The first tests need only NumPy: sequences derived by hand from the rule, the rounding of the
unscale, the errors. The tests marked "against PyTorch" drive `torch.amp.GradScaler` and
`DynamicLossScaler` with the same overflow pattern and compare every scale bit for bit; they are
skipped where torch is not installed (torch is a yardstick for these tests, never a dependency).
"""
from __future__ import annotations

import io

import ml_dtypes
import numpy as np
import pytest

from minidist.precision.loss_scale import DynamicLossScaler, non_finite
from minidist.core.tensor import Tensor

F, T = False, True


def drive(scaler: DynamicLossScaler, flags, grad=(1.0, 2.0, 3.0, 4.0), bad=None):
    """Run the scaler through `flags` (True: that step's gradient holds inf or NaN).

    Each step makes the scaled gradient scale * grad in float32 (what backward of scale * loss
    gives), poisons one entry where flagged, unscales, and updates. Returns the scales after each
    update, the skipped steps and the unscaled gradients."""
    base = np.asarray(grad, dtype=np.float32)
    scales, skipped, grads = [], [], []
    for step, flag in enumerate(flags):
        with np.errstate(over="ignore"):  # a scale near fp32's top overflows for real: that is the point
            g = np.float32(scaler.scale) * base
        if flag:
            g[step % g.size] = np.inf if bad is None else bad[step]
        found_inf = scaler.unscale_([g])
        if scaler.should_skip(found_inf):
            skipped.append(step)
        scaler.update(found_inf)
        scaler.record(step, scaler.should_skip(found_inf))
        scales.append(scaler.scale)
        grads.append(g)
    return scales, skipped, grads


# ----------------------------------------------------------------------------- the rule by hand


def test_hand_derived_sequence():
    # growth_interval 3, S = 2^16. After each update (tracker = clean steps since the last change):
    # step 0 F: tracker 1                        S = 2^16
    # step 1 F: tracker 2                        S = 2^16
    # step 2 F: tracker 3 = interval -> grow     S = 2^17, tracker 0
    # step 3 T: skip, back off                   S = 2^16, tracker 0
    # step 4 F: tracker 1                        S = 2^16
    # step 5 F: tracker 2                        S = 2^16
    # step 6 F: tracker 3 -> grow                S = 2^17, tracker 0
    # step 7 F: tracker 1                        S = 2^17
    # step 8 T: skip, back off                   S = 2^16, tracker 0
    # step 9 T: skip, back off                   S = 2^15, tracker 0
    flags = [F, F, F, T, F, F, F, F, T, T]
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=3)
    trackers = []
    for found_inf in flags:
        scaler.update(found_inf)
        trackers.append(scaler.growth_tracker)
    assert trackers == [1, 2, 0, 0, 1, 2, 0, 1, 0, 0]

    scales, skipped, grads = drive(DynamicLossScaler(init_scale=2.0**16, growth_interval=3), flags)
    assert scales == [2.0**16, 2.0**16, 2.0**17, 2.0**16, 2.0**16, 2.0**16, 2.0**17, 2.0**17,
                      2.0**16, 2.0**15]
    assert skipped == [3, 8, 9]
    for step, g in enumerate(grads):  # a power-of-two scale unscales exactly
        if step not in skipped:
            np.testing.assert_array_equal(g, np.float32([1, 2, 3, 4]))


def test_growth_stops_at_the_largest_float32():
    # fp32 max is (2 - 2^-23) * 2^127 ~ 3.40e38. From 2^127 (~1.70e38):
    # growth 2 gives 2^128 = inf in fp32, so the scale stays 2^127 (and the tracker restarts);
    scaler = DynamicLossScaler(init_scale=2.0**127, growth_interval=1)
    scaler.update(False)
    assert (scaler.scale, scaler.growth_tracker) == (2.0**127, 0)
    # growth 1.5 gives 1.5 * 2^127 ~ 2.55e38 (finite, exact in fp32), then 2.25 * 2^127 ~ 3.8e38
    # (inf in fp32): one growth, then none.
    scaler = DynamicLossScaler(init_scale=2.0**127, growth_factor=1.5, growth_interval=1)
    scaler.update(False)
    assert scaler.scale == 1.5 * 2.0**127
    scaler.update(False)
    assert scaler.scale == 1.5 * 2.0**127


def test_scale_is_float32():
    # 1000.3 is not a float32; the nearest one is 1000.29998779296875, and 0.7 times it rounds again
    scaler = DynamicLossScaler(init_scale=1000.3, backoff_factor=0.7)
    assert scaler.scale == 1000.29998779296875
    scaler.update(True)
    assert scaler.scale == float(np.float32(1000.29998779296875 * 0.7))
    assert scaler.scale != 1000.29998779296875 * 0.7  # the float64 product is not kept


def test_record_keeps_history():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    drive(scaler, [F, T, F, F])
    assert scaler.history == [(0, 8.0, False), (1, 4.0, True), (2, 4.0, False), (3, 8.0, False)]


# ----------------------------------------------------------------------------- unscale_


def test_unscale_float32_multiplies_by_float32_reciprocal():
    rng = np.random.default_rng(0)
    g = rng.standard_normal(1000).astype(np.float32) * 1000.3
    expected = g * np.float32(1 / 1000.3)
    scaler = DynamicLossScaler(init_scale=1000.3)
    assert scaler.inv_scale == np.float32(1 / 1000.3)
    ours = g.copy()
    assert scaler.unscale_([ours]) is False
    np.testing.assert_array_equal(ours, expected)
    # multiplying by the reciprocal is not dividing by the scale: some elements round differently
    assert np.any(ours != g / np.float32(scaler.scale))


def test_unscale_float16_goes_through_float32():
    rng = np.random.default_rng(1)
    S = 1000.3
    g = (rng.standard_normal(4000) * 30).astype(np.float16)
    inv = np.float32(1 / S)
    expected = (g.astype(np.float32) * inv).astype(np.float16)
    ours = g.copy()
    DynamicLossScaler(init_scale=S).unscale_([ours])
    assert ours.dtype == np.float16
    np.testing.assert_array_equal(ours, expected)
    # a float16 multiply would round twice (the reciprocal, then the product): it differs
    assert np.any(ours != g * np.float16(inv))


def test_unscale_float64_and_bfloat16():
    S = 1000.3
    inv = np.float32(1 / S)
    g64 = np.linspace(-5, 5, 101) * S
    ours = g64.copy()
    DynamicLossScaler(init_scale=S).unscale_([ours])
    np.testing.assert_array_equal(ours, g64 * np.float64(inv))  # the fp32 reciprocal, in float64
    assert np.any(ours != g64 * (1 / S))

    bf16 = np.dtype(ml_dtypes.bfloat16)
    g = (np.random.default_rng(2).standard_normal(2000) * 30).astype(bf16)
    ours = g.copy()
    assert DynamicLossScaler(init_scale=S).unscale_([ours]) is False
    assert ours.dtype == bf16
    np.testing.assert_array_equal(ours.astype(np.float32),
                                  (g.astype(np.float32) * inv).astype(bf16).astype(np.float32))
    ours[3] = np.nan
    assert non_finite([ours])


def test_found_inf_for_inf_and_nan():
    for bad in (np.inf, -np.inf, np.nan):
        grads = [np.ones(3, np.float32), None, np.array([1.0, bad, 2.0], np.float16)]
        assert DynamicLossScaler().unscale_(grads) is True
        assert non_finite(grads)
    assert not non_finite([np.ones(3), None])
    # a finite fp16 value that unscaling pushes past 65504 counts too (torch checks only before)
    g = np.array([60000.0, 1.0], np.float16)
    assert DynamicLossScaler(init_scale=0.5).unscale_([g]) is True
    assert np.isinf(g[0])


def test_unscale_twice_raises_until_update():
    scaler = DynamicLossScaler(init_scale=4.0)
    g = np.full(2, 8.0, np.float32)
    scaler.unscale_([g])
    message = r"unscale_\(\) has already been called .* since the last update\(\)"
    with pytest.raises(RuntimeError, match=message):
        scaler.unscale_([g])
    np.testing.assert_array_equal(g, [2.0, 2.0])  # the refused call did not unscale again
    scaler.update(False)
    scaler.unscale_([g])
    np.testing.assert_array_equal(g, [0.5, 0.5])


def test_bad_gradient_fails_before_any_work():
    g = np.full(2, 8.0, np.float32)
    scaler = DynamicLossScaler(init_scale=4.0)
    with pytest.raises(TypeError, match=r"grads\[1\] is int64"):
        scaler.unscale_([g, np.arange(3)])
    np.testing.assert_array_equal(g, [8.0, 8.0])
    scaler.unscale_([g])  # and the refused call did not count as an unscale
    np.testing.assert_array_equal(g, [2.0, 2.0])


def test_disabled_scaler_is_the_identity():
    scaler = DynamicLossScaler(init_scale=1024.0, enabled=False)
    assert scaler.scale == 1.0
    loss = Tensor(np.float32(3.0))
    assert scaler.scale_loss(loss) is loss
    g = np.array([3.0, np.inf], np.float32)
    for _ in range(2):  # no once-per-update rule either
        assert scaler.unscale_([g]) is True  # the flag still tells the truth
    np.testing.assert_array_equal(g, [3.0, np.inf])
    assert scaler.should_skip(True) is False
    scaler.update(True)
    assert (scaler.scale, scaler.growth_tracker) == (1.0, 0)


def test_scale_loss_scales_every_gradient():
    scaler = DynamicLossScaler(init_scale=2.0**10)
    w = Tensor(np.array([1.0, -2.0, 0.5], np.float32), requires_grad=True)
    scaler.scale_loss((w * w).sum()).backward()  # d/dw of S * sum(w^2) = 2 S w
    np.testing.assert_array_equal(w.grad, 2.0**11 * np.float32([1.0, -2.0, 0.5]))
    assert scaler.unscale_([w.grad]) is False
    np.testing.assert_array_equal(w.grad, [2.0, -4.0, 1.0])
    assert scaler.scale_loss(0.25) == 256.0


def test_scaling_rescues_a_gradient_float16_flushes_to_zero():
    true = np.array([1e-8, -2.5e-8, 2e-7])  # around fp16's smallest subnormal 2^-24 ~ 6.0e-8
    np.testing.assert_array_equal(true.astype(np.float16), [0, 0, 3 * 2.0**-24])  # lost, or 2 bits
    scaler = DynamicLossScaler(init_scale=2.0**16)  # 16 binades up: ~6.6e-4, normal fp16 numbers
    master = (true * scaler.scale).astype(np.float16).astype(np.float32)  # fp16 grads, fp32 master
    scaler.unscale_([master])
    assert np.max(np.abs(master - true) / np.abs(true)) < 2.0**-11  # fp16's rounding, no more


def test_settings_are_checked():
    for kwargs, message in [({"growth_factor": 1.0}, "growth_factor must be > 1.0, got 1.0"),
                            ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\), got 1.0"),
                            ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\), got 0.0"),
                            ({"growth_interval": 0}, "growth_interval must be an integer >= 1, got 0"),
                            ({"growth_interval": 2.5}, "got 2.5"),
                            ({"init_scale": 0.0}, "init_scale must be a positive finite number, got 0.0"),
                            ({"init_scale": np.inf}, "got inf")]:
        with pytest.raises(ValueError, match=message):
            DynamicLossScaler(**kwargs)


# ----------------------------------------------------------------------------- checkpoints


def test_state_dict_round_trip():
    flags = [F, F, T, F, F, F, F, T, F, F, F]
    scaler = DynamicLossScaler(init_scale=1000.3, growth_factor=1.7, backoff_factor=0.3,
                               growth_interval=3)
    drive(scaler, flags[:5])
    assert (scaler.scale, scaler.growth_tracker) != (float(np.float32(1000.3)), 0)
    buffer = io.BytesIO()  # through an .npz file, as a checkpoint stores it
    np.savez(buffer, **scaler.state_dict())
    buffer.seek(0)
    with np.load(buffer) as saved:
        state = dict(saved)
    restored = DynamicLossScaler()  # default settings, replaced by the saved ones
    restored.load_state_dict(state)
    assert restored.scale == scaler.scale and restored.growth_tracker == scaler.growth_tracker
    assert (restored.growth_factor, restored.backoff_factor, restored.growth_interval) == (1.7, 0.3, 3)
    assert drive(restored, flags[5:])[:2] == drive(scaler, flags[5:])[:2]


def test_load_state_dict_errors():
    state = DynamicLossScaler().state_dict()
    del state["growth_tracker"]
    with pytest.raises(ValueError, match=r"lacks \['growth_tracker'\]"):
        DynamicLossScaler().load_state_dict(state)
    with pytest.raises(ValueError, match="saved from a disabled scaler"):
        DynamicLossScaler().load_state_dict(DynamicLossScaler(enabled=False).state_dict())


# ----------------------------------------------------------------------------- against PyTorch


def overflow_flags(seed: int, steps: int = 60):
    """Random flags with runs: an overflow starts with p = 0.15 and continues with p = 0.6."""
    rng = np.random.default_rng(seed)
    flags, previous = [], False
    for _ in range(steps):
        previous = bool(rng.random() < (0.6 if previous else 0.15))
        flags.append(previous)
    bad = rng.choice([np.inf, -np.inf, np.nan], size=steps)
    return flags, bad


def torch_drive(torch, flags, bad, grad=(1.0, 2.0, 3.0, 4.0), **settings):
    """The same experiment with torch.amp.GradScaler, a real parameter and SGD."""
    p = torch.nn.Parameter(torch.zeros(len(grad)))
    weights = torch.tensor(grad)
    optimizer = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **settings)
    scales, skipped, grads = [], [], []
    for step, flag in enumerate(flags):
        optimizer.zero_grad()
        scaler.scale((p * weights).sum()).backward()  # p.grad = scale * weights
        if flag:
            with torch.no_grad():
                p.grad[step % len(grad)] = float(bad[step])
        before = p.detach().clone()
        scaler.unscale_(optimizer)
        grads.append(p.grad.numpy().copy())
        scaler.step(optimizer)
        scaler.update()
        if torch.equal(before, p.detach()):
            skipped.append(step)
        scales.append(scaler.get_scale())
    return scales, skipped, grads


SETTINGS = [
    (0, dict(init_scale=2.0**16, growth_interval=5)),
    (1, dict(init_scale=2.0**16, growth_interval=5)),
    (2, dict(init_scale=2.0**16, growth_interval=5)),
    (3, dict(init_scale=2.0**16, growth_interval=5)),
    (4, dict(init_scale=1000.3, growth_factor=1.7, backoff_factor=0.3, growth_interval=3)),
    (5, dict(init_scale=2.0**125, growth_interval=2)),  # 2^126 * 4 overflows fp32: real skips
]


@pytest.mark.parametrize("seed,settings", SETTINGS)
def test_against_torch_grad_scaler(seed, settings):
    torch = pytest.importorskip("torch", reason="torch.amp.GradScaler is the reference; torch is "
                                                "not a minidist dependency")
    flags, bad = overflow_flags(seed)
    assert 3 <= sum(flags) <= 40 and any(a and b for a, b in zip(flags, flags[1:]))  # runs occur
    t_scales, t_skipped, t_grads = torch_drive(torch, flags, bad, **settings)
    scales, skipped, grads = drive(DynamicLossScaler(**settings), flags, bad=bad)
    assert skipped == t_skipped
    assert set(skipped) >= {i for i, f in enumerate(flags) if f}  # plus real overflows near 2^128
    assert scales == t_scales  # exact: the same fp32 value at every step
    for ours, theirs in zip(grads, t_grads):
        np.testing.assert_array_equal(ours, theirs)  # the same unscaled bits (NaN where NaN)
    assert len(set(scales)) > 2  # the scale really moved both ways


def test_against_torch_unscale_kernel_low_precision():
    torch = pytest.importorskip("torch", reason="torch's unscale kernel is the reference; torch is "
                                                "not a minidist dependency")
    S = 1000.3
    inv = torch.full((), 1.0, dtype=torch.float64).div(torch.tensor(S, dtype=torch.float32).double()).float()
    assert inv.item() == float(DynamicLossScaler(init_scale=S).inv_scale)
    values = np.random.default_rng(3).standard_normal(5000) * 300
    for numpy_dtype, torch_dtype, bits in [(np.float16, torch.float16, np.int16),
                                           (np.dtype(ml_dtypes.bfloat16), torch.bfloat16, np.int16)]:
        g = values.astype(numpy_dtype)
        t = torch.from_numpy(g.view(bits).copy()).view(torch_dtype)
        found = torch.zeros((), dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_([t], found, inv)
        ours = g.copy()
        assert DynamicLossScaler(init_scale=S).unscale_([ours]) is (found.item() > 0) is False
        np.testing.assert_array_equal(ours.view(bits), t.view(torch.int16).numpy())
