"""Every operation against finite differences (float64) and against a plain NumPy reference."""
import math
import re

import numpy as np
import pytest

import minidist.core.functional as F
from minidist.core.gradcheck import gradcheck
from minidist.core.tensor import Tensor


def t64(*shape, seed=0, positive=False, grad=True):
    data = np.random.default_rng(seed).standard_normal(shape)
    if positive:
        data = np.abs(data) + 0.5
    return Tensor(data, requires_grad=grad)


def t32(*shape, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), requires_grad=True)


# ----------------------------------------------------------------------------- elementwise, broadcasting

BROADCAST_SHAPES = [
    ((2, 3, 4), (2, 3, 4)),
    ((2, 3, 4), (3, 1)),
    ((4,), (2, 3, 4)),
    ((2, 1, 4), (3, 1)),
    ((1,), (2, 3)),
    ((), (2, 3)),
]


@pytest.mark.parametrize("op", [F.add, F.sub, F.mul, F.div], ids=lambda f: f.__name__)
@pytest.mark.parametrize("shapes", BROADCAST_SHAPES, ids=str)
def test_binary_broadcasting_gradcheck(op, shapes):
    a = t64(*shapes[0], seed=1)
    b = t64(*shapes[1], seed=2, positive=True)
    out = op(a, b)
    ref = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[op.__name__]
    np.testing.assert_allclose(out.data, ref(a.data, b.data))
    assert gradcheck(op, a, b)
    assert gradcheck(op, b, t64(*shapes[0], seed=3, positive=True))  # the broadcast operand first


@pytest.mark.parametrize("op", [F.add, F.sub, F.mul, F.div], ids=lambda f: f.__name__)
@pytest.mark.parametrize("scalar", [2.5, np.float64(-1.5), 3])
def test_binary_with_scalar_operand_gradcheck(op, scalar):
    x = t64(2, 3, seed=4, positive=True)
    assert gradcheck(lambda x: op(x, scalar), x)
    assert gradcheck(lambda x: op(scalar, x), x)


def test_broadcast_gradient_values():
    a = Tensor(np.ones((2, 3, 4)), requires_grad=True)
    b = Tensor(np.ones((3, 1)), requires_grad=True)
    (a + b).sum().backward()
    np.testing.assert_array_equal(b.grad, np.full((3, 1), 8.0))
    c = Tensor(np.arange(4.0), requires_grad=True)
    d = Tensor(np.full((2, 3, 4), 2.0), requires_grad=True)
    (c * d).sum().backward()
    np.testing.assert_array_equal(c.grad, np.full(4, 12.0))
    np.testing.assert_array_equal(d.grad, np.broadcast_to(np.arange(4.0), (2, 3, 4)))


UNARY = [
    ("neg", F.neg, False),
    ("exp", F.exp, False),
    ("log", F.log, True),
    ("sqrt", F.sqrt, True),
    ("tanh", F.tanh, False),
    ("relu", F.relu, False),
    ("gelu", F.gelu, False),
    ("pow2", lambda x: F.pow(x, 2), False),
    ("pow3", lambda x: x ** 3, False),
    ("pow0", lambda x: x ** 0, False),
    ("pow1", lambda x: x ** 1, False),
    ("pow_half", lambda x: x ** 0.5, True),
    ("pow_minus1.5", lambda x: x ** -1.5, True),
]


@pytest.mark.parametrize("name,fn,positive", UNARY, ids=[u[0] for u in UNARY])
def test_unary_gradcheck(name, fn, positive):
    x = t64(3, 4, seed=5, positive=positive)
    if name == "relu":  # keep away from the kink
        x.data[np.abs(x.data) < 0.1] = 0.3
    assert gradcheck(fn, x)


