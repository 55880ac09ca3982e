"""Activation checkpointing (chapter 11): the same numbers as the plain run, and less memory
by exactly what the formula says."""
from __future__ import annotations

import numpy as np
import pytest

from minidist.core import functional as F
from minidist.plan import memory, recompute_cost
from minidist.core.data import make_task
from minidist.core.gradcheck import gradcheck
from minidist.core.kernels import kernels
from minidist.core.model import GPT, Block, GPTConfig
from minidist.core.nn import Dropout, Linear, Module
from minidist.precision import autocast
from minidist.core.recompute import checkpoint, checkpoint_sequential, record_recomputation, segment_bounds
from minidist.core.tensor import Tensor, default_dtype, graph_bytes, no_grad
from minidist.training.train import OptimSettings, SerialTrainer, generator_states

TINY = dict(vocab_size=64, block_size=8, n_layer=4, n_head=2, n_embd=16)
B = 3  # batch


def tokens(config, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, config.vocab_size, (B, config.block_size)),
            rng.integers(0, config.vocab_size, (B, config.block_size)))


def gpt(recompute="none", segments=None, dtype=np.float64, seed=1, **overrides):
    with default_dtype(dtype):
        return GPT(GPTConfig(**{**TINY, **overrides}), seed=seed).set_recompute(recompute, segments)


def grads(model):
    return {name: p.grad.copy() for name, p in model.named_parameters()}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


# ----------------------------------------------------------------------------- checkpoint itself


class TwoLayers(Module):
    def __init__(self):
        self.a, self.b = Linear(3, 5), Linear(5, 2)
        rng = np.random.default_rng(4)
        for p in self.parameters():
            p.data[...] = rng.normal(size=p.shape)

    def forward(self, x, scale):
        return self.b(F.gelu(self.a(x))) * scale


def test_checkpoint_gradcheck_and_same_gradients_as_plain():
    with default_dtype(np.float64):
        f = TwoLayers()
        x = Tensor(np.random.default_rng(0).normal(size=(4, 3)), requires_grad=True)
    assert gradcheck(lambda x: checkpoint(f, x, 0.5), x)  # the input's gradient, by finite differences
    weights = np.random.default_rng(1).normal(size=(4, 2))
    plain, recomputed = {}, {}
    for out, run in ((plain, lambda: f(x, 0.5)), (recomputed, lambda: checkpoint(f, x, 0.5))):
        f.zero_grad()
        x.grad = None
        (run() * weights).sum().backward()
        out.update(grads(f), x=x.grad.copy())
    assert_same(plain, recomputed)  # parameters too: through the recomputed graph


def test_checkpoint_keeps_only_its_input_and_output():
    with default_dtype(np.float64):
        f = TwoLayers()
        x = Tensor(np.ones((4, 3)), requires_grad=True)
        h = x * 2.0  # a non-leaf input: counted once, by its own node
    # plain: a's output, GELU's tanh and output (4x5 each); b's output and the product (4x2 each)
    assert graph_bytes(f(h, 1.0)) == h.data.nbytes + (3 * 4 * 5 + 2 * 4 * 2) * 8
    assert graph_bytes(checkpoint(f, h, 1.0)) == h.data.nbytes + 4 * 2 * 8  # h and the output


def test_checkpointed_block_with_dropout_gives_the_same_gradients_and_generator_states():
    config = GPTConfig(**TINY, dropout=0.1)
    x0 = np.random.default_rng(2).normal(size=(B, 8, 16))
    runs = []
    for wrap in (lambda block, x: block(x), checkpoint):
        with default_dtype(np.float64):
            block = GPT(config, seed=1).h[0]
            x = Tensor(x0, requires_grad=True)
        (wrap(block, x) * x0).sum().backward()
        runs.append(({**grads(block), "x": x.grad}, generator_states(block)))
    (plain, plain_rng), (recomputed, recomputed_rng) = runs
    assert_same(plain, recomputed)
    assert_same(plain_rng, recomputed_rng)


