"""Hidden checks of the bucketed DDP hook (chapter 3), under real mpiexec with 3 ranks: one bucket
for the whole model, one bucket per parameter, and buckets of a few parameters in float32. Each
rank takes two backward passes on its own batch; in the second a parameter gets no gradient on
any rank. After each, every gradient must be the average of the ranks' own gradients (an unused
one averages to zero), and the buckets whose gradients are all in must have started their
all-reduce during backward."""
import numpy as np
import pytest

from minidist.comm.launch import run

RANKS = 3
CAPS = {"one bucket": (1 << 30, "float64"), "a bucket per parameter": (1, "float64"),
        "a few parameters per bucket": (256, "float32")}


def make_model(dtype):
    """Two linears and a scale applied only when asked (so that it may get no gradient)."""
    from minidist.core import functional as F
    from minidist.core.nn import Linear, Module, Parameter

    class Model(Module):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.scale = Parameter(rng.standard_normal(3), dtype)
            self.first, self.second = Linear(6, 10, dtype=dtype), Linear(10, 3, dtype=dtype)
            for p in (self.first.weight, self.first.bias, self.second.weight, self.second.bias):
                p.data[...] = rng.standard_normal(p.shape) * 0.5

        def forward(self, x, use_scale=True):
            y = self.second(F.tanh(self.first(x)))
            return ((y * self.scale if use_scale else y) ** 2).mean()

    return Model()


def two_backward_passes():
    """For each bucket size: per pass, the buckets launched when backward returns, the buckets
    holding the scale, and every parameter's averaged and own gradient."""
    from minidist.comm import get_world
    from minidist.core.tensor import Tensor
    from minidist.parallel.data_parallel import DistributedDataParallel

    world = get_world()
    results = {}
    for name, (cap, dtype) in CAPS.items():
        model, twin = make_model(dtype), make_model(dtype)
        ddp = DistributedDataParallel(model, world, bucket_cap_bytes=cap)
        rng = np.random.default_rng(10 + world.rank)
        passes = []
        for use_scale in (True, False):
            x = Tensor(rng.standard_normal((4, 6)).astype(dtype))
            ddp.zero_grad()
            twin.zero_grad()
            ddp(x, use_scale).backward()
            launched = sum(b.work is not None for b in ddp.buckets)
            ddp.finish_gradient_synchronization()
            twin(x, use_scale).backward()
            passes.append({
                "launched": launched, "buckets": len(ddp.buckets),
                "with_scale": sum(any(p is model.scale for p in b.params) for b in ddp.buckets),
                "averaged": [p.grad.copy() for p in model.parameters()],
                "own": [np.zeros_like(p.data) if p.grad is None else p.grad.copy() for p in twin.parameters()]})
        results[name] = passes
    return results


@pytest.fixture(scope="module")
def ranks():
    return run(two_backward_passes, RANKS, timeout=90, env={"MINIDIST_TIMEOUT": "20"})


def check(ranks, name):
    dtype = CAPS[name][1]
    rtol = 1e-12 if dtype == "float64" else 1e-5
    for step in range(2):
        for r, passes in enumerate(ranks):
            got = passes[name][step]
            all_in = got["buckets"] - (got["with_scale"] if step == 1 else 0)  # the scale's bucket waits
            assert got["launched"] == all_in, f"rank {r}, pass {step}: {got['launched']} of {all_in} launched"
            for i, averaged in enumerate(got["averaged"]):
                want = np.mean([ranks[k][name][step]["own"][i] for k in range(RANKS)], axis=0)
                np.testing.assert_allclose(averaged, want, rtol=rtol, atol=1e-7 if dtype == "float32" else 1e-15,
                                           err_msg=f"rank {r}, pass {step}, parameter {i}")


def test_one_bucket_for_the_whole_model(ranks):
    """A single bucket: launched once its last gradient is in (not before), averaged over 3 ranks."""
    check(ranks, "one bucket")


def test_a_bucket_per_parameter(ranks):
    """Each parameter its own bucket: each launched as its gradient arrives, the unused one zero."""
    check(ranks, "a bucket per parameter")


def test_a_few_parameters_per_bucket_in_float32(ranks):
    """Buckets of 256 bytes of float32 gradients, the unused parameter sharing a bucket with another."""
    check(ranks, "a few parameters per bucket")
