"""Optimizers against hand-written formulas, clipping, the schedule, and optimizer checkpoints."""
import math

import numpy as np
import pytest

from minidist.core import nn
from minidist.core.model import GPT, GPTConfig
from minidist.core.optim import (
    SGD,
    AdamW,
    adamw_update,
    clip_grad_norm_,
    grad_norm,
    lr_at,
    set_lr,
    weight_decay_groups,
)
from minidist.core.tensor import default_dtype

GRADS = [np.array([[0.5, -1.0], [2.0, 0.1]]), np.array([[-0.3, 0.2], [1.0, -4.0]]),
         np.array([[0.0, 0.7], [-1.5, 0.25]])]
START = np.array([[1.0, -2.0], [0.5, 3.0]])


def param(value=START):
    return nn.Parameter(value, dtype=np.float64)


# ----------------------------------------------------------------------------- AdamW


def test_adamw_matches_hand_computed_steps():
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.99, 1e-8, 0.05
    p = param()
    opt = AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    theta, m, v = START.copy(), np.zeros((2, 2)), np.zeros((2, 2))
    for t, g in enumerate(GRADS, start=1):
        p.grad = g.copy()
        opt.step()
        theta = theta - lr * wd * theta  # decoupled weight decay
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        theta = theta - lr * m_hat / (np.sqrt(v_hat) + eps)
        np.testing.assert_allclose(p.data, theta, rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(opt.state[0]["exp_avg"], m, rtol=1e-13)
        np.testing.assert_allclose(opt.state[0]["exp_avg_sq"], v, rtol=1e-13)
    assert opt.step_count == 3


def test_adamw_first_step_moves_each_weight_by_lr():
    # with bias correction, step 1 is lr * g / |g| (= lr * sign(g)) when eps and decay are negligible
    p = param()
    opt = AdamW([p], lr=0.01, weight_decay=0.0, eps=1e-12)
    p.grad = GRADS[0].copy()
    opt.step()
    np.testing.assert_allclose(p.data, START - 0.01 * np.sign(GRADS[0]), rtol=1e-9)


def test_adamw_update_function_in_place():
    param_, m, v = START.copy(), np.zeros((2, 2)), np.zeros((2, 2))
    adamw_update(param_, GRADS[0], m, v, step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    np.testing.assert_allclose(m, 0.1 * GRADS[0], rtol=1e-14)
    np.testing.assert_allclose(v, 0.001 * GRADS[0] ** 2, rtol=1e-14)
    np.testing.assert_allclose(param_, START - 0.1 * GRADS[0] / (np.abs(GRADS[0]) + 1e-8), rtol=1e-12)


def test_adamw_keeps_float32():
    p = nn.Parameter(START, dtype=np.float32)
    opt = AdamW([p], lr=0.1)
    p.grad = GRADS[0].astype(np.float32)
    opt.step()
    assert p.dtype == np.float32
    assert opt.state[0]["exp_avg"].dtype == np.float32 and opt.state[0]["exp_avg_sq"].dtype == np.float32


def test_weight_decay_groups_decay_only_matrices():
    with default_dtype(np.float64):
        model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=2, n_embd=4))
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(p) for n, p in model.named_parameters() if p.ndim == 2}
    assert len(decay["params"]) + len(no_decay["params"]) == len(model.parameters())
    assert all(p.ndim == 1 for p in no_decay["params"])
    opt = AdamW(weight_decay_groups(model, 0.5), lr=0.1)
    bias = model.h[0].attn.q_proj.bias
    weight = model.h[0].attn.q_proj.weight
    before_w = weight.data.copy()
    for p in model.parameters():
        p.grad = np.zeros_like(p.data)
    opt.step()  # zero gradients: only decay moves anything
    np.testing.assert_array_equal(bias.data, 0.0)
    np.testing.assert_allclose(weight.data, before_w * (1 - 0.1 * 0.5), rtol=1e-14)


def test_parameters_without_grad_are_skipped():
    a, b = param(), param()
    opt = AdamW([a, b], lr=0.1)
    a.grad = GRADS[0].copy()
    opt.step()
    np.testing.assert_array_equal(b.data, START)
    assert opt.state[1] == {} and set(opt.state[0]) == {"exp_avg", "exp_avg_sq"}


def test_empty_parameter_list():
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        AdamW([])


def test_zero_grad_and_set_lr():
    p = param()
    opt = SGD([p], lr=0.5)
    p.grad = GRADS[0].copy()
    opt.zero_grad()
    assert p.grad is None
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] == 0.25
    p.grad = GRADS[0].copy()
    opt.step()
    np.testing.assert_allclose(p.data, START - 0.25 * GRADS[0], rtol=1e-15)


# ----------------------------------------------------------------------------- SGD


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.1), (0.0, 0.1)])
def test_sgd_matches_hand_computed_steps(momentum, wd):
    lr = 0.1
    p = param()
    opt = SGD([p], lr=lr, momentum=momentum, weight_decay=wd)
    theta, buf = START.copy(), None
    for g in GRADS:
        p.grad = g.copy()
        opt.step()
        d = g + wd * theta
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + d
            d = buf
        theta = theta - lr * d
        np.testing.assert_allclose(p.data, theta, rtol=1e-14, atol=1e-15)
    np.testing.assert_array_equal(GRADS[0], [[0.5, -1.0], [2.0, 0.1]])  # gradients not modified