def test_unary_values():
    x = np.array([0.5, 1.0, 2.0])
    tx = Tensor(x)
    np.testing.assert_allclose(F.exp(tx).data, np.exp(x))
    np.testing.assert_allclose(F.log(tx).data, np.log(x))
    np.testing.assert_allclose(F.sqrt(tx).data, np.sqrt(x))
    np.testing.assert_allclose((tx ** 3).data, x ** 3)
    np.testing.assert_allclose((tx ** -1.5).data, x ** -1.5)
    np.testing.assert_array_equal(F.relu(Tensor(np.array([-1.0, 0.0, 2.0]))).data, [0.0, 0.0, 2.0])
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    np.testing.assert_allclose(F.gelu(tx).data, 0.5 * x * (1 + np.tanh(u)), rtol=1e-14)


def test_pow_rejects_tensor_exponent():
    with pytest.raises(TypeError, match="only a scalar exponent"):
        F.pow(t64(2), t64(2))


# ----------------------------------------------------------------------------- matmul

MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((2, 3, 4), (4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (3, 4, 2)),
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul_gradcheck(shapes):
    a, b = t64(*shapes[0], seed=6), t64(*shapes[1], seed=7)
    np.testing.assert_allclose(F.matmul(a, b).data, a.data @ b.data, rtol=1e-12)
    assert gradcheck(F.matmul, a, b)


@pytest.mark.parametrize("shapes", [((2, 3), (4, 5)), ((3,), (3, 2)), ((2, 3, 4), (2, 5, 4))], ids=str)
def test_matmul_mismatch_names_shapes(shapes):
    a, b = t64(*shapes[0]), t64(*shapes[1])
    pattern = f"matmul: shapes {re.escape(str(shapes[0]))} and {re.escape(str(shapes[1]))} do not align"
    with pytest.raises(ValueError, match=pattern):
        F.matmul(a, b)


def test_matmul_mismatch_message():
    with pytest.raises(ValueError, match=r"matmul: shapes \(2, 3\) and \(4, 5\) do not align"):
        t64(2, 3) @ t64(4, 5)


# ----------------------------------------------------------------------------- reductions

AXES = [None, 0, -1, (0, 2), 1]


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("op", [F.sum, F.mean, F.max], ids=lambda f: f.__name__)
def test_reduction_gradcheck(op, axis, keepdims):
    x = t64(2, 3, 4, seed=8)  # continuous random values: no ties for max
    ref = {"sum": np.sum, "mean": np.mean, "max": np.max}[op.__name__]
    out = op(x, axis, keepdims)
    np.testing.assert_allclose(out.data, ref(x.data, axis=axis, keepdims=keepdims), rtol=1e-12)
    assert gradcheck(lambda x: op(x, axis, keepdims), x)


def test_max_ties_share_the_gradient():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]]), requires_grad=True)
    x.max(axis=1).sum().backward()
    np.testing.assert_array_equal(x.grad, [[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])


def test_max_float32_gradient_stays_float32():
    x = t32(3, 4)
    x.max(axis=0).sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad.sum(axis=0), np.ones(4, np.float32))


# ----------------------------------------------------------------------------- shapes and indexing


@pytest.mark.parametrize("fn", [
    lambda x: x.reshape(6, 4),
    lambda x: x.reshape(-1),
    lambda x: F.reshape(x, (4, 3, 2)),
    lambda x: x.permute(2, 0, 1),
    lambda x: F.permute(x, (1, -1, 0)),
    lambda x: x.transpose(),
    lambda x: F.transpose(x, 0, 2),
    lambda x: x.T,
], ids=["reshape", "reshape-1", "F.reshape", "permute", "permute_neg", "transpose", "transpose02", "T"])
def test_shape_ops_gradcheck(fn):
    x = t64(2, 3, 4, seed=9)
    assert gradcheck(fn, x)


INDICES = [
    (1,),
    (slice(1, 3),),
    ((slice(None), 2),),
    ((Ellipsis, slice(None, None, -2)),),
    (np.array([0, 0, 2, 0]),),          # repeated integer indices
    ([3, 3, 1],),                       # as a list
    ((np.array([0, 0, 1]), np.array([2, 2, 2])),),  # the same element picked three times... twice
    ((slice(None), np.array([1, 1])),),
    (np.array([True, False, True, True]),),
    ((None, 1),),
]


