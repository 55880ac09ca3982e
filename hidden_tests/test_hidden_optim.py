"""Hidden checks of AdamW's update (chapter 1), against the equations written out: other betas, large
weight decay and eps (where decay after the step, decay through the gradient or eps inside the
square root show), a late step with moments already built up, a zero gradient, float32 views of a
flat buffer, and the optimizer class with two parameter groups. Each calls the plain equations,
the code the assignment grades, whatever path the kernels are set to."""
import numpy as np

from minidist.core import nn
from minidist.core.kernels import kernels
from minidist.core.optim import AdamW, plain_adamw_update


def equations(p, g, m, v, t, lr, betas, eps, wd):
    """torch.optim.AdamW's step t on copies: decay the weights, the moments, their bias corrections."""
    b1, b2 = betas
    p = p - lr * wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps), m, v


def test_three_steps_against_the_equations_written_out():
    """b1 = 0.5, b2 = 0.75, a little decay, three steps in float64: weights and both moments."""
    rng = np.random.default_rng(7)
    p, m, v = rng.standard_normal(5), np.zeros(5), np.zeros(5)
    want = p.copy(), np.zeros(5), np.zeros(5)
    for t in (1, 2, 3):
        g = rng.standard_normal(5)
        plain_adamw_update(p, g, m, v, t, 0.1, (0.5, 0.75), 1e-6, 0.02)
        want = equations(want[0], g, want[1], want[2], t, 0.1, (0.5, 0.75), 1e-6, 0.02)
        for got, expected in zip((p, m, v), want):
            np.testing.assert_allclose(got, expected, rtol=1e-13)


def test_large_decay_and_eps_over_ten_steps():
    """lr 0.3, weight decay 0.5, eps 0.01 on a 3 x 4 array for ten steps: the decay is taken from
    the weights before the step, never from the gradient, and eps is added after the square root."""
    rng = np.random.default_rng(11)
    p, m, v = rng.standard_normal((3, 4)), np.zeros((3, 4)), np.zeros((3, 4))
    want = p.copy(), m.copy(), v.copy()
    for t in range(1, 11):
        g = rng.standard_normal((3, 4)) * 0.1
        plain_adamw_update(p, g, m, v, t, 0.3, (0.8, 0.9), 1e-2, 0.5)
        want = equations(want[0], g, want[1], want[2], t, 0.3, (0.8, 0.9), 1e-2, 0.5)
        for got, expected in zip((p, m, v), want):
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


def test_a_late_step_corrects_by_the_step_it_is_given():
    """Step 250 with moments already built up: the bias corrections use that step, 1 - b^250."""
    rng = np.random.default_rng(3)
    p, g = rng.standard_normal(7), rng.standard_normal(7)
    m, v = rng.standard_normal(7) * 0.1, rng.random(7) * 0.01
    want = equations(p, g, m, v, 250, 0.05, (0.9, 0.999), 1e-4, 0.1)
    plain_adamw_update(p, g, m, v, 250, 0.05, (0.9, 0.999), 1e-4, 0.1)
    for got, expected in zip((p, m, v), want):
        np.testing.assert_allclose(got, expected, rtol=1e-13)


def test_a_zero_gradient_still_decays_and_moves_by_the_old_moments():
    """g = 0 at step 4: the weights decay, the moments shrink by b1 and b2, and the step follows
    the old moments."""
    p = np.array([1.0, -2.0, 0.5, 3.0])
    m, v = np.array([0.2, -0.1, 0.0, 0.05]), np.array([0.04, 0.01, 0.0, 0.09])
    want = equations(p, np.zeros(4), m, v, 4, 0.1, (0.9, 0.99), 1e-3, 0.2)
    plain_adamw_update(p, np.zeros(4), m, v, 4, 0.1, (0.9, 0.99), 1e-3, 0.2)
    for got, expected in zip((p, m, v), want):
        np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-16)


def test_float32_views_of_a_flat_buffer_are_updated_in_place():
    """Weights and moments as float32 views into flat buffers (as ZeRO keeps its shards): the
    buffers change, stay float32, and agree with the equations to float32's precision."""
    rng = np.random.default_rng(5)
    flat = rng.standard_normal(20).astype(np.float32)
    moments = np.zeros((2, 20), dtype=np.float32)
    p, m, v = flat[4:16].reshape(3, 4), moments[0, 4:16].reshape(3, 4), moments[1, 4:16].reshape(3, 4)
    want = p.astype(np.float64), np.zeros((3, 4)), np.zeros((3, 4))
    for t in (1, 2):
        g = rng.standard_normal((3, 4)).astype(np.float32)
        plain_adamw_update(p, g, m, v, t, 0.01, (0.9, 0.95), 1e-3, 0.1)
        want = equations(want[0], g.astype(np.float64), want[1], want[2], t, 0.01, (0.9, 0.95), 1e-3, 0.1)
    assert flat.dtype == moments.dtype == np.float32
    np.testing.assert_allclose(flat[4:16].reshape(3, 4), want[0], rtol=1e-5)
    np.testing.assert_allclose(moments[0, 4:16].reshape(3, 4), want[1], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(moments[1, 4:16].reshape(3, 4), want[2], rtol=1e-5, atol=1e-9)
    assert not moments[:, :4].any() and not moments[:, 16:].any()  # nothing outside the views


def test_the_optimizer_with_two_groups_on_the_plain_kernels():
    """AdamW over a decayed group and an undecayed one, three steps on the plain kernels: each
    parameter follows the equations with its group's decay and the optimizer's step count."""
    rng = np.random.default_rng(9)
    w = nn.Parameter(rng.standard_normal((2, 3)), dtype=np.float64)
    b = nn.Parameter(rng.standard_normal(3), dtype=np.float64)
    with kernels("plain"):
        opt = AdamW([{"params": [w], "weight_decay": 0.3}, {"params": [b], "weight_decay": 0.0}],
                    lr=0.2, betas=(0.7, 0.9), eps=1e-3)
        want = {"w": (w.data.copy(), 0 * w.data, 0 * w.data), "b": (b.data.copy(), 0 * b.data, 0 * b.data)}
        for t in (1, 2, 3):
            grads = {"w": rng.standard_normal((2, 3)), "b": rng.standard_normal(3)}
            w.grad, b.grad = grads["w"].copy(), grads["b"].copy()
            opt.step()
            for name, wd in (("w", 0.3), ("b", 0.0)):
                p, m, v = want[name]
                want[name] = equations(p, grads[name], m, v, t, 0.2, (0.7, 0.9), 1e-3, wd)
    np.testing.assert_allclose(w.data, want["w"][0], rtol=1e-13)
    np.testing.assert_allclose(b.data, want["b"][0], rtol=1e-13)
    np.testing.assert_allclose(opt.state[0]["exp_avg_sq"], want["w"][2], rtol=1e-13)
