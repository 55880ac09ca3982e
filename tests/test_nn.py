"""Modules: parameter names and order, tied weights, modes, gradients, state dicts."""
import numpy as np
import pytest

from minidist.core import nn
from minidist.core.gradcheck import gradcheck
from minidist.core.tensor import Tensor, default_dtype


class Tied(nn.Module):
    """Two linears sharing one weight, plus a nested list of blocks."""

    def __init__(self):
        self.first = nn.Linear(3, 3)
        self.blocks = nn.ModuleList([nn.LayerNorm(3), nn.Linear(3, 2, bias=False)])
        self.second = nn.Linear(3, 3)
        self.second.weight = self.first.weight  # tied
        self.scale = nn.Parameter(np.ones(1))

    def forward(self, x):
        return self.blocks[1](self.blocks[0](self.second(self.first(x)))) * self.scale


def filled(module, seed=0):
    rng = np.random.default_rng(seed)
    for p in module.parameters():
        p.data[...] = rng.standard_normal(p.shape)
    return module


def test_named_parameters_dotted_names_in_assignment_order():
    names = [name for name, _ in Tied().named_parameters()]
    # a module's own parameters first, then each child's in assignment order (as PyTorch)
    assert names == ["scale", "first.weight", "first.bias", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight",
                     "second.bias"]
    assert names == [name for name, _ in Tied().named_parameters()]  # stable across constructions


def test_tied_weight_appears_once():
    m = Tied()
    params = m.parameters()
    assert len(params) == 7
    assert sum(p is m.first.weight for p in params) == 1
    assert m.num_parameters() == 9 + 3 + 3 + 3 + 6 + 3 + 1
    assert list(m.state_dict()) == [name for name, _ in m.named_parameters()]


def test_tied_weight_gets_both_contributions():
    with default_dtype(np.float64):
        m = filled(Tied(), seed=1)
    x = Tensor(np.random.default_rng(2).standard_normal((4, 3)))
    assert gradcheck(lambda *ps: m(x), *m.parameters())
    # the tied weight's gradient is the sum of what each use contributes
    m.zero_grad()
    m(x).sum().backward()
    tied = m.first.weight.grad.copy()
    m.second.weight = nn.Parameter(m.first.weight.data, np.float64)  # untie, same values
    m.zero_grad()
    m(x).sum().backward()
    np.testing.assert_allclose(tied, m.first.weight.grad + m.second.weight.grad, rtol=1e-12)
    assert np.abs(m.second.weight.grad).sum() > 0 and np.abs(m.first.weight.grad).sum() > 0


def test_named_modules_and_children():
    m = Tied()
    assert [name for name, _ in m.named_children()] == ["first", "blocks", "second"]
    assert [name for name, _ in m.named_modules()] == ["", "first", "blocks", "blocks.0", "blocks.1", "second"]
    assert [name for name, _ in m.named_parameters(prefix="model")][:2] == ["model.scale", "model.first.weight"]


def test_train_eval_reach_every_submodule():
    m = Tied()
    m.blocks._items.append(nn.Dropout(0.5))
    m.drop = nn.Dropout(0.5, seed=3)
    assert m.eval() is m
    assert all(not mod.training for _, mod in m.named_modules())
    x = Tensor(np.ones((4, 8)))
    assert m.drop(x) is x
    m.train()
    assert all(mod.training for _, mod in m.named_modules())
    y = m.drop(x)
    assert set(np.unique(y.data)) == {0.0, 2.0}


def test_dropout_module_is_seeded():
    x = Tensor(np.ones((5, 7)))
    a = nn.Dropout(0.3, seed=4)(x).data
    b = nn.Dropout(0.3, seed=4)(x).data
    c = nn.Dropout(0.3, seed=5)(x).data
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\), got -0.1"):
        nn.Dropout(-0.1)


def test_zero_grad():
    m = filled(Tied())
    m(Tensor(np.ones((2, 3), np.float32))).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_linear_module_matches_formula():
    with default_dtype(np.float64):
        lin = filled(nn.Linear(4, 3), seed=5)
        no_bias = nn.Linear(4, 3, bias=False)
    assert lin.weight.shape == (3, 4) and lin.bias.shape == (3,)
    assert no_bias.bias is None and [n for n, _ in no_bias.named_parameters()] == ["weight"]
    x = np.random.default_rng(6).standard_normal((2, 5, 4))
    np.testing.assert_allclose(lin(Tensor(x)).data, x @ lin.weight.data.T + lin.bias.data, rtol=1e-12)
    assert gradcheck(lambda w, b: lin(Tensor(x)), lin.weight, lin.bias)


