"""The autograd engine: dtypes, accumulation, hooks, deep graphs, no_grad, custom Functions."""
import sys

import numpy as np
import pytest

import minidist.core.functional as F
from minidist.core.gradcheck import gradcheck
from minidist.core.tensor import (
    Function,
    Tensor,
    default_dtype,
    get_default_dtype,
    graph_bytes,
    is_grad_enabled,
    no_grad,
    profile,
    set_default_dtype,
)


def t64(*shape, seed=0, grad=True, low=None):
    data = np.random.default_rng(seed).standard_normal(shape)
    if low is not None:
        data = np.abs(data) + low
    return Tensor(data, requires_grad=grad)


# ----------------------------------------------------------------------------- dtypes


def test_default_dtype_is_float32_and_context_restores():
    assert get_default_dtype() == np.float32
    assert Tensor(1.5).dtype == np.float32
    assert Tensor([1.0, 2.0]).dtype == np.float32
    with default_dtype(np.float64):
        assert get_default_dtype() == np.float64
        assert Tensor([1.0, 2.0]).dtype == np.float64
    assert get_default_dtype() == np.float32
    with pytest.raises(ZeroDivisionError):
        with default_dtype(np.float64):
            1 / 0
    assert get_default_dtype() == np.float32


def test_set_default_dtype_rejects_non_float():
    with pytest.raises(TypeError, match="default dtype must be a float dtype, got int64"):
        set_default_dtype(np.int64)
    assert get_default_dtype() == np.float32


def test_numpy_data_keeps_its_dtype():
    assert Tensor(np.zeros(3, np.float64)).dtype == np.float64
    assert Tensor(np.zeros(3, np.float32)).dtype == np.float32
    assert Tensor(np.arange(3)).dtype.kind == "i"
    assert Tensor([1, 2, 3]).dtype.kind == "i"
    assert Tensor(np.zeros(3), dtype=np.float32).dtype == np.float32


def test_only_float_tensors_require_grad():
    with pytest.raises(TypeError, match="only float tensors can require grad, got int64"):
        Tensor(np.arange(3), requires_grad=True)


SCALARS = [2.5, np.float64(2.5), np.float32(2.5), 3, np.int64(3)]
BINARY = [
    ("add", lambda a, b: a + b),
    ("sub", lambda a, b: a - b),
    ("mul", lambda a, b: a * b),
    ("div", lambda a, b: a / b),
]


@pytest.mark.parametrize("scalar", SCALARS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("name,op", BINARY, ids=[b[0] for b in BINARY])
def test_float32_stays_float32_with_scalar_operands(name, op, scalar):
    x = Tensor(np.array([1.0, 2.0, 4.0], np.float32), requires_grad=True)
    for y in (op(x, scalar), op(scalar, x)):
        assert isinstance(y, Tensor)
        assert y.dtype == np.float32
        y.sum().backward()
        assert x.grad.dtype == np.float32
    # and the values are those of float32 arithmetic with the scalar
    np.testing.assert_array_equal(op(x, scalar).data, op(x.data, np.float32(scalar)))


def test_float32_stays_float32_through_unary_ops_and_reductions():
    x = Tensor(np.array([[0.5, 1.0], [2.0, 3.0]], np.float32), requires_grad=True)
    outs = [x.exp(), x.log(), x.sqrt(), x.tanh(), F.relu(x), x ** 2, x ** 0.5, -x, x.sum(0), x.mean(),
            x.max(1), x.T, x.reshape(4), x[[0, 0]], x @ x, F.where(x.data > 1, x, 0.0),
            F.masked_fill(x, x.data > 1, -np.inf)]
    for out in outs:
        assert out.dtype == np.float32
    sum(out.sum() for out in outs[:-1]).backward()
    assert x.grad.dtype == np.float32


def test_numpy_array_times_tensor_defers_to_tensor():
    x = Tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    y = np.array([3.0, 4.0], np.float32) * x
    assert isinstance(y, Tensor) and y.dtype == np.float32
    np.testing.assert_array_equal(y.data, [3.0, 8.0])
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [3.0, 4.0])


