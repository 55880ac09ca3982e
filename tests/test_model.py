"""The GPT: configuration errors, seeded initialisation, dtypes, gradients, and overfitting a batch."""
import math

import numpy as np
import pytest

from minidist.core.gradcheck import gradcheck
from minidist.core.model import GPT, GPTConfig, init_weights
from minidist.core.optim import AdamW
from minidist.core.tensor import default_dtype

TINY = dict(vocab_size=7, block_size=4, n_layer=2, n_head=2, n_embd=4)
SMALL = dict(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16)


def gpt(seed=0, dtype=np.float64, **overrides):
    with default_dtype(dtype):
        return GPT(GPTConfig(**{**SMALL, **overrides}), seed=seed)


def batch(config, b=2, t=None, seed=0):
    rng = np.random.default_rng(seed)
    t = t or config.block_size
    return rng.integers(0, config.vocab_size, (b, t)), rng.integers(0, config.vocab_size, (b, t))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_embd=10, n_head=3), "n_embd=10 is not divisible by n_head=3"),
    (dict(n_layer=0), "n_layer must be a positive integer, got 0"),
    (dict(vocab_size=-5), "vocab_size must be a positive integer, got -5"),
    (dict(block_size=2.5), "block_size must be a positive integer, got 2.5"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=f"GPTConfig: {message}"):
        GPTConfig(**kwargs)


def test_config_to_dict():
    assert GPTConfig(**TINY).to_dict() == {**TINY, "dropout": 0.0, "tie_weights": True}


# ----------------------------------------------------------------------------- structure


def test_parameter_names_and_count():
    m = gpt(**TINY)
    names = [n for n, _ in m.named_parameters()]
    block = ["ln_1.weight", "ln_1.bias", "attn.q_proj.weight", "attn.q_proj.bias", "attn.k_proj.weight",
             "attn.k_proj.bias", "attn.v_proj.weight", "attn.v_proj.bias", "attn.c_proj.weight", "attn.c_proj.bias",
             "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]
    assert names == ["wte.weight", "wpe.weight"] + [f"h.{i}.{n}" for i in range(2) for n in block] + \
        ["ln_f.weight", "ln_f.bias"]
    v, t, c, layers = 7, 4, 4, 2
    per_block = 2 * c + 4 * (c * c + c) + 2 * c + (c * 4 * c + 4 * c) + (4 * c * c + c)
    assert m.num_parameters() == v * c + t * c + layers * per_block + 2 * c
    untied = gpt(**TINY, tie_weights=False)
    assert [n for n, _ in untied.named_parameters()][-1] == "lm_head.weight"
    assert untied.num_parameters() == m.num_parameters() + v * c


def test_forward_shapes_and_initial_loss():
    m = gpt()
    idx, tgt = batch(m.config, b=3, t=5)
    logits, loss = m(idx, tgt)
    assert logits.shape == (3, 5, 16)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(16)) < 0.05  # small init: nearly uniform predictions
    logits2, no_loss = m(idx)
    assert no_loss is None
    np.testing.assert_array_equal(logits.data, logits2.data)


def test_parts_compose_to_forward():
    m = gpt()
    idx, tgt = batch(m.config)
    x = m.embed(idx)
    for block in m.h:
        x = block(x)
    logits, loss = m.head(x, tgt)
    ref_logits, ref_loss = m(idx, tgt)
    np.testing.assert_array_equal(logits.data, ref_logits.data)
    assert loss.item() == ref_loss.item()


def test_model_is_causal():
    m = gpt()
    idx, _ = batch(m.config)
    other = idx.copy()
    other[:, -1] = (other[:, -1] + 1) % 16
    a, _ = m(idx)
    b, _ = m(other)
    np.testing.assert_array_equal(a.data[:, :-1], b.data[:, :-1])
    assert not np.allclose(a.data[:, -1], b.data[:, -1])


# ----------------------------------------------------------------------------- bad input


def test_sequence_longer_than_block_size():
    m = gpt()
    with pytest.raises(ValueError, match="GPT: sequence length 9 is longer than block_size=8"):
        m(np.zeros((1, 9), dtype=np.int64))


