"""The serial mixture-of-experts GPT (chapter 11, part 3): routing rule, outputs, aux loss, gradients.

The routing rule is checked on hand-made choices (queue places, capacity, first come first
served, first choices before second choices, the same places when the batch is cut into
slices); the layer's output and aux loss against values computed by hand; its backward and the
whole model's against finite differences in float64, after checking that the perturbations
cannot flip a routing decision.
"""
import numpy as np
import pytest

from minidist.core.data import make_task
from minidist.core.gradcheck import gradcheck
from minidist.core.model import GPT, GPTConfig
from minidist.core.moe import (MoEConfig, MoEGPT, MoELayer, assign_slots, choice_counts, expert_capacity,
                               queue_starts, top_k_experts)
from minidist.plan.memory import moe_param_count
from minidist.core.tensor import Tensor, default_dtype
from minidist.training.train import MoETrainer, OptimSettings

TINY = dict(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8, num_experts=4)


def mlp(expert, x: np.ndarray) -> np.ndarray:
    """An expert MLP applied with NumPy (GELU, tanh form): the reference for the layer's output."""
    h = x @ expert.c_fc.weight.data.T + expert.c_fc.bias.data
    h = 0.5 * h * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (h + 0.044715 * h ** 3)))
    return h @ expert.c_proj.weight.data.T + expert.c_proj.bias.data


# ----------------------------------------------------------------------------- the rule, by hand


def test_config_rejects_bad_values_in_one_line():
    for changes, words in ((dict(num_experts=1), "num_experts"), (dict(top_k=3), "top_k"),
                           (dict(capacity_factor=0.0), "capacity_factor"), (dict(aux_loss_coef=-1.0), "aux_loss_coef")):
        with pytest.raises(ValueError, match=words) as error:
            MoEConfig(**{**TINY, **changes})
        assert "\n" not in str(error.value)


def test_capacity_is_ceil_of_k_tokens_over_experts_times_factor():
    assert expert_capacity(64, 4, 1, 1.0) == 16
    assert expert_capacity(64, 4, 1, 1.25) == 20
    assert expert_capacity(64, 4, 2, 1.0) == 32      # k = 2: twice the choices
    assert expert_capacity(6, 4, 1, 1.0) == 2        # ceil(1.5)
    assert expert_capacity(40, 4, 1, 1.1) == 11      # 11.000000000000002 in floating point: still 11


def test_top_k_takes_the_most_probable_and_ties_go_to_the_lower_id():
    probs = np.array([[0.1, 0.6, 0.3], [0.4, 0.2, 0.4], [1 / 3, 1 / 3, 1 / 3]])
    assert top_k_experts(probs, 2).tolist() == [[1, 2], [0, 2], [0, 1]]


def test_first_come_first_served_with_first_choices_before_second_choices():
    experts = np.array([[0, 1], [0, 2], [1, 0], [0, 1], [2, 0], [0, 2]])  # (token, choice)
    counts = choice_counts(experts, 3)
    assert counts.tolist() == [[4, 1, 1], [2, 2, 2]]
    slots = assign_slots(experts, queue_starts(counts[None])[0])
    # expert 0: first choices of tokens 0, 1, 3, 5 take 0-3; then second choices of 2, 4 take 4, 5
    # expert 1: first choice of token 2 takes 0; second choices of 0, 3 take 1, 2
    # expert 2: first choice of token 4 takes 0; second choices of 1, 5 take 1, 2
    assert slots.tolist() == [[0, 1], [1, 1], [0, 4], [2, 2], [0, 5], [3, 2]]
    capacity = expert_capacity(6, 3, 2, 1.0)  # 4
    assert capacity == 4
    # token 2's second choice is expert 0's 5th (place 4), token 4's its 6th: dropped
    assert (slots < capacity).tolist() == [[True, True], [True, True], [True, False], [True, True],
                                          [True, False], [True, True]]


def test_slices_of_the_batch_get_the_places_the_whole_batch_gives():
    rng = np.random.default_rng(0)
    experts = np.stack([rng.permutation(4)[:2] for _ in range(12)])  # 12 tokens, k = 2, E = 4
    whole = assign_slots(experts, queue_starts(choice_counts(experts, 4)[None])[0])
    slices = np.split(experts, 3)
    starts = queue_starts(np.stack([choice_counts(s, 4) for s in slices]))
    cut = np.concatenate([assign_slots(s, starts[r]) for r, s in enumerate(slices)])
    np.testing.assert_array_equal(cut, whole)


