"""Memory arithmetic (minidist/plan/memory.py): measured bytes equal the formulas, to the byte, on the
real GPT; the ZeRO estimator reproduces the ZeRO paper's Figure 1; the CLI speaks JSON."""
import json
import subprocess
import sys

import numpy as np
import pytest

from minidist.plan import memory
from minidist.core.model import GPT, GPTConfig
from minidist.core.optim import AdamW
from minidist.core.tensor import default_dtype, graph_bytes

SMALL = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize("config", [GPTConfig(), GPTConfig(**SMALL, tie_weights=False),
                                    GPTConfig(n_layer=1, n_embd=48, n_head=3, block_size=8)])
def test_param_count_matches_the_model(config):
    model = GPT(config)
    assert memory.param_count(config) == model.num_parameters()
    assert memory.param_bytes(model) == 4 * model.num_parameters()


def test_demo_model_size():
    # 12 L h^2 + 13 L h + (V + T) h + 2h for the demo config: the number chapter 1 quotes
    assert memory.param_count(GPTConfig()) == 12 * 4 * 128**2 + 13 * 4 * 128 + (256 + 64) * 128 + 256 == 834_304


@pytest.mark.parametrize("dtype, size", [(np.float32, 4), (np.float64, 8)])
def test_ledger_after_one_adam_step(dtype, size):
    with default_dtype(dtype):
        model = GPT(GPTConfig(**SMALL), seed=0)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    n = model.num_parameters()
    assert memory.ledger(model, optimizer) == dict(params=size * n, grads=0, optimizer=0, activations=0, peak=size * n)
    x = np.random.default_rng(0).integers(0, 64, size=(2, 16))
    _, loss = model(x, x)
    acts = graph_bytes(loss)
    loss.backward()
    optimizer.step()
    book = memory.ledger(model, optimizer, acts)
    assert book == dict(params=size * n, grads=size * n, optimizer=2 * size * n, activations=acts,
                        peak=4 * size * n + acts)  # Adam: 4 + 4 + 8 bytes per parameter in fp32


@pytest.mark.parametrize("kwargs, batch, seq", [
    (dict(), 2, 64),                                                       # the demo model
    (dict(), 3, 17),                                                       # a shorter sequence
    (dict(SMALL, tie_weights=False), 2, 16),
    (dict(n_layer=3, n_head=3, n_embd=24, block_size=12, vocab_size=40, dropout=0.1), 2, 12),
])
def test_activation_formula_equals_graph_bytes(kwargs, batch, seq):
    config = GPTConfig(**kwargs)
    model = GPT(config, seed=0)
    x = np.random.default_rng(1).integers(0, config.vocab_size, size=(batch, seq))
    _, loss = model(x, x)
    assert graph_bytes(loss) == memory.activation_bytes(config, batch, seq)["total"]


def test_activation_per_layer_is_the_difference_of_two_depths():
    x = np.zeros((2, 64), dtype=np.int64)
    measured = []
    for n_layer in (1, 2):
        _, loss = GPT(GPTConfig(n_layer=n_layer))(x, x)
        measured.append(graph_bytes(loss))
    b, s, h, a = 2, 64, 128, 4
    assert measured[1] - measured[0] == 4 * (25 * b * s * h + 2 * b * s + a * b * s * s) == 1_770_496


def test_megatron_formula():
    # s b h (34 + 5 a s / h): GPT-3 175B layer (h 12288, a 96) at s 2048, b 1 is about 2.87 GB
    assert memory.megatron_activation_bytes(1, 2048, 12288, 96) == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)
    assert memory.megatron_activation_bytes(1, 2048, 12288, 96) == pytest.approx(2.87e9, rel=0.01)


GB = 1e9