def test_ids_must_be_two_dimensional():
    with pytest.raises(ValueError, match=r"GPT expects token ids of shape \(batch, time\), got \(5,\)"):
        gpt()(np.zeros(5, dtype=np.int64))


def test_token_id_outside_vocabulary():
    m = gpt()
    with pytest.raises(IndexError, match=r"embedding: id 16 is outside the table of 16 rows \(valid ids are 0..15\)"):
        m(np.array([[1, 16, 2]]))
    with pytest.raises(IndexError, match="cross_entropy: target 20 is outside the vocabulary of size 16"):
        m(np.array([[1, 2, 3]]), np.array([[1, 20, 2]]))


# ----------------------------------------------------------------------------- initialisation


def test_same_seed_bitwise_identical_different_seed_differs():
    a, b, c = gpt(seed=3), gpt(seed=3), gpt(seed=4)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        np.testing.assert_array_equal(pa.data, pb.data)
        if name.endswith("bias") or ".ln_" in name or name.startswith("ln_"):
            np.testing.assert_array_equal(pa.data, pc.data)  # zeros and ones do not depend on the seed
        else:
            assert not np.any(pa.data == pc.data), name


def test_init_statistics():
    m = gpt(n_embd=64, n_layer=2, vocab_size=64, block_size=64)
    params = dict(m.named_parameters())
    assert abs(params["wte.weight"].data.std() - 0.02) < 0.001
    assert abs(params["h.0.mlp.c_fc.weight"].data.std() - 0.02) < 0.001
    assert abs(params["h.1.attn.c_proj.weight"].data.std() - 0.02 / math.sqrt(4)) < 0.0005
    assert abs(params["h.1.mlp.c_proj.weight"].data.std() - 0.02 / math.sqrt(4)) < 0.0005
    np.testing.assert_array_equal(params["h.0.ln_1.weight"].data, 1.0)
    np.testing.assert_array_equal(params["ln_f.bias"].data, 0.0)
    np.testing.assert_array_equal(params["h.0.attn.q_proj.bias"].data, 0.0)
    # different parameters of the same shape get different numbers
    assert not np.allclose(params["h.0.attn.q_proj.weight"].data, params["h.0.attn.k_proj.weight"].data)
    assert not np.allclose(params["h.0.attn.q_proj.weight"].data, params["h.1.attn.q_proj.weight"].data)


def test_init_independent_of_model_depth():
    """A parameter's initial value depends only on (seed, name): the piece of a bigger model is the same."""
    small, big = gpt(seed=5, n_layer=2), gpt(seed=5, n_layer=4)
    big_params = dict(big.named_parameters())
    for name, p in small.named_parameters():
        if name.endswith("c_proj.weight"):  # std 0.02 / sqrt(2 n_layer): scaled, same draws
            np.testing.assert_allclose(p.data, big_params[name].data * math.sqrt(2), rtol=1e-13)
        else:
            np.testing.assert_array_equal(p.data, big_params[name].data)
    np.testing.assert_array_equal(small.h[0].attn.q_proj.weight.data, big.h[0].attn.q_proj.weight.data)
    init_weights(small, seed=5, n_layer=4)  # with the big model's depth, every number matches
    for name, p in small.named_parameters():
        np.testing.assert_array_equal(p.data, big_params[name].data)


def test_init_independent_of_tying():
    tied, untied = gpt(seed=6), gpt(seed=6, tie_weights=False)
    untied_params = dict(untied.named_parameters())
    for name, p in tied.named_parameters():
        np.testing.assert_array_equal(p.data, untied_params[name].data)


# ----------------------------------------------------------------------------- dtypes


