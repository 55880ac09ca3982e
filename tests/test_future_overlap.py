"""Communication hidden behind computation (chapter 11): the two-stream replay against its formula."""
import pytest

from minidist.future.overlap import hiding_tokens, two_streams


@pytest.mark.parametrize("c, m", [(1.0, 0.25), (1.0, 1.0), (1.0, 1.5), (2.0, 7.0)])
@pytest.mark.parametrize("layers", [1, 2, 6])
def test_prefetch_exposes_max_0_comm_minus_compute_per_layer(c, m, layers):
    run = two_streams([c] * layers, [m] * layers, prefetch=1)
    assert run["total"] == pytest.approx(m + (layers - 1) * max(c, m) + c)
    assert run["exposed"] == pytest.approx(m + (layers - 1) * max(0.0, m - c))
    assert two_streams([c] * layers, [m] * layers, prefetch=0)["total"] == pytest.approx(layers * (c + m))


def test_uneven_layers_wait_only_where_the_message_is_longer():
    run = two_streams([1.0, 1.0, 3.0, 1.0], [0.5, 2.0, 0.5, 2.5])
    # layer 1 waits 1.0 (its 2.0 message started with layer 0); layer 2's message hid; layer 3's hid behind layer 2
    assert [start for start, _ in run["layers"]] == [0.5, 2.5, 3.5, 6.5]
    assert run["total"] == 7.5 and run["exposed"] == 1.5


def test_async_tensor_parallelism_hides_the_all_gather_behind_the_chunks():
    n = 4  # the rank's own piece first (no message), then N - 1 pieces arriving while it multiplies
    hidden = two_streams([1.0 / n] * n, [0.0] + [0.9 / n] * (n - 1))
    assert hidden["exposed"] == pytest.approx(0.0)
    slow = two_streams([1.0 / n] * n, [0.0] + [2.0 / n] * (n - 1))
    assert slow["exposed"] == pytest.approx((n - 1) * (2.0 - 1.0) / n)


def test_tokens_per_rank_that_hide_a_weight_all_gather():
    assert hiding_tokens(989e12, 50e9) == pytest.approx(19_780)     # H100 bf16, 400 Gb/s per GPU
    assert hiding_tokens(989e12, 450e9) == pytest.approx(2_197.8, abs=0.05)  # NVLink
    assert hiding_tokens(989e12, 50e9, ranks=8) == pytest.approx(19_780 * 7 / 8)


def test_refuses_mismatched_lists():
    with pytest.raises(ValueError, match="as many messages as layers"):
        two_streams([1.0, 1.0], [1.0])
