"""The bytes a fused bias + GeLU + dropout does not move (chapter 11)."""
import pytest

from minidist.future.fusion import chain_bytes, mlp_elements


@pytest.mark.parametrize("e, m", [(4, 4), (2, 1), (2, 2)])
def test_bytes_per_element(e, m):
    unfused, fused = chain_bytes(1, e, m, fused=False), chain_bytes(1, e, m, fused=True)
    assert (unfused["forward"], unfused["backward"], unfused["total"]) == (6 * e + m, 6 * e + m, 12 * e + 2 * m)
    assert (fused["forward"], fused["backward"], fused["total"]) == (2 * e + m, 3 * e + m, 5 * e + 2 * m)


def test_minidist_demo_mlp():
    n = mlp_elements(16, 64, 128)  # the demo GPT: batch 16, sequence 64, width 128
    assert n == 524_288
    assert chain_bytes(n, 4, 4, fused=False)["total"] == 29_360_128  # float32, masks in the model's dtype
    assert chain_bytes(n, 4, 4, fused=True)["total"] == 14_680_064   # exactly half
    assert chain_bytes(n, 2, 1, fused=False)["total"] == 13_631_488  # bf16, 1-byte masks: 26 n
    assert chain_bytes(n, 2, 1, fused=True)["total"] == 6_291_456    # 12 n


def test_every_pass_is_listed():
    passes = chain_bytes(10, 2, 1, fused=False)["passes"]
    assert [(d, name) for d, name, _ in passes] == [
        ("forward", "bias add"), ("forward", "GeLU"), ("forward", "dropout"),
        ("backward", "dropout"), ("backward", "GeLU"), ("backward", "bias")]
    assert [b for _, _, b in passes] == [40, 40, 50, 50, 60, 20]