def test_model_dtype_follows_default_dtype():
    m32 = gpt(dtype=np.float32)
    m64 = gpt(dtype=np.float64)
    assert all(p.dtype == np.float32 for p in m32.parameters())
    assert all(p.dtype == np.float64 for p in m64.parameters())
    for p32, p64 in zip(m32.parameters(), m64.parameters()):  # same draws, then cast
        np.testing.assert_array_equal(p32.data, p64.data.astype(np.float32))
    idx, tgt = batch(m32.config)
    logits, loss = m32(idx, tgt)
    assert logits.dtype == np.float32 and loss.dtype == np.float32
    loss.backward()
    assert all(p.grad.dtype == np.float32 for p in m32.parameters())
    logits64, loss64 = m64(idx, tgt)
    assert logits64.dtype == np.float64
    np.testing.assert_allclose(loss.item(), loss64.item(), rtol=1e-5)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_gradcheck(tie):
    m = gpt(seed=7, tie_weights=tie, **TINY)
    idx, tgt = batch(m.config, b=2, seed=8)
    for p in m.parameters():  # make LayerNorm gains and biases non-trivial
        p.data += np.random.default_rng(9).normal(0, 0.3, p.shape)
    assert gradcheck(lambda *params: m(idx, tgt)[1], *m.parameters(), atol=1e-7, rtol=1e-5)


def test_tied_embedding_hook_fires_once_with_complete_gradient():
    tied = gpt(seed=10, **TINY)
    untied = gpt(seed=10, tie_weights=False, **TINY)
    untied.lm_head.weight.data[...] = untied.wte.weight.data
    idx, tgt = batch(tied.config, seed=11)
    seen = []
    tied.wte.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.copy()))
    tied(idx, tgt)[1].backward()
    untied(idx, tgt)[1].backward()
    assert len(seen) == 1
    expected = untied.wte.weight.grad + untied.lm_head.weight.grad
    np.testing.assert_allclose(seen[0], expected, rtol=1e-10, atol=1e-15)
    np.testing.assert_array_equal(tied.wte.weight.grad, seen[0])


def test_every_parameter_hook_fires_once_per_backward():
    m = gpt(**TINY)
    counts = {}
    for name, p in m.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    idx, tgt = batch(m.config)
    for expected in (1, 2):
        m(idx, tgt)[1].backward()
        assert counts == {name: expected for name, _ in m.named_parameters()}


def test_gradients_accumulate_over_micro_batches():
    m = gpt(seed=12)
    idx, tgt = batch(m.config, b=4, seed=13)
    m(idx, tgt)[1].backward()
    full = [p.grad.copy() for p in m.parameters()]
    m.zero_grad()
    for half in (slice(0, 2), slice(2, 4)):
        (m(idx[half], tgt[half])[1] * 0.5).backward()
    for g, p in zip(full, m.parameters()):
        np.testing.assert_allclose(p.grad, g, rtol=1e-10, atol=1e-15)


# ----------------------------------------------------------------------------- dropout, generate, training


def test_dropout_train_and_eval():
    m = gpt(seed=14, dropout=0.2)
    plain = gpt(seed=14)
    idx, tgt = batch(m.config)
    a, b = m(idx)[0].data, m(idx)[0].data
    assert not np.allclose(a, b)  # a fresh mask each call
    m.eval()
    np.testing.assert_array_equal(m(idx)[0].data, plain(idx)[0].data)
    m2 = gpt(seed=14, dropout=0.2)  # reproducible from the seed
    np.testing.assert_array_equal(m2(idx)[0].data, a)


def test_generate_is_greedy():
    m = gpt(seed=15)
    idx = np.array([[1, 2, 3], [4, 5, 6]])
    out = m.generate(idx, 6)
    assert out.shape == (2, 9)
    np.testing.assert_array_equal(out[:, :3], idx)
    for step in range(3, 9):
        context = out[:, max(0, step - 8):step]
        np.testing.assert_array_equal(out[:, step], m(context)[0].data[:, -1].argmax(-1))
    assert m.training  # mode restored


def test_overfits_one_batch():
    m = gpt(seed=16)
    idx, tgt = batch(m.config, b=4, seed=17)
    opt = AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(150):
        _, loss = m(idx, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 2.5
    assert losses[-1] < 0.01
    m.eval()
    np.testing.assert_array_equal(m(idx)[0].data.argmax(-1), tgt)
