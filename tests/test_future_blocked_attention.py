"""FlashAttention's tiling (chapter 11): blocks and the online softmax equal minidist's attention in float64."""
import numpy as np
import pytest

from minidist.core import functional as F
from minidist.core.tensor import Tensor, default_dtype, graph_bytes
from minidist.future.blocked_attention import blocked_attention, kept_for_backward

CASES = [  # (B, H, T_q, T_k, D), block_q, block_k, causal
    ((2, 3, 64, 64, 8), 16, 16, True),
    ((2, 3, 50, 50, 8), 16, 7, True),     # blocks that do not divide T
    ((1, 2, 20, 37, 4), 8, 5, True),      # fewer queries than keys: aligned with the last keys
    ((2, 3, 33, 45, 8), 10, 16, False),
    ((1, 1, 64, 64, 8), 64, 64, True),    # one tile: the plain kernel
    ((1, 1, 24, 24, 8), 1, 1, True),      # one score per tile
]


def plain(q, k, v, causal):
    with default_dtype("float64"):
        return F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), causal=causal).data


@pytest.mark.parametrize("shape, block_q, block_k, causal", CASES)
def test_equals_minidist_attention_and_its_log_sum_exp(shape, block_q, block_k, causal):
    b, h, t_q, t_k, d = shape
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(b, h, t_q, d)), rng.normal(size=(b, h, t_k, d)), rng.normal(size=(b, h, t_k, d))
    result = blocked_attention(q, k, v, block_q, block_k, causal)
    assert np.max(np.abs(result["out"] - plain(q, k, v, causal))) < 1e-12
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(d)
    if causal:
        scores = scores + np.triu(np.full((t_q, t_k), -np.inf), k=t_k - t_q + 1)
    top = scores.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(scores - top).sum(-1, keepdims=True)))[..., 0]
    assert np.max(np.abs(result["lse"] - lse)) < 1e-12
    assert result["largest_tile"] <= b * h * block_q * block_k


def test_causal_tiles_skip_the_hidden_half():
    x = np.random.default_rng(1).normal(size=(1, 1, 64, 8))
    result = blocked_attention(x, x, x, 16, 16)
    assert (result["tiles"], result["skipped"]) == (10, 6)  # 1 + 2 + 3 + 4 of the 16 tiles
    assert blocked_attention(x, x, x, 16, 16, causal=False)["tiles"] == 16


def test_what_backward_keeps():
    b, h, t, d = 1, 4, 64, 8
    q = np.random.default_rng(2).normal(size=(3, b, h, t, d))
    with default_dtype("float64"):
        y = F.scaled_dot_product_attention(*(Tensor(a, requires_grad=True) for a in q), causal=True)
        assert graph_bytes(y) == kept_for_backward(b, h, t, d, 8, blocked=False) == 147_456  # output and T x T weights
    result = blocked_attention(*q)
    assert result["out"].nbytes + result["lse"].nbytes == kept_for_backward(b, h, t, d, 8, blocked=True) == 18_432


def test_refuses_more_queries_than_keys_when_causal():
    x = np.zeros((1, 1, 8, 4))
    with pytest.raises(ValueError, match="8 queries but only 4 keys"):
        blocked_attention(x, x[..., :4, :], x[..., :4, :])