@pytest.mark.parametrize("index", [i[0] for i in INDICES], ids=[repr(i[0])[:30] for i in INDICES])
def test_getitem_gradcheck(index):
    x = t64(4, 3, seed=10)
    np.testing.assert_array_equal(x[index].data, x.data[index])
    assert gradcheck(lambda x: x[index], x)


def test_getitem_repeated_indices_accumulate():
    x = Tensor(np.zeros(4), requires_grad=True)
    x[np.array([1, 1, 1, 3])].sum().backward()
    np.testing.assert_array_equal(x.grad, [0.0, 3.0, 0.0, 1.0])
    y = Tensor(np.zeros(3), requires_grad=True)
    y[Tensor(np.array([2, 2]))].sum().backward()  # an index given as an integer Tensor
    np.testing.assert_array_equal(y.grad, [0.0, 0.0, 2.0])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_gradcheck(axis):
    a, b, c = t64(2, 3, seed=11), t64(2, 3, seed=12), t64(2, 3, seed=13)
    np.testing.assert_array_equal(F.concat([a, b, c], axis).data, np.concatenate([a.data, b.data, c.data], axis))
    assert gradcheck(lambda a, b, c: F.concat([a, b, c], axis=axis), a, b, c)


def test_concat_with_constant():
    a = t64(2, 3, seed=14)
    const = Tensor(np.ones((1, 3)))
    out = F.cat([a, const])
    out.sum().backward()
    np.testing.assert_array_equal(a.grad, np.ones((2, 3)))
    assert const.grad is None


@pytest.mark.parametrize("sizes,axis,expected", [
    (2, 0, [2, 2, 1]),
    ([1, 4], 0, [1, 4]),
    (3, 1, [3, 1]),
])
def test_split_gradcheck(sizes, axis, expected):
    x = t64(5, 4, seed=15)
    pieces = F.split(x, sizes, axis)
    assert [p.shape[axis] for p in pieces] == expected
    np.testing.assert_array_equal(F.concat(pieces, axis).data, x.data)
    assert gradcheck(lambda x: F.concat([p * float(i + 1) for i, p in enumerate(F.split(x, sizes, axis))], axis), x)


def test_split_sizes_must_add_up():
    with pytest.raises(ValueError, match=r"split: sizes \[2, 2\] do not add up to 5 along axis 0"):
        F.split(t64(5, 2), [2, 2])


def test_chunk_like_array_split():
    x = t64(7, 2, seed=16)
    pieces = F.chunk(x, 3)
    assert [p.shape[0] for p in pieces] == [3, 2, 2]
    assert gradcheck(lambda x: F.chunk(x, 3)[1] * 2.0 + F.chunk(x, 3)[0][:2], x)


# ----------------------------------------------------------------------------- selection


def test_where_gradcheck_with_broadcasting():
    cond = np.random.default_rng(17).random((2, 3, 4)) > 0.5
    a, b = t64(2, 3, 4, seed=18), t64(3, 1, seed=19)
    np.testing.assert_array_equal(F.where(cond, a, b).data, np.where(cond, a.data, b.data))
    assert gradcheck(lambda a, b: F.where(cond, a, b), a, b)
    assert gradcheck(lambda a: F.where(Tensor(cond), a, 2.0), a)


def test_masked_fill():
    x = t64(2, 3, seed=20)
    mask = np.array([[True, False, False], [False, False, True]])
    out = F.masked_fill(x, mask, -1e9)
    np.testing.assert_array_equal(out.data, np.where(mask, -1e9, x.data))
    out.sum().backward()
    np.testing.assert_array_equal(x.grad, (~mask).astype(float))
    assert gradcheck(lambda x: F.masked_fill(x, mask, 0.0) * x, x)