MIXED = [
    ("add", lambda a, b: a + b),
    ("sub", lambda a, b: a - b),
    ("mul", lambda a, b: a * b),
    ("div", lambda a, b: a / b),
    ("matmul", lambda a, b: a @ b),
    ("concat", lambda a, b: F.concat([a, b])),
    ("where", lambda a, b: F.where(np.ones((2, 2), bool), a, b)),
]


@pytest.mark.parametrize("name,op", MIXED, ids=[m[0] for m in MIXED])
def test_mixing_float32_and_float64_raises(name, op):
    a = Tensor(np.ones((2, 2), np.float32))
    b = Tensor(np.ones((2, 2), np.float64))
    with pytest.raises(TypeError, match=f"{name}: tensors of dtypes float32 and float64"):
        op(a, b)
    with pytest.raises(TypeError, match=f"{name}: tensors of dtypes float64 and float32"):
        op(b, a)
    # a float64 NumPy array (not a scalar) is a tensor operand too: no silent upcast
    with pytest.raises(TypeError, match="float32 and float64"):
        op(a, np.ones((2, 2)))


def test_cast_changes_dtype_explicitly_and_casts_the_gradient_back():
    x = Tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    y = x.astype(np.float64)
    assert y.dtype == np.float64
    (y * Tensor(np.array([3.0, 5.0]))).sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad, [3.0, 5.0])


# ----------------------------------------------------------------------------- backward


def test_gradients_accumulate_across_backward_calls():
    x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad, [2.0, 4.0, 6.0])
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad, [5.0, 7.0, 9.0])


def test_leaf_grad_is_a_private_copy():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    g = np.array([1.0, 1.0])
    x.backward(g)
    x.grad += 5.0
    np.testing.assert_array_equal(g, [1.0, 1.0])
    y = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (y.sum() * 1.0).backward()  # Sum's backward returns a read-only broadcast view
    y.grad *= 2.0
    np.testing.assert_array_equal(y.grad, [2.0, 2.0])


def test_grad_buffer_receives_the_gradient_and_accumulates_in_place():
    x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    storage = np.full(5, -7.0)
    x.grad_buffer = storage[1:4]  # a slot in a bigger array, as a DDP bucket
    (x * x).sum().backward()
    assert x.grad is x.grad_buffer
    np.testing.assert_array_equal(storage, [-7.0, 2.0, 4.0, 6.0, -7.0])  # written, not added to
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(storage, [-7.0, 5.0, 7.0, 9.0, -7.0])  # accumulated in place
    x.grad = None  # zero_grad: the next backward writes afresh
    (x * 1.0).sum().backward()
    np.testing.assert_array_equal(storage, [-7.0, 1.0, 1.0, 1.0, -7.0])


def test_backward_on_a_leaf_and_with_explicit_gradient():
    x = Tensor(np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), requires_grad=True)
    y = x * 2.0
    y.backward(np.full((2, 3), 0.5))
    np.testing.assert_array_equal(x.grad, np.ones((2, 3)))


def test_backward_of_non_scalar_without_gradient_names_the_shape():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"non-scalar tensor of shape \(2, 3\) needs a gradient"):
        (x * 2.0).backward()


def test_backward_with_wrong_gradient_shape():
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(ValueError, match=r"gradient of shape \(3, 2\) for a tensor of shape \(2, 3\)"):
        (x * 2.0).backward(np.ones((3, 2)))


def test_backward_without_requires_grad_raises():
    with pytest.raises(RuntimeError, match="does not require grad"):
        Tensor(np.ones(1)).backward()


def test_residual_connection_gets_every_contribution():
    # b is reached directly and through a longer path a -> b (like x + attn(ln(x)))
    x = Tensor(np.array([1.0, -2.0]), requires_grad=True)
    b = x * 2.0
    a = (b * 3.0).tanh()
    (b + a).sum().backward()
    expected = 2.0 + 2.0 * 3.0 * (1.0 - np.tanh(6.0 * x.data) ** 2)
    np.testing.assert_allclose(x.grad, expected, rtol=1e-12)
    y = t64(3, seed=1)
    gradcheck(lambda y: (y * 2.0) + ((y * 2.0) * 3.0).tanh() + (((y * 2.0).exp() * y) + y * 2.0), y)


