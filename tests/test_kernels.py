"""The two kernel paths, plain (fused.py) and fast (fused_fast.py), give the same numbers.

Every operation runs both ways on awkward inputs (transposed, size-1 axes, fewer queries than
keys, ignored targets), forward and backward, in float64; so do AdamW's update and a few steps of
training the small GPT. Agreement to 1e-12 relative: only the order of rounding differs.
"""
import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import relative_difference, serial_run

import minidist.core.functional as F
from minidist.core.kernels import current, kernels
from minidist.core.optim import adamw_update
from minidist.core.tensor import Tensor

PATHS = ("plain", "fast")


def array(*shape, seed=0, transposed=False):
    """A float64 array of `shape`; with transposed=True a non-contiguous view of that shape."""
    rng = np.random.default_rng(seed)
    if transposed:
        return rng.standard_normal(shape[::-1]).T
    return rng.standard_normal(shape)


def run(path, op, *arrays):
    """`op` on leaf tensors over `arrays` (None passes through) under the kernel path `path`, and
    backward from a non-contiguous upstream gradient; returns the output and each gradient."""
    with kernels(path):
        leaves = [None if a is None else Tensor(a.copy(order="K"), requires_grad=True) for a in arrays]
        out = op(*leaves)
        upstream = array(*out.shape, seed=99, transposed=out.ndim > 1) if out.ndim else np.array(1.0)
        out.backward(upstream)
    return [out.data] + [leaf.grad for leaf in leaves if leaf is not None]


def assert_same_both_ways(op, *arrays):
    plain, fast = run("plain", op, *arrays), run("fast", op, *arrays)
    assert len(plain) == len(fast) == 1 + sum(a is not None for a in arrays)
    for a, b in zip(fast, plain):
        assert a.shape == b.shape and a.dtype == b.dtype == np.float64
        assert a.size == 0 or relative_difference(a, b) < 1e-12
    return plain


# ----------------------------------------------------------------------------- the switch


def test_switch_as_call_and_as_context_manager():
    start = current()  # "fast" unless the run sets MINIDIST_KERNELS
    assert start in PATHS
    with kernels("plain"):
        assert current() == "plain"
        with kernels("fast"):
            assert current() == "fast"
        assert current() == "plain"
    assert current() == start
    try:
        kernels("plain")
        assert current() == "plain"
        kernels("fast")
        assert current() == "fast"
    finally:
        kernels(start)
    with pytest.raises(ValueError, match="kernels: unknown path 'quick'; choose 'plain' or 'fast'"):
        kernels("quick")
    assert current() == start