def test_generators_go_back_to_where_backward_found_them():
    """Two micro-batches' forwards, then their backwards (gradient accumulation): the second
    forward's draws must survive the first micro-batch's recomputation."""
    config = GPTConfig(**TINY, dropout=0.5)
    xs = [np.random.default_rng(s).normal(size=(B, 8, 16)) for s in (3, 4)]
    runs = []
    for wrap in (lambda block, x: block(x), checkpoint):
        with default_dtype(np.float64):
            block = Block(config, seed=5)
        ys = [wrap(block, Tensor(x, requires_grad=True)) for x in xs]
        for y, x in zip(reversed(ys), reversed(xs)):
            (y * x).sum().backward()
        after = generator_states(block)
        with default_dtype(np.float64):
            later = block(Tensor(xs[0])).data  # the next step's masks
        runs.append((grads(block), after, later))
    assert_same(runs[0][0], runs[1][0])
    assert_same(runs[0][1], runs[1][1])
    assert np.array_equal(runs[0][2], runs[1][2])


def test_recomputation_that_draws_differently_is_refused():
    drop = Dropout(0.5, seed=0)
    calls = []

    def unsteady(x):  # draws a second mask on its second run
        calls.append(1)
        return drop(drop(x)) if len(calls) > 1 else drop(x)

    y = checkpoint(unsteady, Tensor(np.ones(4), requires_grad=True), generators=[drop.rng])
    with pytest.raises(RuntimeError, match="recomputation drew a different amount of random numbers"):
        y.sum().backward()


def test_recomputation_runs_under_the_forwards_autocast_and_kernels():
    x, y = tokens(GPTConfig(**TINY))
    results = []
    for mode in ("none", "full", "selective"):
        model = gpt(mode, dtype=np.float32, dropout=0.1)
        with autocast("bf16"), kernels("plain"):
            _, loss = model(x, y)
        with kernels("fast"):  # backward outside both: the recomputation must restore them
            loss.backward()
        results.append(grads(model))
    assert_same(results[0], results[1])
    assert_same(results[0], results[2])


def test_no_grad_runs_the_function_plainly():
    with default_dtype(np.float64):
        f = TwoLayers()
    with no_grad():
        out = checkpoint(f, Tensor(np.ones((2, 3)), requires_grad=True), 1.0)
    assert not out.requires_grad and out.is_leaf
    model = gpt("full", segments=2)
    prompt = np.zeros((1, 2), dtype=int)
    assert np.array_equal(model.generate(prompt, 3), gpt().generate(prompt, 3))


def test_errors():
    with pytest.raises(ValueError, match="none of the 1 tensor inputs requires grad"):
        checkpoint(lambda x: x * 2.0, Tensor(np.ones(3)))
    with pytest.raises(ValueError, match="recompute must be one of none, full, selective; got 'partial'"):
        gpt().set_recompute("partial")
    with pytest.raises(ValueError, match="segments must be an integer from 1 to n_layer=4, got 5"):
        gpt().set_recompute("full", 5)
    with pytest.raises(ValueError, match="segments=2 applies to recompute='full' only, not recompute='selective'"):
        gpt().set_recompute("selective", 2)
    with pytest.raises(ValueError, match="segments must be an integer from 1 to 2, got 0"):
        checkpoint_sequential([Linear(2, 2), Linear(2, 2)], 0, Tensor(np.ones(2), requires_grad=True))


# ----------------------------------------------------------------------------- the GPT trains the same


def train(recompute, segments, steps=3):
    config = GPTConfig(**TINY, dropout=0.1)
    with default_dtype(np.float64):
        trainer = SerialTrainer(config, OptimSettings(lr=1e-2, warmup=1, steps=steps, clip=1.0),
                                make_task("sort:4", config.block_size, seed=0), B, seed=0)
        trainer.model.set_recompute(recompute, segments)
        losses = [trainer.step(s)[0] for s in range(steps)]
    return losses, trainer.state_dict(), generator_states(trainer.model)


@pytest.fixture(scope="module")
def plain_run():
    return train("none", None)


@pytest.mark.parametrize("recompute,segments", [("full", None), ("selective", None), ("full", 2), ("full", 3)])
def test_training_reproduces_the_plain_run_bit_for_bit(plain_run, recompute, segments):
    losses, state, rngs = train(recompute, segments)
    assert losses == plain_run[0]  # float64, dropout 0.1, clipping on: the very same bits
    assert_same(state, plain_run[1])
    assert_same(rngs, plain_run[2])