def test_diamond_graph_matches_finite_differences():
    x = t64(4, seed=2)

    def fn(x):
        h = x.tanh()
        u, v = h * h, h.exp()
        return (u + v) * h + u / (v + 1.0)

    gradcheck(fn, x)


def test_same_tensor_twice_in_one_op():
    x = Tensor(np.array([3.0]), requires_grad=True)
    (x * x * x).backward()
    np.testing.assert_array_equal(x.grad, [27.0])


def test_very_deep_graph_does_not_recurse():
    n = 20000
    assert n > sys.getrecursionlimit()
    x = Tensor(np.array([1.0]), requires_grad=True)
    y = x
    for _ in range(n):
        y = y * 1.0001
    assert graph_bytes(y) > 0
    y.backward()
    np.testing.assert_allclose(x.grad, [1.0001 ** n], rtol=1e-9)
    np.testing.assert_allclose(y.data, [1.0001 ** n], rtol=1e-9)


# ----------------------------------------------------------------------------- hooks


def test_hook_fires_once_with_the_complete_gradient():
    w = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.copy()))
    x = Tensor(np.array([3.0, 4.0]))
    loss = (w * x).sum() + (w * w).sum() + (w.exp() * 2.0).sum()  # three uses of w
    loss.backward()
    expected = x.data + 2 * w.data + 2 * np.exp(w.data)
    assert len(seen) == 1
    np.testing.assert_allclose(seen[0], expected, rtol=1e-12)
    loss2 = (w * x).sum()
    loss2.backward()
    assert len(seen) == 2
    np.testing.assert_allclose(seen[1], expected + x.data, rtol=1e-12)  # fires after accumulating


def test_hooks_fire_in_reverse_order_of_use_during_backward():
    w1 = Tensor(np.array([0.5]), requires_grad=True)
    w2 = Tensor(np.array([0.7]), requires_grad=True)
    order = []
    w1.register_post_accumulate_grad_hook(lambda p: order.append(("w1", p.grad.copy())))
    w2.register_post_accumulate_grad_hook(lambda p: order.append(("w2", p.grad.copy())))
    x = Tensor(np.array([2.0]))
    loss = ((x * w1).tanh() * w2).tanh()
    loss.backward()
    assert [name for name, _ in order] == ["w2", "w1"]
    np.testing.assert_array_equal(order[0][1], w2.grad)
    np.testing.assert_array_equal(order[1][1], w1.grad)


def test_leaf_that_gets_no_gradient_from_one_consumer_still_gets_the_rest():
    class Stop(Function):
        @staticmethod
        def forward(ctx, x):
            return x.copy()

        @staticmethod
        def backward(ctx, g):
            return (None,)

    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    calls = []
    x.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    (Stop.apply(x * 2.0) + x * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad, [3.0, 3.0])
    assert calls == [1]


def test_hook_only_on_leaves():
    x = Tensor(np.ones(2), requires_grad=True)
    with pytest.raises(RuntimeError, match="only be registered on leaf tensors"):
        (x * 2.0).register_post_accumulate_grad_hook(lambda p: None)


# ----------------------------------------------------------------------------- no_grad


def test_no_grad_records_nothing():
    x = Tensor(np.ones(3), requires_grad=True)
    assert is_grad_enabled()
    with no_grad():
        assert not is_grad_enabled()
        y = (x * 2.0).exp().sum()
    assert is_grad_enabled()
    assert not y.requires_grad and y.is_leaf and y._inputs == ()
    assert graph_bytes(y) == 0
    np.testing.assert_allclose(y.item(), 3 * np.exp(2.0))
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.backward()
    with pytest.raises(KeyError):
        with no_grad():
            raise KeyError("x")
    assert is_grad_enabled()


def test_constants_are_not_tracked():
    a, b = Tensor(np.ones(2)), Tensor(np.ones(2))
    c = a * b
    assert not c.requires_grad and c.is_leaf