def test_default_is_fast_and_the_environment_chooses():
    script = "from minidist.core.kernels import current; print(current())"
    env = {k: v for k, v in os.environ.items() if k != "MINIDIST_KERNELS"}
    for value, expected in [(None, "fast"), ("plain", "plain"), ("fast", "fast")]:
        run_env = env if value is None else {**env, "MINIDIST_KERNELS": value}
        out = subprocess.run([sys.executable, "-c", script], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


# ----------------------------------------------------------------------------- every operation


@pytest.mark.parametrize("x,bias", [
    (array(4, 3, transposed=True), array(5)),
    (array(2, 1, 3), array(5)),
    (array(1, 3), None),
], ids=["transposed", "size-1", "no-bias"])
def test_linear(x, bias):
    assert_same_both_ways(F.linear, x, array(5, 3, seed=1), bias)


@pytest.mark.parametrize("ids", [np.array([[1, 3, 1], [1, 0, 3]]), np.array([[1, 3, 1], [1, 0, 3]]).T,
                                 np.array([[4]]), np.zeros(0, dtype=int)], ids=["repeats", "transposed", "one", "none"])
def test_embedding(ids):
    assert_same_both_ways(lambda w: F.embedding(ids, w), array(5, 4))


@pytest.mark.parametrize("shape,transposed", [((5, 6), True), ((2, 3, 6), False), ((1, 1, 6), False), ((3, 1), False)])
def test_layer_norm(shape, transposed):
    x = array(*shape, transposed=transposed)
    assert_same_both_ways(lambda x, w, b: F.layer_norm(x, w, b), x, array(shape[-1], seed=1), array(shape[-1], seed=2))


@pytest.mark.parametrize("x", [array(3, 4, transposed=True), array(2, 3, 4), array(1), array(70_000)],
                         ids=["transposed", "3d", "one", "several-blocks"])
def test_gelu(x):
    assert_same_both_ways(F.gelu, x)


@pytest.mark.parametrize("op", [F.softmax, F.log_softmax], ids=lambda f: f.__name__)
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("x", [array(3, 4, transposed=True), array(2, 1, 4)], ids=["transposed", "size-1"])
def test_softmax_family(op, axis, x):
    assert_same_both_ways(lambda x: op(x, axis), x)


@pytest.mark.parametrize("tq,tk", [(4, 4), (2, 5), (1, 1), (1, 3)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("causal", [True, False])
def test_attention(causal, dropout_p, tq, tk):
    # q as the model makes it: (batch, time, heads, dim) with heads and time swapped, non-contiguous
    q = array(2, tq, 2, 3, seed=1).swapaxes(1, 2)
    k, v = array(2, 2, tk, 3, seed=2), array(2, 2, tk, 3, seed=3, transposed=True)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, causal=causal, dropout_p=dropout_p,
                                              rng=np.random.default_rng(5))

    assert_same_both_ways(attention, q, k, v)


def test_dropout_same_seed():
    out = assert_same_both_ways(lambda x: F.dropout(x, 0.4, rng=np.random.default_rng(7)), array(6, 5, transposed=True))
    assert 0 < (out[0] == 0).mean() < 1


@pytest.mark.parametrize("logits,targets,ignore_index", [
    (array(6, 5), np.array([0, 4, 2, -100, 1, 3]), -100),
    (array(2, 3, 5, transposed=True), np.array([[0, 4, -1], [-1, 1, 3]]), -1),
    (array(1, 5), np.array([2]), -100),
    (array(3, 5), np.full(3, -100), -100),
], ids=["ignored", "transposed", "one-token", "all-ignored"])
def test_cross_entropy(logits, targets, ignore_index):
    assert_same_both_ways(lambda x: F.cross_entropy(x, targets, ignore_index=ignore_index), logits)


def test_adamw_both_ways():
    results = {}
    for path in PATHS:
        param, m, v = array(4, 3), np.zeros((4, 3)), np.zeros((4, 3))
        with kernels(path):
            for step in range(1, 4):
                adamw_update(param, array(4, 3, seed=step), m, v, step, lr=0.1, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.1)
        results[path] = (param, m, v)
    assert len(results) == 2
    for fast, plain in zip(results["fast"], results["plain"]):
        assert relative_difference(fast, plain) < 1e-12


def test_training_the_gpt_both_ways():
    config = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
    settings = dict(lr=1e-2, steps=4, warmup=1, min_lr=1e-3, clip=1.0, weight_decay=0.1)
    runs = {}
    for path in PATHS:
        with kernels(path):
            runs[path] = serial_run(config, settings, batch=4, steps=4)
    assert len(runs) == 2
    np.testing.assert_allclose(runs["fast"]["losses"], runs["plain"]["losses"], rtol=1e-12)
    state = runs["plain"]["state"]
    assert len(state) == len(runs["fast"]["state"]) > 10
    for name, value in state.items():
        assert relative_difference(runs["fast"]["state"][name], value) < 1e-12, name
    assert relative_difference(state["wte.weight"], runs["plain"]["initial"]["wte.weight"]) > 1e-4  # it trained


# ----------------------------------------------------------------------------- bugs both paths once had


def test_gelu_far_out_in_both_tails_is_0_and_x_without_a_warning():
    # the fast path's exp(-2u) overflows to inf far left of 0 (x < about -20): sigmoid 0, gradient 0
    x = np.array([-1000.0, -40.0, -20.0, -12.0, 0.0, 12.0, 40.0, 1000.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow warning would fail the test
        assert_same_both_ways(F.gelu, x)
        for path in PATHS:
            y, grad = run(path, F.gelu, x)  # backward from array(8, seed=99), as `run` does
            np.testing.assert_array_equal(y[[0, 1, -2, -1]], [0.0, 0.0, 40.0, 1000.0])
            np.testing.assert_array_equal(grad[[0, 1, -2, -1]], [0.0, 0.0, *array(8, seed=99)[-2:]])


@pytest.mark.parametrize("path", PATHS)
def test_gelu_of_a_transposed_input_is_the_formula(path):
    x = Tensor(np.arange(6.0).reshape(2, 3) - 2, requires_grad=True)
    with kernels(path):
        y = F.gelu(x.T)  # a non-contiguous view: the blocked kernel once wrote into a copy
        y.backward(np.arange(6.0).reshape(3, 2))
    xt = x.data.T
    t = np.tanh(math.sqrt(2 / math.pi) * (xt + 0.044715 * xt**3))
    np.testing.assert_allclose(y.data, 0.5 * xt * (1 + t), rtol=1e-14)
    slope = 0.5 * (1 + t) + 0.5 * xt * (1 - t**2) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * xt**2)
    np.testing.assert_allclose(x.grad, (np.arange(6.0).reshape(3, 2) * slope).T, rtol=1e-14)


@pytest.mark.parametrize("path", PATHS)
def test_causal_attention_aligns_queries_with_the_last_keys(path):
    """T_q=2, T_k=5: the last query sees all 5 keys, the first sees 4 (not PyTorch's is_causal)."""
    q, k = Tensor(array(1, 1, 2, 3, seed=1)), Tensor(array(1, 1, 5, 3, seed=2))
    v = Tensor(np.eye(5)[None, None])  # the output rows are the attention weights themselves
    with kernels(path):
        weights = F.scaled_dot_product_attention(q, k, v).data[0, 0]
    assert weights.shape == (2, 5)
    np.testing.assert_array_equal(weights[0, 4], 0.0)
    assert (weights[0, :4] > 0).all() and (weights[1] > 0).all()
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-14)


@pytest.mark.parametrize("path", PATHS)
def test_causal_attention_refuses_more_queries_than_keys(path):
    with kernels(path), pytest.raises(ValueError, match="attention: causal with 3 queries but only 2 keys"):
        F.scaled_dot_product_attention(Tensor(array(1, 1, 3, 2)), Tensor(array(1, 1, 2, 2)), Tensor(array(1, 1, 2, 2)))


def test_bench_step_times_both_paths_and_keeps_its_json_keys(tmp_path):
    from minidist.bench import step as bench_step

    out = tmp_path / "step.json"
    assert bench_step.main(["--steps", "1", "--warmup", "0", "--dtype", "float32", "--no-torch",
                            "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert {"benchmark", "dtype", "batch", "tokens", "parameters", "seconds", "tokens_per_s",
            "matmul_floor_seconds", "torch_seconds", "ops"} <= set(record)
    assert record["kernels"] == "fast" and record["plain_seconds"] > 0 and record["seconds"] > 0
    assert record["torch_seconds"] is None and record["torch_matmul_floor_seconds"] is None
    assert "Linear" in record["ops"]
    assert record["linear_gemms_in_step_seconds"] > 0 and record["linear_gemms_alone_seconds"] > 0


def test_timed_linear_gives_the_fast_linears_numbers_and_logs_its_three_gemms():
    from minidist.core import fused, fused_fast
    from minidist.core.kernels import register_fast
    from minidist.lab.gemms_in_step import TimedLinear

    x, w, b = array(2, 3, 4, seed=1), array(5, 4, seed=2), array(5, seed=3)
    expected = run("fast", F.linear, x, w, b)
    TimedLinear.log.clear()
    register_fast(fused.Linear, TimedLinear)
    try:
        got = run("fast", F.linear, x, w, b)
    finally:
        register_fast(fused.Linear, fused_fast.Linear)
    for a, e in zip(got, expected):
        np.testing.assert_array_equal(a, e)
    assert [entry[:4] for entry in TimedLinear.log] == [("forward", (6, 4), (5, 4), "float64"),
                                                         ("to the input", (6, 5), (5, 4), "float64"),
                                                         ("to the weight", (6, 5), (6, 4), "float64")]
    assert all(entry[4] > 0 for entry in TimedLinear.log)


def test_linear_gemms_in_step_counts_every_linear_of_the_gpt_and_steps_aside():
    """Two blocks of six Linear layers and the head: 13 products of each kind per step."""
    from minidist.bench.step import minidist_step
    from minidist.core import fused, fused_fast
    from minidist.core.kernels import chosen, register_fast
    from minidist.core.model import GPTConfig
    from minidist.lab.gemms_in_step import KINDS, linear_gemms_in_step

    config = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)
    step, _, _ = minidist_step(config, 2, "float32")
    inside, alone, by_shape = linear_gemms_in_step(step, steps=2, warmup=1, repeats=2)
    for kind in KINDS:
        assert sum(calls for (k, *_), (calls, _, _) in by_shape.items() if k == kind) == 2 * 6 + 1
    assert {dtype for (*_, dtype) in by_shape} == {"float32"}
    assert inside == pytest.approx(sum(c * t for c, t, _ in by_shape.values()))
    assert alone == pytest.approx(sum(c * t for c, _, t in by_shape.values())) and alone > 0
    with kernels("fast"):
        assert chosen(fused.Linear) is fused_fast.Linear

    class StandIn(fused_fast.Linear):
        """Whatever ran before the measurement runs again after it."""

    register_fast(fused.Linear, StandIn)
    try:
        linear_gemms_in_step(step, steps=1, warmup=0, repeats=1)
        with kernels("fast"):
            assert chosen(fused.Linear) is StandIn
    finally:
        register_fast(fused.Linear, fused_fast.Linear)


def test_fast_attention_hands_back_heads_side_by_side():
    """The fast path writes the gradients of q, k and v, (B, H, T, D), into memory laid out as
    (B, T, H, D), so that their way back through the model's split_heads is a view; the numbers
    are test_attention's. The output stays contiguous: the ledger counts the copy that follows."""
    q, k, v = array(2, 3, 4, 5, seed=1), array(2, 3, 4, 5, seed=2), array(2, 3, 4, 6, seed=3)
    out, gq, gk, gv = run("fast", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, causal=True), q, k, v)
    assert out.shape == (2, 3, 4, 6) and out.flags.c_contiguous
    assert all(g.transpose(0, 2, 1, 3).flags.c_contiguous for g in (gq, gk, gv))


@pytest.mark.parametrize("gap", [0.0, 8.0, 30.0, 1000.0])
@pytest.mark.parametrize("tq", [6, 4])
def test_causal_softmax_with_scores_far_above_the_diagonal(gap, tq):
    """The fast causal softmax shifts each row by its query's score with its own key, not by its
    max; a row whose max lies far above that (here two rows of every matrix, `gap` units) must not
    overflow: those rows are done again from their maxima. The weights agree with the plain
    path's to 1e-12 and every row sums to 1, at every gap, with queries aligned to the last keys."""
    from minidist.core import fused, fused_fast

    scores = array(3, 2, tq, 6, seed=4)
    scores[..., 0, 6 - tq] -= gap      # the first query's own key
    scores[..., -1, 0] += gap          # the last query's first key
    bias = fused._causal_mask(tq, 6, np.dtype(np.float64))
    plain = fused._softmax(0.5 * scores + bias, -1)
    fast = fused_fast._causal_softmax(scores.copy(), 0.5)
    assert relative_difference(fast, plain) < 1e-12
    np.testing.assert_allclose(fast.sum(-1), 1.0, rtol=1e-14)
    np.testing.assert_array_equal(fast[..., 0, 7 - tq:], 0.0)


@pytest.mark.parametrize("op", ["gelu", "attention"])
def test_float32_both_ways(op):
    """float32 takes its own forms on the fast path (GELU's sigmoid from tanh, not exp); the two
    paths agree to float32's rounding, forward and backward (relative to each array's largest
    value: single entries near 0 come out of sums that cancel)."""
    def f(*xs):
        if op == "gelu":
            return F.gelu(xs[0])
        return F.scaled_dot_product_attention(*xs, causal=True)
    shapes = [(4, 64, 32)] if op == "gelu" else [(2, 3, 16, 8)] * 3
    arrays = [3 * array(*shape, seed=i).astype(np.float32) for i, shape in enumerate(shapes)]
    fast, plain = (run(path, f, *arrays) for path in ("fast", "plain"))
    for a, b in zip(fast, plain):
        assert a.dtype == b.dtype == np.float32 and relative_difference(a, b) < 1e-5