# ----------------------------------------------------------------------------- the layer


def uniform_layer(top_k: int, capacity_factor: float):
    """A layer whose router weight is zero: every probability is 1/E, every tie goes to the
    lowest ids, so every token picks expert 0 (and 1): a routing known by hand."""
    layer = MoELayer(MoEConfig(**{**TINY, "top_k": top_k, "capacity_factor": capacity_factor}), seed=0)
    rng = np.random.default_rng(1)
    for e, expert in layer.experts.items():
        for p in expert.parameters():
            p.data[...] = rng.normal(0, 0.3, p.shape)
    layer.router.weight.data[...] = 0.0
    return layer


@pytest.mark.parametrize("top_k", [1, 2])
def test_tokens_over_capacity_pass_with_zero_output(top_k):
    with default_dtype("float64"):
        layer = uniform_layer(top_k, capacity_factor=1.0)
        x = np.random.default_rng(2).standard_normal((2, 6, 8))  # 12 tokens, capacity 3 (k = 1) or 6 (k = 2)
        y = layer(Tensor(x)).data.reshape(12, 8)
    capacity = 3 * top_k
    tokens = x.reshape(12, 8)
    gate = 1.0 / 4 if top_k == 1 else 0.5  # k = 2: two equal probabilities, renormalised
    expected = sum(gate * mlp(layer.experts.items()[e][1], tokens) for e in range(top_k))
    expected[capacity:] = 0.0  # tokens in positions >= capacity find every queue full
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-14)
    assert layer.stats["tokens_per_expert"] == ([12, 0, 0, 0] if top_k == 1 else [12, 12, 0, 0])
    assert layer.stats["dropped_per_expert"] == ([9, 0, 0, 0] if top_k == 1 else [6, 6, 0, 0])
    # f = (1, 0, 0, 0), P = 1/E: alpha x E x 1 x 1/E = alpha
    assert layer.aux_loss.item() == pytest.approx(0.01, rel=1e-12)


@pytest.mark.parametrize("top_k", [1, 2])
def test_output_and_aux_loss_by_hand(top_k):
    with default_dtype("float64"):
        layer = MoELayer(MoEConfig(**{**TINY, "top_k": top_k, "capacity_factor": 1.0, "aux_loss_coef": 0.1}), seed=3)
        layer.router.weight.data[...] = np.random.default_rng(4).normal(0, 1.0, layer.router.weight.shape)
        x = np.random.default_rng(5).standard_normal((2, 8, 8))
        y = layer(Tensor(x)).data.reshape(16, 8)
    tokens = x.reshape(16, 8)
    logits = tokens @ layer.router.weight.data.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = top_k_experts(probs, top_k)
    gates = np.take_along_axis(probs, experts, axis=1)
    gates = gates / gates.sum(1, keepdims=True) if top_k == 2 else gates
    capacity = expert_capacity(16, 4, top_k, 1.0)
    seen, expected = np.zeros(4, int), np.zeros((16, 8))
    for j in range(top_k):  # queue by hand: first choices of all tokens, then second choices
        for n in range(16):
            e = experts[n, j]
            if seen[e] < capacity:
                expected[n] += gates[n, j] * mlp(layer.experts.items()[e][1], tokens[n:n + 1])[0]
            seen[e] += 1
    assert sum(layer.stats["dropped_per_expert"]) == np.maximum(seen - capacity, 0).sum() > 0
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-14)
    f = np.bincount(experts[:, 0], minlength=4) / 16
    assert layer.aux_loss.item() == pytest.approx(0.1 * 4 * np.sum(f * probs.mean(0)), rel=1e-12)


def routing_margin(probs: np.ndarray, k: int) -> float:
    """The smallest gap between a token's j-th and (j+1)-th probabilities, j <= k: how far every
    choice (and which one is first) is from flipping."""
    ordered = -np.sort(-probs, axis=1)
    return float(np.min(ordered[:, :k] - ordered[:, 1:k + 1]))