def test_every_parameter_hook_fires_once_per_backward():
    for mode in ("full", "selective"):
        model = gpt(mode, dropout=0.1)
        counts = {}
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda t, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
        model(*tokens(model.config))[1].backward()
        assert counts == {name: 1 for name, _ in model.named_parameters()}


# ----------------------------------------------------------------------------- memory, measured = formula


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("segments", [None, 2, 3, 1])
def test_full_recompute_keeps_each_runs_output_and_rebuilds_one_run_at_a_time(dropout, segments):
    """After forward the graph holds what is outside the blocks plus each run's output (b·s·h:
    every run's input is the previous run's output or the embedding's); backward rebuilds one
    run's whole graph at a time, last run first."""
    model = gpt("full", segments, dropout=dropout)
    config, e, n_h = model.config, 8, B * TINY["block_size"] * TINY["n_embd"]
    plain = memory.activation_bytes(config, B, bytes_per_element=e)
    runs = segment_bounds(config.n_layer, segments or config.n_layer)
    _, loss = model(*tokens(config))
    assert graph_bytes(loss) == plain["outside"] + len(runs) * n_h * e
    with record_recomputation() as sizes:
        loss.backward()
    assert sizes == [(end - start) * plain["per_layer"] for start, end in reversed(runs)]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_selective_recompute_drops_exactly_the_attention_core(dropout):
    """Per layer: the softmax weights (a·b·s²) and, with dropout, their mask (a·b·s²); q, k, v
    and the core's output are kept either way. Backward rebuilds one core at a time: those two
    arrays and the output (b·s·h)."""
    d, a, s, h, e = int(dropout > 0), TINY["n_head"], TINY["block_size"], TINY["n_embd"], 8
    x, y = tokens(GPTConfig(**TINY))
    plain = graph_bytes(gpt(dropout=dropout)(x, y)[1])
    _, loss = gpt("selective", dropout=dropout)(x, y)
    core = (1 + d) * a * B * s * s * e
    assert plain - graph_bytes(loss) == TINY["n_layer"] * core
    with record_recomputation() as sizes:
        loss.backward()
    assert sizes == [B * s * h * e + core] * TINY["n_layer"]


@pytest.mark.parametrize("recompute,segments", [("none", None), ("selective", None), ("full", None), ("full", 3)])
def test_cost_module_prediction_equals_measurement(recompute, segments):
    config = GPTConfig(**TINY, dropout=0.1)
    measured = recompute_cost.activation_bytes(config, B, recompute, segments, dtype=np.float64)
    assert measured == recompute_cost.predicted_activation_bytes(config, B, recompute, segments, itemsize=8)


def test_ledger_adapts_megatrons_formula_to_the_byte():
    config = GPTConfig(**TINY, dropout=0.1)
    rows = {r["recompute"]: r for r in recompute_cost.ledger(config, B, dtype=np.float64)}
    sbh = B * TINY["block_size"] * TINY["n_embd"]
    assert [r["measured"] for r in rows.values()] == [r["predicted"] for r in rows.values()]
    assert rows["full"]["measured"] == 8 * sbh
    assert rows["none"]["measured"] - rows["selective"]["measured"] == 8 * 2 * TINY["n_head"] * B * 8 * 8
    assert rows["none"]["megatron"] == sbh * (34 + 5 * TINY["n_head"] * TINY["block_size"] / TINY["n_embd"])


def test_memory_time_curve_and_overheads_report_every_setting():
    config = GPTConfig(**{**TINY, "n_layer": 2})
    rows = recompute_cost.memory_time_curve(config, B, steps=1, dtype=np.float64)
    assert [(r["recompute"], r["segments"]) for r in rows] == [("none", None), ("full", 1), ("full", 2)]
    assert all(r["peak"] == r["predicted_peak"] and r["step_s"] > 0 for r in rows)
    assert rows[1]["kept"] < rows[2]["kept"] < rows[0]["kept"]
    overheads = recompute_cost.step_overheads(config, B, steps=1, dtype=np.float64)
    assert overheads["full_extra"] == overheads["full"] / overheads["none"] - 1
