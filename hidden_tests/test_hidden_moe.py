"""Hidden checks of the MoE queue places (chapter 11): top-2 routing cut into 2 to 6 slices of
the batch, of equal and unequal sizes, with experts chosen first by some tokens and second by
others; then whole layers whose capacity drops choices.

The expected places are counted here one choice at a time, in the queue's order: every first
choice before any second choice; within a choice, slice after slice; within a slice, by position."""
import numpy as np
import pytest

from minidist.core.moe import MoEConfig, MoELayer, assign_slots, choice_counts, expert_capacity, queue_starts
from minidist.core.tensor import Tensor, default_dtype


def counted_by_hand(slices, num_experts):
    """The place of every choice in its expert's queue, slice by slice: [(N_r, k) arrays]."""
    seen = np.zeros(num_experts, dtype=np.int64)
    places = [np.empty(s.shape, dtype=np.int64) for s in slices]
    for j in range(slices[0].shape[1]):
        for s, place in zip(slices, places):
            for n, e in enumerate(s[:, j]):
                place[n, j] = seen[e]
                seen[e] += 1
    return places


def routed(seed, sizes, num_experts, k):
    """Each slice's (N_r, k) distinct expert choices, drawn so that some experts are popular."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(num_experts, 0.7))
    return [np.stack([rng.choice(num_experts, k, replace=False, p=weights) for _ in range(n)])
            for n in sizes]


CASES = [  # (seed, tokens in each slice, experts, k)
    (0, (5, 5), 3, 2), (1, (4, 4, 4), 4, 2), (2, (3, 3, 3, 3), 2, 2), (3, (6, 6, 6, 6, 6), 8, 2),
    (4, (7, 2, 5), 5, 2), (10, (1, 1), 2, 2), (6, (2, 3, 2, 3, 2, 3), 3, 2), (7, (9, 4), 3, 2),
    (8, (8, 8, 8, 8), 4, 1), (9, (5, 1, 6), 6, 1),
]


@pytest.mark.parametrize("seed, sizes, num_experts, k", CASES,
                         ids=[f"{len(c[1])}-slices-{sum(c[1])}-tokens-{c[2]}-experts-top{c[3]}" for c in CASES])
def test_every_slice_gets_the_places_of_the_whole_batch(seed, sizes, num_experts, k):
    """queue_starts of the slices' counts, then assign_slots on each slice, give every choice its
    place counted by hand; the whole batch in one slice gives the same places; and the choices
    kept under a capacity are the ones Routing.kept_counts counts."""
    slices = routed(seed, sizes, num_experts, k)
    want = counted_by_hand(slices, num_experts)
    counts = np.stack([choice_counts(s, num_experts) for s in slices])
    starts = queue_starts(counts)
    assert starts.shape == counts.shape
    for r, (s, w) in enumerate(zip(slices, want)):
        np.testing.assert_array_equal(assign_slots(s, starts[r]), w, err_msg=f"slice {r}")
    whole = np.concatenate(slices)  # one slice: the places are the same
    np.testing.assert_array_equal(assign_slots(whole, queue_starts(choice_counts(whole, num_experts)[None])[0]),
                                  np.concatenate(want))
    capacity = expert_capacity(sum(sizes), num_experts, k, 0.8)
    kept = np.clip(capacity - starts, 0, counts)  # Routing.kept_counts
    for r, w in enumerate(want):
        for j in range(k):
            got = np.bincount(slices[r][w[:, j] < capacity, j], minlength=num_experts)
            np.testing.assert_array_equal(kept[r, j], got, err_msg=f"slice {r}, choice {j}")


@pytest.mark.parametrize("top_k, capacity_factor", [(2, 0.5), (2, 0.75), (1, 0.6)])
def test_a_layer_drops_the_choices_over_capacity_first_choices_first(top_k, capacity_factor):
    """A layer of 6 experts on 3 x 5 tokens with a random router and a small capacity: its output
    is each token's gated experts' outputs for the choices under capacity, its routing's places
    are the ones counted by hand (first choices before second ones), and its stats count the
    dropped choices."""
    with default_dtype("float64"):
        config = MoEConfig(vocab_size=16, block_size=5, n_layer=1, n_head=2, n_embd=8, num_experts=6, top_k=top_k,
                           capacity_factor=capacity_factor)
        layer = MoELayer(config, seed=11)
        layer.router.weight.data[...] = np.random.default_rng(12).normal(0, 1.5, layer.router.weight.shape)
        x = np.random.default_rng(13).standard_normal((3, 5, 8))
        y = layer(Tensor(x)).data.reshape(15, 8)
        tokens = x.reshape(15, 8)
        logits = tokens @ layer.router.weight.data.T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
        gates = np.take_along_axis(probs, experts, axis=1)
        gates = gates / gates.sum(1, keepdims=True) if top_k == 2 else gates
        capacity = expert_capacity(15, 6, top_k, capacity_factor)
        places = counted_by_hand([experts], 6)[0]
        expected = np.zeros((15, 8))
        for n in range(15):
            for j in range(top_k):
                if places[n, j] < capacity:
                    mlp = layer.experts.items()[experts[n, j]][1]
                    expected[n] += gates[n, j] * mlp(Tensor(tokens[n:n + 1])).data[0]
    np.testing.assert_array_equal(layer.routing.slots, places)
    dropped = np.bincount(experts[places >= capacity], minlength=6)
    assert dropped.sum() > 0 and layer.stats["dropped_per_expert"] == dropped.tolist()
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-14)