# ----------------------------------------------------------------------------- fused NN ops


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xshape", [(3, 4), (2, 3, 4)], ids=str)
def test_linear_gradcheck(xshape, bias):
    x, w = t64(*xshape, seed=21), t64(5, 4, seed=22)
    b = t64(5, seed=23) if bias else None
    expected = x.data @ w.data.T + (b.data if bias else 0.0)
    np.testing.assert_allclose(F.linear(x, w, b).data, expected, rtol=1e-12)
    if bias:
        assert gradcheck(F.linear, x, w, b)
    else:
        assert gradcheck(F.linear, x, w)


def test_linear_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"linear: input has 3 features \(shape \(2, 3\)\) but the weight "
                                         r"expects 4 \(weight shape \(5, 4\)\)"):
        F.linear(t64(2, 3), t64(5, 4))


def test_fused_ops_mixing_dtypes_raise():
    with pytest.raises(TypeError, match="linear: tensors of dtypes float32 and float64"):
        F.linear(t32(2, 4), t64(5, 4))
    with pytest.raises(TypeError, match="linear: tensors of dtypes float32 and float64"):
        F.linear(t32(2, 4), t32(5, 4), t64(5))
    with pytest.raises(TypeError, match="layer_norm: tensors of dtypes float64 and float32"):
        F.layer_norm(t64(2, 4), t32(4), t32(4))
    with pytest.raises(TypeError, match="attention: tensors of dtypes float32 and float64"):
        F.scaled_dot_product_attention(t32(1, 1, 2, 2), t32(1, 1, 2, 2), t64(1, 1, 2, 2))


def test_embedding_repeated_ids_gradcheck():
    ids = np.array([[1, 3, 1], [1, 0, 3]])
    w = t64(5, 4, seed=24)
    np.testing.assert_array_equal(F.embedding(ids, w).data, w.data[ids])
    assert gradcheck(lambda w: F.embedding(ids, w), w)
    w.grad = None
    F.embedding(ids, w).sum().backward()
    np.testing.assert_array_equal(w.grad[:, 0], [1.0, 3.0, 0.0, 2.0, 0.0])


@pytest.mark.parametrize("bad,shown", [(5, 5), (-1, -1), (100, 100)])
def test_embedding_id_outside_table(bad, shown):
    with pytest.raises(IndexError, match=rf"embedding: id {shown} is outside the table of 5 rows \(valid ids are 0..4\)"):
        F.embedding(np.array([0, bad, 2]), t64(5, 3))


def test_embedding_needs_integer_ids():
    with pytest.raises(TypeError, match="embedding: ids must be integers, got dtype float64"):
        F.embedding(np.array([0.0, 1.0]), t64(5, 3))


def test_layer_norm_values_and_gradcheck():
    x, w, b = t64(2, 3, 6, seed=25), t64(6, seed=26), t64(6, seed=27)
    xd = x.data.copy()
    out = F.layer_norm(x, w, b, eps=1e-5)
    mu, var = xd.mean(-1, keepdims=True), xd.var(-1, keepdims=True)
    np.testing.assert_allclose(out.data, (xd - mu) / np.sqrt(var + 1e-5) * w.data + b.data, rtol=1e-12)
    np.testing.assert_array_equal(x.data, xd)  # the input is not modified in place
    assert gradcheck(F.layer_norm, x, w, b)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_and_log_softmax_gradcheck(axis):
    x = t64(3, 4, seed=28)
    s = F.softmax(x, axis)
    np.testing.assert_allclose(s.data.sum(axis=axis), 1.0, rtol=1e-12)
    e = np.exp(x.data - x.data.max(axis=axis, keepdims=True))
    np.testing.assert_allclose(s.data, e / e.sum(axis=axis, keepdims=True), rtol=1e-12)
    np.testing.assert_allclose(F.log_softmax(x, axis).data, np.log(s.data), rtol=1e-12)
    assert gradcheck(lambda x: F.softmax(x, axis), x)
    assert gradcheck(lambda x: F.log_softmax(x, axis), x)