def test_detach_shares_data_without_history():
    x = Tensor(np.ones(2), requires_grad=True)
    y = (x * 2.0).detach()
    assert not y.requires_grad and y.is_leaf
    np.testing.assert_array_equal(y.data, [2.0, 2.0])


# ----------------------------------------------------------------------------- custom Functions


class Cube(Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved
        return (3.0 * x * x * g,)


class ScaleShift(Function):
    """y = x * factor + shift, with a non-tensor `factor` passed through to forward."""

    received = None

    @staticmethod
    def forward(ctx, x, factor, shift):
        ScaleShift.received = (type(factor), type(shift))
        ctx.factor = factor
        return x * factor + shift

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None, g


def test_custom_function_gradcheck():
    x = t64(3, 4, seed=3)
    y = Cube.apply(x)
    np.testing.assert_allclose(y.data, x.data ** 3)
    assert gradcheck(lambda x: Cube.apply(x), x)


def test_custom_function_with_non_tensor_argument():
    x = t64(5, seed=4)
    shift = t64(5, seed=5)
    y = ScaleShift.apply(x, 3, shift)
    assert ScaleShift.received == (int, np.ndarray)
    assert y._ctx.needs_input_grad == (True, False, True)
    assert gradcheck(lambda x, s: ScaleShift.apply(x, 3, s), x, shift)
    x.grad = shift.grad = None
    ScaleShift.apply(x, 3, shift).sum().backward()
    np.testing.assert_array_equal(x.grad, np.full(5, 3.0))
    np.testing.assert_array_equal(shift.grad, np.ones(5))


def test_custom_function_input_without_grad():
    x = t64(4, seed=6)
    const = Tensor(np.arange(4.0))
    y = ScaleShift.apply(x, 2.0, const)
    assert y._ctx.needs_input_grad == (True, False, False)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, np.full(4, 2.0))
    assert const.grad is None


# ----------------------------------------------------------------------------- graph memory, profile


def test_graph_bytes_counts_activations_and_drops_to_zero_after_backward():
    x = Tensor(np.ones(1000), requires_grad=True)  # a leaf: not counted
    y = x.exp()  # 8000 bytes, saved for backward as well (the same buffer)
    z = y.sum()  # 8 bytes
    assert graph_bytes(x) == 0
    assert graph_bytes(y) == 8000
    assert graph_bytes(z) == 8008
    z.backward()
    assert graph_bytes(z) == 0
    assert graph_bytes(y) == 0


def test_profile_counts_calls_by_function():
    x = Tensor(np.ones(3), requires_grad=True)
    with profile() as times:
        loss = (x * 2.0 * 3.0).exp().sum()
        loss.backward()
    assert times["Mul"][2] == 2 and times["Exp"][2] == 1 and times["Sum"][2] == 1
    assert all(entry[0] >= 0.0 and entry[1] >= 0.0 for entry in times.values())
    assert set(times) == {"Mul", "Exp", "Sum"}


def test_tensor_operators_match_numpy():
    a = t64(2, 3, seed=7)
    b = t64(2, 3, seed=8, low=0.5)
    np.testing.assert_allclose((2.0 - a).data, 2.0 - a.data)
    np.testing.assert_allclose((2.0 / b).data, 2.0 / b.data)
    np.testing.assert_allclose((a.T).data, a.data.T)
    np.testing.assert_allclose(a.reshape(3, 2).data, a.data.reshape(3, 2))
    np.testing.assert_allclose(a.reshape(-1).data, a.data.reshape(-1))
    np.testing.assert_allclose(a.permute(1, 0).data, a.data.T)
    np.testing.assert_allclose((a @ b.T).data, a.data @ b.data.T)
    np.testing.assert_allclose((a.data @ b.T).data, a.data @ b.data.T)
    assert len(a) == 2 and a.ndim == 2 and a.size == 6 and a.shape == (2, 3)


def test_backward_twice_through_a_freed_graph_raises():
    w = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    loss = (w * 3.0).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="already freed; run the forward again"):
        loss.backward()
    np.testing.assert_array_equal(w.grad, [3.0, 3.0])
    (w * 3.0).sum().backward()  # a fresh forward accumulates as usual
    np.testing.assert_array_equal(w.grad, [6.0, 6.0])
