"""The demo's command line is a contract: flags, --json keys, --save, one-line errors."""
import json
import subprocess
import sys

import numpy as np
import pytest

from minidist.dist.launch import find_mpiexec
from minidist.model import GPT, GPTConfig
from minidist.tensor import default_dtype

SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
         "--log-every", "-1"]
JSON_KEYS = {"world_size", "layout", "dtype", "config", "losses", "tokens_per_s", "parameters", "memory", "comm"}


def demo(*flags, nprocs=None, timeout=180):
    cmd = [sys.executable, "-m", "minidist.demo", *flags]
    if nprocs:
        cmd = [find_mpiexec(), "-n", str(nprocs)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_serial_demo_writes_json_and_weights(tmp_path):
    out, weights = tmp_path / "run.json", tmp_path / "w.npz"
    proc = demo("--steps", "4", "--dtype", "float64", "--json", str(out), "--save", str(weights), *SMALL)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert JSON_KEYS <= set(report)
    assert report["layout"] == {"dp": 1, "tp": 1, "pp": 1, "zero": 0}
    assert report["world_size"] == 1 and report["dtype"] == "float64"
    assert len(report["losses"]) == 4 and report["tokens_per_s"] > 0
    assert report["losses"][0] == pytest.approx(np.log(256), rel=0.05)  # untrained: uniform guess
    memory = report["memory"][0]
    params = report["parameters"]
    assert memory["params"] == 8 * params and memory["optimizer"] == 2 * 8 * params
    assert memory["peak"] >= memory["params"] + memory["grads"] + memory["optimizer"]
    # --save writes every parameter by name; the serial model loads it
    saved = dict(np.load(weights))
    with default_dtype("float64"):
        model = GPT(GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2))
    assert set(saved) == {name for name, _ in model.named_parameters()}
    model.load_state_dict(saved)


def test_demo_learns_the_sorting_task(tmp_path):
    out = tmp_path / "run.json"
    proc = demo("--steps", "60", "--json", str(out), "--lr", "3e-3", *SMALL)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["losses"][-1] < 0.5 * report["losses"][0]
    assert np.mean(report["accuracies"][-10:]) > 0.3  # chance is about 0.1


@pytest.mark.parametrize("flags, message", [
    (["--n-embd", "130"], "n_embd=130 is not divisible by n_head=4"),
    (["--block-size", "8"], "block_size >= 16"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--data", "/no/such/file"], "no task or file named"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_flags_fail_with_one_line(flags, message):
    proc = demo(*flags)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_tour_compares_strategies_with_serial(tmp_path):
    out = tmp_path / "tour.json"
    proc = demo("--steps", "3", "--dtype", "float64", "--json", str(out), *SMALL, nprocs=2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(out.read_text())
    rows = {row["strategy"]: row for row in report["tour"]}
    assert {"serial", "dp"} <= set(rows)
    for row in report["tour"]:
        assert row["max_abs_diff_from_serial"] < 1e-10, row
    assert rows["dp"]["bytes_sent_per_rank"] > 0 and rows["serial"]["bytes_sent_per_rank"] == 0
    assert "max |w - serial|" in proc.stdout