def test_softmax_is_stable_for_large_inputs():
    x = Tensor(np.array([1000.0, 1000.0, -1000.0], np.float32))
    np.testing.assert_allclose(F.softmax(x).data, [0.5, 0.5, 0.0])
    np.testing.assert_allclose(F.log_softmax(x).data, [-math.log(2), -math.log(2), -2000 - math.log(2)], rtol=1e-6)


def _attention_reference(q, k, v, causal, mask=None):
    d = q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(d)
    if causal:
        tq, tk = s.shape[-2:]
        s = np.where(np.tril(np.ones((tq, tk), bool), k=tk - tq), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    if mask is not None:
        a = a * mask
    return a @ v


@pytest.mark.parametrize("tq,tk", [(4, 4), (2, 5)])
@pytest.mark.parametrize("dropout_p", [0.0, 0.4])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_gradcheck(causal, dropout_p, tq, tk):
    q, k, v = t64(2, 2, tq, 3, seed=29), t64(2, 2, tk, 3, seed=30), t64(2, 2, tk, 3, seed=31)

    def fn(q, k, v):  # a fresh generator per call: finite differences see the same dropout mask
        return F.scaled_dot_product_attention(q, k, v, causal=causal, dropout_p=dropout_p,
                                              rng=np.random.default_rng(5))

    mask = None
    if dropout_p:
        mask = (np.random.default_rng(5).random((2, 2, tq, tk)) >= dropout_p) / (1 - dropout_p)
        assert 0 < (mask == 0).mean() < 1
    np.testing.assert_allclose(fn(q, k, v).data, _attention_reference(q.data, k.data, v.data, causal, mask),
                               rtol=1e-12, atol=1e-14)
    assert gradcheck(fn, q, k, v)


def test_attention_is_causal():
    q, k, v = t64(1, 1, 4, 2, seed=32), t64(1, 1, 4, 2, seed=33), t64(1, 1, 4, 2, seed=34)
    out = F.scaled_dot_product_attention(q, k, v)
    v2 = Tensor(v.data.copy())
    v2.data[..., 3, :] += 100.0  # changing the last position changes only the last output
    out2 = F.scaled_dot_product_attention(q, k, v2)
    np.testing.assert_array_equal(out.data[..., :3, :], out2.data[..., :3, :])
    assert not np.allclose(out.data[..., 3, :], out2.data[..., 3, :])
    np.testing.assert_array_equal(out.data[..., 0, :], v.data[..., 0, :])


def test_attention_errors():
    with pytest.raises(ValueError, match=r"attention: incompatible shapes q \(1, 2, 4, 3\), k \(1, 2, 4, 5\)"):
        F.scaled_dot_product_attention(t64(1, 2, 4, 3), t64(1, 2, 4, 5), t64(1, 2, 4, 5))
    with pytest.raises(ValueError, match="dropout needs an explicit np.random.Generator"):
        F.scaled_dot_product_attention(t64(1, 1, 2, 2), t64(1, 1, 2, 2), t64(1, 1, 2, 2), dropout_p=0.5)


def test_dropout_gradcheck_and_scaling():
    x = t64(200, 50, seed=35)
    out = F.dropout(x, 0.25, rng=np.random.default_rng(1))
    kept = out.data != 0
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(out.data[kept], x.data[kept] / 0.75, rtol=1e-14)
    small = t64(3, 4, seed=36)
    assert gradcheck(lambda x: F.dropout(x, 0.5, rng=np.random.default_rng(2)), small)


def test_dropout_identity_in_eval_and_errors():
    x = t64(3, seed=37)
    assert F.dropout(x, 0.5, training=False) is x
    assert F.dropout(x, 0.0, rng=None) is x
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\), got 1.0"):
        F.dropout(x, 1.0, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="dropout needs an explicit np.random.Generator"):
        F.dropout(x, 0.5)