def test_sgd_momentum_explicit_numbers():
    p = nn.Parameter(np.array([1.0]), dtype=np.float64)
    opt = SGD([p], lr=0.5, momentum=0.5)
    for _ in range(3):
        p.grad = np.array([1.0])
        opt.step()
    # buffers 1, 1.5, 1.75: p = 1 - 0.5 * (1 + 1.5 + 1.75)
    np.testing.assert_allclose(p.data, [1.0 - 0.5 * 4.25], rtol=1e-15)


# ----------------------------------------------------------------------------- clipping


def test_clip_grad_norm_returns_pre_clip_norm_and_clips_to_max():
    a, b, c = param(), nn.Parameter(np.ones(3), dtype=np.float64), param()
    a.grad = GRADS[0].copy()
    b.grad = np.array([3.0, -4.0, 12.0])
    c.grad = None
    expected = math.sqrt((GRADS[0] ** 2).sum() + 9 + 16 + 144)
    assert grad_norm([a.grad, b.grad, None]) == pytest.approx(expected, rel=1e-14)
    total = clip_grad_norm_([a, b, c], max_norm=1.0)
    assert total == pytest.approx(expected, rel=1e-14)
    assert grad_norm([a.grad, b.grad]) == pytest.approx(1.0, rel=1e-6)
    scale = 1.0 / expected  # one common scale for every gradient
    np.testing.assert_allclose(b.grad, np.array([3.0, -4.0, 12.0]) * scale, rtol=1e-6)
    np.testing.assert_allclose(a.grad, GRADS[0] * scale, rtol=1e-6)
    assert c.grad is None


def test_clip_grad_norm_leaves_small_gradients_alone():
    p = param()
    p.grad = GRADS[0].copy()
    total = clip_grad_norm_([p], max_norm=100.0)
    assert total == pytest.approx(np.linalg.norm(GRADS[0]), rel=1e-14)
    np.testing.assert_array_equal(p.grad, GRADS[0])


# ----------------------------------------------------------------------------- schedule


def test_lr_at_warmup_and_cosine_endpoints():
    base, warm, total, low = 1.0, 10, 110, 0.1
    assert lr_at(0, base, warm, total, low) == pytest.approx(0.1)
    assert lr_at(4, base, warm, total, low) == pytest.approx(0.5)
    assert lr_at(9, base, warm, total, low) == pytest.approx(1.0)
    assert lr_at(10, base, warm, total, low) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(60, base, warm, total, low) == pytest.approx((base + low) / 2)
    assert lr_at(110, base, warm, total, low) == pytest.approx(low)
    assert lr_at(500, base, warm, total, low) == low
    decay = [lr_at(s, base, warm, total, low) for s in range(warm, total + 1)]
    assert all(x > y for x, y in zip(decay, decay[1:]))
    assert lr_at(0, 3e-4, 0, 100) == pytest.approx(3e-4)  # no warm-up
    assert lr_at(100, 3e-4, 0, 100) == 0.0


# ----------------------------------------------------------------------------- checkpoints


def _tiny_model():
    with default_dtype(np.float64):
        return GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=2, n_embd=8), seed=1)


def _train(model, opt, steps, data):
    for step in range(steps):
        idx, tgt = data[step % len(data)]
        _, loss = model(idx, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("make_opt", [
    lambda m: AdamW(weight_decay_groups(m, 0.1), lr=1e-2),
    lambda m: SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
], ids=["adamw", "sgd"])
def test_optimizer_state_dict_round_trip_continues_identically(make_opt):
    rng = np.random.default_rng(2)
    data = [(rng.integers(0, 8, (2, 4)), rng.integers(0, 8, (2, 4))) for _ in range(3)]
    ref = _tiny_model()
    ref_opt = make_opt(ref)
    _train(ref, ref_opt, 6, data)

    first = _tiny_model()
    first_opt = make_opt(first)
    _train(first, first_opt, 3, data)
    model_state, opt_state = first.state_dict(), first_opt.state_dict()
    _train(first, first_opt, 2, data)  # changing the originals afterwards must not leak into the saved copies

    resumed = _tiny_model()
    resumed_opt = make_opt(resumed)
    resumed.load_state_dict(model_state)
    resumed_opt.load_state_dict(opt_state)
    assert resumed_opt.step_count == 3
    for step in range(3, 6):
        idx, tgt = data[step % len(data)]
        _, loss = resumed(idx, tgt)
        resumed_opt.zero_grad()
        loss.backward()
        resumed_opt.step()
    for (name, a), (_, b) in zip(ref.named_parameters(), resumed.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=name)
    assert not np.array_equal(ref.wte.weight.data, _tiny_model().wte.weight.data)


def test_optimizer_load_state_dict_errors():
    p, q = param(), param()
    opt = AdamW([p])
    p.grad = GRADS[0].copy()
    opt.step()
    state = opt.state_dict()
    with pytest.raises(ValueError, match="optimizer state has 1 parameter groups, this optimizer has 2"):
        AdamW([{"params": [p]}, {"params": [q]}]).load_state_dict(state)
    small = nn.Parameter(np.zeros(3), dtype=np.float64)
    with pytest.raises(ValueError, match=r"optimizer state exp_avg of parameter 0: shape \(2, 2\), parameter has \(3,\)"):
        AdamW([small]).load_state_dict(state)


def test_optimizer_state_dict_restores_hyper_parameters():
    p = param()
    opt = AdamW([p], lr=0.123, betas=(0.8, 0.95), weight_decay=0.3)
    other = AdamW([param()])
    other.load_state_dict(opt.state_dict())
    group = other.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"], group["eps"]) == (0.123, (0.8, 0.95), 0.3, 1e-8)
    assert other.param_groups[0]["params"][0] is not p
