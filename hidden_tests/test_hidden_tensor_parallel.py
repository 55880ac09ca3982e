"""Hidden checks of Megatron's f and g (chapter 6), under real mpiexec with 3 ranks, in float64: g
alone, f alone, f applied twice to one input (its two outputs then share one gradient array), and
a column-then-row MLP against the serial one. Neither may change an array it was handed: g's
input, or the gradient f's backward receives."""
import numpy as np
import pytest

from minidist.comm.launch import run

RANKS = 3


def upstream(rank, shape=(2, 6)):
    """The gradient rank `rank` passes to backward (different on every rank)."""
    return np.random.default_rng(50 + rank).standard_normal(shape)


def full_weights():
    """The serial MLP's weights: 6 -> 12 -> 6."""
    rng = np.random.default_rng(1)
    return rng.standard_normal((12, 6)), rng.standard_normal(12), rng.standard_normal((6, 12)), rng.standard_normal(6)


def f_and_g():
    """On each rank: what g, f, f twice and the tensor-parallel MLP gave, forward and backward."""
    from minidist.comm import get_world
    from minidist.core import functional as F
    from minidist.core.tensor import Tensor
    from minidist.parallel.tensor_layers import (ColumnParallelLinear, RowParallelLinear,
                                                 copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region)

    world = get_world()
    r = world.rank
    out = {}
    # g: the ranks' partial results add up; backward hands the gradient back as it is
    partial = Tensor(np.arange(12.0).reshape(2, 6) * (r + 1), requires_grad=True)
    y = reduce_from_tensor_parallel_region(partial, world)
    grad = upstream(r)
    y.backward(grad)
    out["g"] = {"y": y.data.copy(), "input": partial.data.copy(), "grad": partial.grad.copy(), "upstream": grad}
    # f: identity forward; backward sums the ranks' gradients
    x = Tensor(np.linspace(-1.0, 1.0, 12).reshape(2, 6), requires_grad=True)
    y = copy_to_tensor_parallel_region(x, world)
    grad = upstream(r)
    y.backward(grad)
    out["f"] = {"y": y.data.copy(), "grad": x.grad.copy(), "upstream": grad}
    # f twice on one input, the outputs added: both backwards receive the same gradient array
    x = Tensor(np.linspace(-1.0, 1.0, 12).reshape(2, 6), requires_grad=True)
    s = copy_to_tensor_parallel_region(x, world) + copy_to_tensor_parallel_region(x, world)
    grad = upstream(r)
    s.backward(grad)
    out["f twice"] = {"grad": x.grad.copy(), "upstream": grad}
    # the Megatron MLP: column (this rank's 4 of the 12 hidden features), GELU, row, then g
    w1, b1, w2, b2 = full_weights()
    mine = slice(4 * r, 4 * r + 4)
    column = ColumnParallelLinear(6, 12, world, dtype=np.float64)
    row = RowParallelLinear(12, 6, world, dtype=np.float64)
    column.weight.data[...], column.bias.data[...] = w1[mine], b1[mine]
    row.weight.data[...], row.bias.data[...] = w2[:, mine], b2
    x = Tensor(np.random.default_rng(7).standard_normal((5, 6)), requires_grad=True)
    y = row(F.gelu(column(x)))
    (y * y).sum().backward()
    out["mlp"] = {"y": y.data.copy(), "x grad": x.grad.copy(), "w1 grad": column.weight.grad.copy(),
                  "w2 grad": row.weight.grad.copy(), "b2 grad": row.bias.grad.copy()}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run(f_and_g, RANKS, timeout=60, env={"MINIDIST_TIMEOUT": "15"})


def test_g_sums_the_partial_results_and_leaves_them_alone(ranks):
    """g's forward: every rank gets the sum of the ranks' arrays, and its own input is unchanged;
    g's backward: the gradient passes through as it is."""
    parts = [np.arange(12.0).reshape(2, 6) * (r + 1) for r in range(RANKS)]
    for r, got in enumerate(ranks):
        np.testing.assert_allclose(got["g"]["y"], sum(parts), rtol=1e-14, err_msg=f"rank {r}")
        np.testing.assert_array_equal(got["g"]["input"], parts[r], err_msg=f"rank {r}: g changed its input")
        np.testing.assert_array_equal(got["g"]["grad"], upstream(r), err_msg=f"rank {r}")


def test_f_sums_the_gradients_and_leaves_the_upstream_gradient_alone(ranks):
    """f's forward: the input as it is; f's backward: the sum of the ranks' gradients, without
    changing the array backward was given."""
    total = sum(upstream(r) for r in range(RANKS))
    for r, got in enumerate(ranks):
        np.testing.assert_array_equal(got["f"]["y"], np.linspace(-1.0, 1.0, 12).reshape(2, 6), err_msg=f"rank {r}")
        np.testing.assert_allclose(got["f"]["grad"], total, rtol=1e-13, err_msg=f"rank {r}")
        np.testing.assert_array_equal(got["f"]["upstream"], upstream(r), err_msg=f"rank {r}: f changed its gradient")


def test_f_twice_on_one_input_whose_gradients_share_an_array(ranks):
    """x -> f(x) + f(x): both f's backwards receive one gradient array; each must sum it over the
    ranks without changing it, so x's gradient is twice the sum."""
    total = sum(upstream(r) for r in range(RANKS))
    for r, got in enumerate(ranks):
        np.testing.assert_allclose(got["f twice"]["grad"], 2 * total, rtol=1e-13, err_msg=f"rank {r}")
        np.testing.assert_array_equal(got["f twice"]["upstream"], upstream(r), err_msg=f"rank {r}")


def test_column_then_row_mlp_equals_serial(ranks):
    """The MLP 6 -> 12 -> 6 cut over 3 ranks: the output, the input's gradient, each rank's slices of
    the weights' gradients and the replicated bias's gradient equal the serial MLP's."""
    from minidist.core import functional as F
    from minidist.core.nn import Linear
    from minidist.core.tensor import Tensor

    w1, b1, w2, b2 = full_weights()
    first, second = Linear(6, 12, dtype=np.float64), Linear(12, 6, dtype=np.float64)
    first.weight.data[...], first.bias.data[...], second.weight.data[...], second.bias.data[...] = w1, b1, w2, b2
    x = Tensor(np.random.default_rng(7).standard_normal((5, 6)), requires_grad=True)
    y = second(F.gelu(first(x)))
    (y * y).sum().backward()
    for r, got in enumerate(ranks):
        mine = slice(4 * r, 4 * r + 4)
        mlp = got["mlp"]
        np.testing.assert_allclose(mlp["y"], y.data, rtol=1e-12, err_msg=f"rank {r}: output")
        np.testing.assert_allclose(mlp["x grad"], x.grad, rtol=1e-12, err_msg=f"rank {r}: input's gradient")
        np.testing.assert_allclose(mlp["w1 grad"], first.weight.grad[mine], rtol=1e-12, err_msg=f"rank {r}")
        np.testing.assert_allclose(mlp["w2 grad"], second.weight.grad[:, mine], rtol=1e-12, err_msg=f"rank {r}")
        np.testing.assert_allclose(mlp["b2 grad"], second.bias.grad, rtol=1e-12, err_msg=f"rank {r}")