def _ce_reference(logits, targets, ignore_index=-100):
    flat, ids = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    logp = flat - flat.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    counted = ids != ignore_index
    return -logp[np.arange(len(ids))[counted], ids[counted]].mean()


@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5)], ids=str)
@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy_gradcheck(shape, ignore):
    logits = t64(*shape, seed=38)
    targets = np.random.default_rng(39).integers(0, 5, size=shape[:-1])
    ignore_index = -100
    if ignore:
        targets.reshape(-1)[[0, 3]] = -1
        ignore_index = -1
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index)
    assert loss.shape == ()
    np.testing.assert_allclose(loss.item(), _ce_reference(logits.data, targets, ignore_index), rtol=1e-12)
    assert gradcheck(lambda x: F.cross_entropy(x, targets, ignore_index=ignore_index), logits)
    if ignore:  # ignored positions get no gradient
        logits.grad = None
        F.cross_entropy(logits, targets, ignore_index=-1).backward()
        flat = logits.grad.reshape(-1, 5)
        np.testing.assert_array_equal(flat[[0, 3]], 0.0)
        assert np.abs(flat[1]).sum() > 0


def test_cross_entropy_all_ignored_is_zero():
    logits = t64(3, 4, seed=40)
    loss = F.cross_entropy(logits, np.full(3, -100))
    assert loss.item() == 0.0
    loss.backward()
    np.testing.assert_array_equal(logits.grad, 0.0)


def test_cross_entropy_is_stable_for_large_logits():
    logits = Tensor(np.array([[0.0, 200.0], [300.0, 0.0]], np.float32), requires_grad=True)
    loss = F.cross_entropy(logits, np.array([0, 0]))
    assert loss.dtype == np.float32
    np.testing.assert_allclose(loss.item(), 100.0, rtol=1e-6)
    loss.backward()
    np.testing.assert_allclose(logits.grad, [[-0.5, 0.5], [0.0, 0.0]], atol=1e-7)


@pytest.mark.parametrize("bad", [5, -2])
def test_cross_entropy_target_outside_vocabulary(bad):
    with pytest.raises(IndexError, match=rf"cross_entropy: target {bad} is outside the vocabulary of size 5"):
        F.cross_entropy(t64(3, 5), np.array([0, bad, 1]))


def test_cross_entropy_target_shape():
    with pytest.raises(ValueError, match=r"logits of shape \(3, 5\) need targets of shape \(3,\), got \(4,\)"):
        F.cross_entropy(t64(3, 5), np.array([0, 1, 2, 3]))


# ----------------------------------------------------------------------------- float32 through the fused ops


def test_fused_ops_keep_float32():
    x, w, b = t32(2, 3, 4, seed=41), t32(4, 4, seed=42), t32(4, seed=43)
    h = F.gelu(F.layer_norm(F.linear(x, w, b), b, b))
    q = h.reshape(2, 3, 2, 2).permute(0, 2, 1, 3)
    a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, rng=np.random.default_rng(0))
    logits = F.dropout(a.permute(0, 2, 1, 3).reshape(2, 3, 4), 0.1, rng=np.random.default_rng(0))
    logits = F.log_softmax(F.softmax(logits))
    emb = F.embedding(np.array([[0, 1, 2]]), w)
    loss = F.cross_entropy(logits + emb, np.array([[0, 1, 2], [3, 2, 1]]))
    for t in (h, a, logits, emb, loss):
        assert t.dtype == np.float32
    loss.backward()
    for p in (x, w, b):
        assert p.grad.dtype == np.float32 and np.isfinite(p.grad).all()


def test_gradient_of_power_zero_is_zero_even_at_zero():
    x = Tensor(np.array([-1.5, 0.0, 2.0]), requires_grad=True)
    (x ** 0).sum().backward()
    np.testing.assert_array_equal(x.grad, np.zeros(3))