def test_layernorm_and_embedding_modules():
    ln = nn.LayerNorm(4)
    np.testing.assert_array_equal(ln.weight.data, np.ones(4))
    np.testing.assert_array_equal(ln.bias.data, np.zeros(4))
    out = ln(Tensor(np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)))
    np.testing.assert_allclose(out.data.mean(), 0.0, atol=1e-6)
    np.testing.assert_allclose(out.data.std(), 1.0, rtol=1e-4)
    emb = filled(nn.Embedding(5, 2))
    np.testing.assert_array_equal(emb(np.array([4, 0, 4])).data, emb.weight.data[[4, 0, 4]])


def test_parameter_dtype_follows_default_dtype():
    assert nn.Linear(2, 2).weight.dtype == np.float32
    with default_dtype(np.float64):
        assert nn.Linear(2, 2).weight.dtype == np.float64
        assert nn.LayerNorm(2).bias.dtype == np.float64
    assert nn.Linear(2, 2, dtype=np.float64).weight.dtype == np.float64
    p = nn.Parameter([1.0, 2.0])
    assert p.requires_grad and p.is_leaf and p.dtype == np.float32
    src = np.zeros(2, np.float32)
    q = nn.Parameter(src)
    q.data += 1.0
    np.testing.assert_array_equal(src, 0.0)  # a Parameter owns a copy


# ----------------------------------------------------------------------------- state dicts


def test_state_dict_round_trip():
    a, b = filled(Tied(), seed=7), filled(Tied(), seed=8)
    x = Tensor(np.random.default_rng(9).standard_normal((2, 3)).astype(np.float32))
    state = a.state_dict()
    assert list(state) == ["scale", "first.weight", "first.bias", "blocks.0.weight", "blocks.0.bias",
                           "blocks.1.weight", "second.bias"]
    assert not np.array_equal(a(x).data, b(x).data)
    b.load_state_dict(state)
    np.testing.assert_array_equal(a(x).data, b(x).data)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(pa.data, pb.data)
        assert pa.data is not pb.data
    assert b.second.weight is b.first.weight  # loading keeps the tie


def test_state_dict_is_a_copy():
    m = filled(Tied())
    state = m.state_dict()
    state["scale"][...] = 42.0
    assert m.scale.data[0] != 42.0
    before = m.scale.data.copy()
    m.load_state_dict(m.state_dict())
    state2 = {k: v * 2 for k, v in m.state_dict().items()}
    m.load_state_dict(state2)
    np.testing.assert_array_equal(m.scale.data, before * 2)


def test_load_state_dict_casts_to_parameter_dtype():
    m = Tied()
    state = {k: v.astype(np.float64) + 1.0 for k, v in m.state_dict().items()}
    m.load_state_dict(state)
    assert m.first.weight.dtype == np.float32
    np.testing.assert_array_equal(m.first.bias.data, np.ones(3, np.float32))


def test_load_state_dict_missing_key():
    m = Tied()
    state = m.state_dict()
    del state["blocks.0.bias"]
    with pytest.raises(KeyError, match=r"missing keys \['blocks.0.bias'\], unexpected keys \[\]"):
        m.load_state_dict(state)


def test_load_state_dict_unexpected_key():
    m = Tied()
    state = m.state_dict()
    state["second.weight"] = np.zeros((3, 3))
    with pytest.raises(KeyError, match=r"missing keys \[\], unexpected keys \['second.weight'\]"):
        m.load_state_dict(state)
    m.load_state_dict(state, strict=False)  # non-strict skips it


def test_load_state_dict_wrong_shape_names_key_and_shapes():
    m = filled(Tied())
    before = m.state_dict()
    state = m.state_dict()
    state["first.bias"] = np.ones(3) * 5
    state["blocks.1.weight"] = np.zeros((3, 2))
    with pytest.raises(ValueError, match=r"blocks.1.weight has shape \(2, 3\) in the model but \(3, 2\) in the state dict"):
        m.load_state_dict(state)
    with pytest.raises(ValueError, match=r"blocks.1.weight has shape \(2, 3\)"):
        m.load_state_dict(state, strict=False)
    for name, value in m.state_dict().items():  # nothing was half-loaded
        np.testing.assert_array_equal(value, before[name])


def test_modulelist_indexing():
    layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 3)])
    assert len(layers) == 2 and layers[1].out_features == 3
    assert [m.out_features for m in layers] == [2, 3]
    assert [n for n, _ in layers.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]


def test_module_forward_must_be_defined():
    with pytest.raises(NotImplementedError):
        nn.Module()(1)