@pytest.mark.parametrize("stage, expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_figure_1(stage, expected_gb):
    # 7.5B parameters, N = 64 data-parallel ranks, mixed-precision Adam (K = 12)
    piles = memory.model_state_bytes(7.5e9, dp=64, zero=stage)
    assert piles["total"] / GB == pytest.approx(expected_gb, rel=0.01)
    assert piles["total"] == piles["params"] + piles["grads"] + piles["optimizer"]


def test_model_state_formulas():
    psi, n = 1e9, 8
    assert memory.model_state_bytes(psi)["total"] == 16 * psi
    assert memory.model_state_bytes(psi, precision="fp32") == dict(params=4 * psi, grads=4 * psi, optimizer=8 * psi, total=16 * psi)
    assert memory.model_state_bytes(psi, n, 1)["total"] == 4 * psi + 12 * psi / n
    assert memory.model_state_bytes(psi, n, 2)["total"] == 2 * psi + 14 * psi / n
    assert memory.model_state_bytes(psi, n, 3)["total"] == 16 * psi / n
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3, got 5"):
        memory.model_state_bytes(psi, n, 5)
    with pytest.raises(ValueError, match="data-parallel degree must be an integer >= 1, got 0"):
        memory.model_state_bytes(psi, 0)
    with pytest.raises(ValueError, match="precision must be one of"):
        memory.model_state_bytes(psi, precision="fp8")


@pytest.mark.parametrize("text, value", [("7.5B", 7_500_000_000), ("7.5e9", 7_500_000_000), ("175b", 175 * 10**9),
                                         ("350M", 350_000_000), ("125000", 125_000), ("1T", 10**12), (" 2k ", 2000)])
def test_parse_count(text, value):
    assert memory.parse_count(text) == value


@pytest.mark.parametrize("text", ["", "seven", "7.5X", "-3B", "0", "1e-3"])
def test_parse_count_rejects(text):
    with pytest.raises(ValueError, match="parameter count"):
        memory.parse_count(text)


def test_format_bytes():
    assert [memory.format_bytes(x) for x in (120e9, 31.40625e9, 1.875e9, 812_345, 12)] == \
        ["120 GB", "31.4 GB", "1.88 GB", "812 KB", "12 B"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "minidist.plan.memory", *args], capture_output=True, text=True, timeout=60)


def test_cli_json():
    result = run_cli("--params", "7.5B", "--dp", "64", "--zero", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["bytes_per_device"] == 2 * 7.5e9 + 14 * 7.5e9 / 64
    assert report["breakdown"] == {"params": 15e9, "grads": 2 * 7.5e9 / 64, "optimizer": 12 * 7.5e9 / 64}
    assert (report["params"], report["dp"], report["zero"]) == (7_500_000_000, 64, 2)


def test_cli_table_and_errors():
    result = run_cli("--params", "7.5e9", "--dp", "64", "--zero", "3")
    assert result.returncode == 0 and "1.88 GB" in result.stdout
    bad = run_cli("--params", "lots")
    assert bad.returncode == 2 and "cannot read a parameter count from 'lots'" in bad.stderr
    bad = run_cli("--params", "1B", "--zero", "7")
    assert bad.returncode == 2 and "ZeRO stage must be 0, 1, 2 or 3, got 7" in bad.stderr


@pytest.mark.parametrize("config", [GPTConfig(), GPTConfig(**SMALL, tie_weights=False)])
def test_tensor_parallel_parameter_counts_add_up_to_the_model(config):
    """Split + replicated is the whole GPT; a rank of tp holds split / tp + replicated (chapter 6)."""
    counts = memory.tensor_parallel_parameter_counts(config, 1)
    assert counts["split"] + counts["replicated"] == counts["per_rank"] == GPT(config).num_parameters()
    C, L = config.n_embd, config.n_layer
    assert counts["replicated"] == 6 * L * C + config.block_size * C + 2 * C
    assert memory.tensor_parallel_parameter_counts(config, 4)["per_rank"] == counts["split"] // 4 + counts["replicated"]


def test_sequence_parallel_activation_bytes_of_the_demo_model():
    """The numbers chapter 6, section 8 quotes: a region of 23.1 MB, 4.7 MB of gathered inputs, and
    what sequence parallelism saves per rank at t = 2 and 4 (float32, batch 16); nothing at t = 1."""
    config = GPTConfig()
    one, two, four = (memory.sequence_parallel_activation_bytes(config, 16, t) for t in (1, 2, 4))
    btc, bt = 16 * 64 * 128, 16 * 64
    assert one["region"] == 4 * (4 * (10 * btc + 2 * bt) + 4 * btc + 64 * 128 + bt) == two["region"]
    assert (one["gathered"], one["saved"]) == (0, 0)
    assert two["gathered"] == four["gathered"] == 4 * 9 * btc
    assert round(two["region"] / 1e6, 1) == 23.1 and round(two["gathered"] / 1e6, 1) == 4.7
    assert round(two["saved"] / 1e6, 1) == 6.9 and round(four["saved"] / 1e6, 1) == 12.6