@pytest.mark.parametrize("top_k", [1, 2])
def test_layer_gradcheck_with_dropped_tokens(top_k):
    """Finite differences move each input by 1e-6; the routing margin is far larger, so no choice
    (and no queue place) can flip: the function is smooth where it is probed."""
    with default_dtype("float64"):
        layer = MoELayer(MoEConfig(**{**TINY, "top_k": top_k, "capacity_factor": 1.0, "aux_loss_coef": 0.5}), seed=6)
        layer.router.weight.data[...] = np.random.default_rng(7).normal(0, 1.0, layer.router.weight.shape)
        x = Tensor(np.random.default_rng(8).standard_normal((2, 4, 8)), requires_grad=True)
        y = layer(x)
        assert sum(layer.stats["dropped_per_expert"]) > 0
        assert routing_margin(layer.routing.probs, top_k) > 1e-4  # 100x the perturbation
        choices = layer.routing.experts.copy()

        def fn(x, *params):
            return layer(x) + layer.aux_loss  # the aux loss's gradient flows into the router too

        expert = layer.experts.items()[0][1]
        assert gradcheck(fn, x, layer.router.weight, expert.c_fc.weight, expert.c_proj.bias, eps=1e-6, atol=1e-7)
        assert y.shape == (2, 4, 8)
        np.testing.assert_array_equal(layer.routing.experts, choices)


def test_whole_model_gradcheck():
    config = MoEConfig(**{**TINY, "top_k": 2, "capacity_factor": 1.0, "aux_loss_coef": 0.1})
    with default_dtype("float64"):
        model = MoEGPT(config, seed=0)
        for block in model.h:  # a decisive router: the default N(0, 0.02) leaves near-ties
            block.mlp.router.weight.data *= 50.0
        rng = np.random.default_rng(9)
        x, y = rng.integers(0, 16, (2, 4)), rng.integers(0, 16, (2, 4))
        model(x, y)
        assert sum(sum(block.mlp.stats["dropped_per_expert"]) for block in model.h) > 0
        assert min(routing_margin(block.mlp.routing.probs, 2) for block in model.h) > 1e-4
        params = dict(model.named_parameters())
        names = ["wpe.weight", "h.0.ln_2.weight", "h.0.mlp.router.weight", "h.1.mlp.router.weight",
                 "h.1.mlp.experts.2.c_fc.bias", "h.0.mlp.experts.1.c_proj.bias"]

        def loss(*_):
            return model(x, y)[1]

        assert gradcheck(loss, *(params[n] for n in names), eps=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- the model and its trainer


def test_parameters_names_and_initialisation():
    config = MoEConfig(**TINY)
    dense = GPT(GPTConfig(**{k: v for k, v in TINY.items() if k != "num_experts"}), seed=3)
    model = MoEGPT(config, seed=3)
    assert model.num_parameters() == moe_param_count(config)
    names = [n for n, _ in model.named_parameters()]
    assert "h.1.mlp.router.weight" in names and "h.1.mlp.experts.3.c_proj.weight" in names
    assert not any(".mlp.c_fc" in n for n in names)  # the dense MLP is gone
    shared = dense.state_dict()
    for name, value in model.state_dict().items():  # everything but the MLPs: the dense GPT's numbers
        if name in shared:
            np.testing.assert_array_equal(value, shared[name])
    experts = model.h[0].mlp.experts.items()
    assert not np.array_equal(experts[0][1].c_fc.weight.data, experts[1][1].c_fc.weight.data)


def test_loss_is_cross_entropy_plus_every_layers_aux_loss():
    from minidist.core import functional as F

    with default_dtype("float64"):
        model = MoEGPT(MoEConfig(**TINY), seed=0)
        rng = np.random.default_rng(1)
        x, y = rng.integers(0, 16, (2, 4)), rng.integers(0, 16, (2, 4))
        logits, loss = model(x, y)
        aux = sum(block.mlp.aux_loss.item() for block in model.h)
        assert loss.item() == pytest.approx(F.cross_entropy(logits, y).item() + aux, rel=1e-14)
        assert aux > 0


def test_trainer_reports_the_routing_of_every_step():
    config = MoEConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, num_experts=4,
                       capacity_factor=1.0)
    trainer = MoETrainer(config, OptimSettings(lr=1e-2, steps=3, warmup=1), make_task("sort", 16), 8)
    losses = [trainer.step(s)[0] for s in range(3)]
    assert losses[-1] < losses[0]
    moe = trainer.report()["moe"]
    assert moe["capacity"] == 32 and len(moe["tokens_per_expert"]) == 3
    for step in range(3):
        assert [sum(layer) for layer in moe["tokens_per_expert"][step]] == [128, 128]  # every token, once
        assert moe["dropped_tokens"][step] == sum(map(sum, moe["dropped_per_expert"][step]))
        processed = np.array(moe["tokens_per_expert"][step]) - np.array(moe["dropped_per_expert"][step])
        assert processed.max() <= 32  # no expert beyond its capacity
    assert trainer.num_parameters() == moe_param_count(config)
