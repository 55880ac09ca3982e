"""The demo's command line is a contract: flags, --json keys, --save, one-line errors."""
import json
from pathlib import Path
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.comm.launch import find_mpiexec
from minidist.core.model import GPT, GPTConfig
from minidist.runtime import cores_available
from minidist.core.tensor import default_dtype

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


@pytest.mark.full
def test_demo_learns_the_sorting_task(tmp_path):
    out = tmp_path / "run.json"
    proc = demo("--steps", "60", "--json", str(out), "--lr", "3e-3", *SMALL)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["losses"][-1] < 0.5 * report["losses"][0]
    assert np.mean(report["accuracies"][-10:]) > 0.3  # chance is about 0.1


@pytest.mark.parametrize("flags, message", [
    (["--n-embd", "130"], "--n-embd 130 is not divisible by --n-head 4"),
    *(pytest.param(*case, marks=pytest.mark.full) for case in [
        (["--block-size", "8"], "block_size >= 16"),
        (["--steps", "0"], "argument --steps: expected an integer in 1..1000000000, got '0'"),
        (["--data", "/no/such/file"], "no task or file named"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ]),
])
def test_bad_flags_fail_with_one_line(flags, message):
    proc = demo(*flags)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("nprocs, flags, message", [
    (2, ["--dp", "2", "--tp", "2"], "dp=2 x tp=2 needs 4 ranks, but this job has 2 (run: mpirun -n 4"),
    *(pytest.param(*case, marks=pytest.mark.full) for case in [
        (4, ["--dp", "3"], "layout dp3: --dp 3: dp=3 needs 3 ranks, but this job has 4"),
        (2, ["--tp", "2", "--n-head", "1", "--n-embd", "32"], "n_head=1"),
        (2, ["--pp", "2", "--n-layer", "1"], "needs at least 2 layers"),
        (2, ["--pp", "2", "--batch-size", "6", "--microbatches", "4"], "not divisible by dp=1 x 4 micro-batches"),
        (2, ["--zero", "2"], "--zero needs --dp N"),
        (4, ["--dp", "2", "--pp", "2", "--zero", "2"], "stages 2-3 shard the gradients"),
        (4, ["--dp", "2", "--pp", "2", "--accumulation", "2"], "a pipeline's micro-batches are its accumulation"),
        (4, ["--tp", "2", "--pp", "2", "--zero", "1"], "--zero needs --dp N"),
    ]),
])
def test_bad_layouts_fail_before_any_message(nprocs, flags, message):
    proc = demo(*flags, "--steps", "1", nprocs=nprocs)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line, from rank 0


@pytest.mark.full  # the tour runs each of these layouts too
@pytest.mark.parametrize("flags, key", [
    (["--dp", "2", "--zero", "3"], None),
    (["--tp", "2"], None),
    (["--tp", "2", "--sequence-parallel"], None),
    (["--pp", "2", "--microbatches", "2", "--schedule", "gpipe"], "pipeline"),
])
def test_each_layout_reproduces_serial_and_saves_full_weights(tmp_path, flags, key):
    serial_out, serial_w = tmp_path / "s.json", tmp_path / "s.npz"
    out, weights = tmp_path / "p.json", tmp_path / "p.npz"
    common = ["--steps", "3", "--dtype", "float64", *SMALL]
    assert demo(*common, "--json", str(serial_out), "--save", str(serial_w)).returncode == 0
    proc = demo(*common, *flags, "--json", str(out), "--save", str(weights), nprocs=2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report, serial = json.loads(out.read_text()), json.loads(serial_out.read_text())
    assert JSON_KEYS <= set(report) and len(report["memory"]) == 2 and len(report["comm"]) == 2
    np.testing.assert_allclose(report["losses"], serial["losses"], rtol=1e-9)
    got, want = dict(np.load(weights)), dict(np.load(serial_w))
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-7, atol=1e-12, err_msg=name)
    if key == "pipeline":
        assert report["pipeline"]["schedule"] == "gpipe" and report["pipeline"]["microbatches"] == 2
        assert report["pipeline"]["bubble_theory"] == pytest.approx(1 / 3)


@pytest.mark.full
def test_composed_layout_reproduces_serial_and_reports_its_mesh(tmp_path):
    serial_out, serial_w = tmp_path / "s.json", tmp_path / "s.npz"
    out, weights = tmp_path / "p.json", tmp_path / "p.npz"
    common = ["--steps", "3", "--dtype", "float64", *SMALL]
    assert demo(*common, "--json", str(serial_out), "--save", str(serial_w)).returncode == 0
    proc = demo(*common, "--tp", "2", "--pp", "2", "--microbatches", "2", "--json", str(out), "--save", str(weights),
                nprocs=4)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report, serial = json.loads(out.read_text()), json.loads(serial_out.read_text())
    assert JSON_KEYS <= set(report) and len(report["memory"]) == 4
    np.testing.assert_allclose(report["losses"], serial["losses"], rtol=1e-9)
    np.testing.assert_allclose(report["accuracies"], serial["accuracies"], rtol=1e-9)
    got, want = dict(np.load(weights)), dict(np.load(serial_w))
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-7, atol=1e-12, err_msg=name)
    assert report["layout"] == {"dp": 1, "tp": 2, "pp": 2, "zero": 0}
    assert report["mesh"]["shape"] == {"pp": 2, "dp": 1, "tp": 2}
    assert [r["tp_group"] for r in report["mesh"]["ranks"]] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["embedding_group"] for r in report["mesh"]["ranks"]] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    traffic = report["traffic_by_group"]
    assert [t["rank"] for t in traffic] == [0, 1, 2, 3]
    assert all(t["tp"] > 0 and t["pp"] > 0 and t["embedding"] > 0 and "dp" not in t for t in traffic)
    assert report["pipeline"]["stages"] == 2


@pytest.mark.full
def test_deepspeed_config_runs_its_layout(tmp_path):
    out = tmp_path / "ds.json"
    config = Path(__file__).parent.parent / "examples" / "frameworks" / "deepspeed_zero2.json"
    proc = demo("--deepspeed-config", str(config), "--steps", "2", "--json", str(out), *SMALL, nprocs=4)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(out.read_text())
    assert report["layout"] == {"dp": 4, "tp": 1, "pp": 1, "zero": 2}
    assert report["config"]["n_embd"] == 32  # the command line's flags win over the config
    assert "not supported:" in proc.stdout


@pytest.mark.full
def test_precision_flag_trains_in_16_bits_with_master_weights(tmp_path):
    out = tmp_path / "fp16.json"
    proc = demo("--steps", "3", "--dp", "2", "--precision", "fp16", "--json", str(out), *SMALL, nprocs=2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(out.read_text())
    assert report["precision"] == "fp16" and report["skipped_steps"] == []
    assert [entry["scale"] for entry in report["loss_scale"]] == [2.0**16] * 3
    out = tmp_path / "window.json"  # a scale that doubles after every clean step
    proc = demo("--steps", "3", "--precision", "fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "1",
                "--json", str(out), *SMALL)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert [entry["scale"] for entry in json.loads(out.read_text())["loss_scale"]] == [2048.0, 4096.0, 8192.0]
    psi = report["parameters"]
    for ledger in report["memory"]:  # 2 + 2 + 12 bytes per parameter
        assert (ledger["params"], ledger["grads"], ledger["optimizer"]) == (2 * psi, 2 * psi, 12 * psi)


@pytest.mark.full
@pytest.mark.parametrize("flags, ranks", [([], 1), (["--pp", "2", "--microbatches", "2", "--schedule", "gpipe"], 2)])
def test_recompute_keeps_the_numbers_and_shrinks_the_activations(tmp_path, flags, ranks):
    common = ["--steps", "2", "--dtype", "float64", "--dropout", "0.1", *SMALL, *flags]
    runs = {}
    for mode in ("none", "full", "selective"):
        out = tmp_path / f"{mode}.json"
        proc = demo(*common, "--recompute", mode, "--json", str(out), nprocs=ranks if ranks > 1 else None)
        assert proc.returncode == 0, proc.stderr + proc.stdout
        runs[mode] = json.loads(out.read_text())
    for mode in ("full", "selective"):
        assert runs[mode]["losses"] == runs["none"]["losses"]  # bit for bit, dropout included
        for mine, plain in zip(runs[mode]["memory"], runs["none"]["memory"]):
            assert mine["activations"] < plain["activations"]
    assert runs["full"]["recompute"] == "full"


def serial_and_parallel(tmp_path, common: list, flags: list, nprocs: int, serial_flags=()) -> tuple[dict, dict]:
    """The demo's JSON serially (with `serial_flags`) and with `flags` on `nprocs` ranks; their
    losses agree (float64)."""
    serial, parallel = tmp_path / "serial.json", tmp_path / "parallel.json"
    assert demo(*common, *serial_flags, "--json", str(serial)).returncode == 0
    proc = demo(*common, *flags, "--json", str(parallel), nprocs=nprocs)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    want, got = json.loads(serial.read_text()), json.loads(parallel.read_text())
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-9)
    return want, got


@pytest.mark.full
def test_experts_split_over_ranks_reproduce_the_serial_mixture(tmp_path):
    common = ["--steps", "3", "--dtype", "float64", "--experts", "4", "--capacity-factor", "1.0", *SMALL]
    want, got = serial_and_parallel(tmp_path, common, ["--dp", "2", "--ep", "2"], nprocs=2)
    assert got["layout"]["ep"] == 2 and got["moe"]["dropped_tokens"] == want["moe"]["dropped_tokens"]


@pytest.mark.full
def test_experts_in_a_pipeline_reproduce_the_serial_mixture_of_the_same_micro_batches(tmp_path):
    """A pipeline routes each micro-batch as it passes: the reference accumulates the same two."""
    common = ["--steps", "3", "--dtype", "float64", "--experts", "4", "--capacity-factor", "1.0", *SMALL]
    want, got = serial_and_parallel(tmp_path, common, ["--dp", "2", "--pp", "2", "--ep", "2", "--microbatches", "2"],
                                    nprocs=4, serial_flags=["--accumulation", "2"])
    assert got["layout_name"] == "dp2-pp2-ep2-m2" and got["pipeline"]["microbatches"] == 2
    assert got["moe"]["dropped_tokens"] == want["moe"]["dropped_tokens"] and sum(want["moe"]["dropped_tokens"]) > 0


@pytest.mark.full
def test_context_parallel_layout_reproduces_serial(tmp_path):
    common = ["--steps", "3", "--dtype", "float64", *SMALL]
    _, got = serial_and_parallel(tmp_path, common, ["--cp", "2", "--cp-algorithm", "ulysses"], nprocs=2)
    assert got["layout"]["cp"] == 2 and all(t["cp"] > 0 for t in got["traffic_by_group"])


def test_tour_compares_strategies_with_serial(tmp_path):
    out = tmp_path / "tour.json"
    proc = demo("--steps", "3", "--dtype", "float64", "--json", str(out), *SMALL, nprocs=2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(out.read_text())
    rows = {row["strategy"]: row for row in report["tour"]}
    assert {"serial", "dp", "dp-naive", "zero1", "zero2", "zero3", "tp", "tp-sp", "mp", "pp-gpipe", "pp-1f1b"} <= set(rows)
    for row in report["tour"]:
        assert row["max_abs_diff_from_serial"] < 1e-10, row
    assert rows["dp"]["bytes_sent_per_rank"] > 0 and rows["serial"]["bytes_sent_per_rank"] == 0
    assert "max |w - serial|" in proc.stdout
    # which all-reduce ran: on one machine "auto" is the shared-memory window (on two ranks, one
    # exchange of messages for the small arrays: the loss, the norm)
    assert report["algorithm"] == "auto"
    assert "shared_memory" in rows["dp"]["all_reduce_algorithms"] and rows["serial"]["all_reduce_algorithms"] == []
    assert set(rows["dp"]["all_reduce_algorithms"]) <= {"shared_memory", "recursive_doubling"}
    # stdout: one labelled line per strategy (the sample once), no unlabelled step lines
    labelled = [line.split()[0] for line in proc.stdout.splitlines() if " ms/step " in line]
    assert labelled == [row["strategy"] for row in report["tour"]], proc.stdout
    assert proc.stdout.count("| sample ") == 1 and "step    0 |" not in proc.stdout


@pytest.mark.full
def test_plain_kernels_give_the_fast_kernels_numbers(tmp_path):
    fast, plain = tmp_path / "fast.json", tmp_path / "plain.json"
    common = ["--steps", "3", "--dtype", "float64", *SMALL]
    assert demo(*common, "--json", str(fast)).returncode == 0
    proc = demo(*common, "--kernels", "plain", "--json", str(plain))
    assert proc.returncode == 0, proc.stderr
    got, want = json.loads(plain.read_text()), json.loads(fast.read_text())
    assert got["kernels"] == "plain" and want["kernels"] == "fast"
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-12)


@pytest.mark.full
def test_algorithm_flag_runs_a_strategy_over_the_named_all_reduce(tmp_path):
    serial_out, out = tmp_path / "s.json", tmp_path / "ring.json"
    common = ["--steps", "3", "--dtype", "float64", *SMALL]
    assert demo(*common, "--json", str(serial_out)).returncode == 0
    proc = demo(*common, "--dp", "2", "--algorithm", "ring", "--json", str(out), nprocs=2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report, serial = json.loads(out.read_text()), json.loads(serial_out.read_text())
    assert report["algorithm"] == "ring" and report["all_reduce_algorithms"] == ["ring"]
    np.testing.assert_allclose(report["losses"], serial["losses"], rtol=1e-9)


@pytest.mark.full
def test_each_rank_gets_its_share_of_the_cores_for_blas(tmp_path):
    """Without OMP_NUM_THREADS, BLAS would start a thread per core in every rank; the demo
    limits each rank to cores // ranks-on-this-machine and says so once."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    cores = cores_available()
    cmd = [find_mpiexec(), "-n", "2", sys.executable, "-m", "minidist.demo", "--dp", "2", "--steps", "1", *SMALL]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "BLAS/OpenMP thread" in line]
    if cores >= 2:
        share = cores // 2
        assert len(said) == 1 and f"2 ranks share {cores} cores" in said[0], proc.stderr
        assert f": {share} BLAS/OpenMP thread" in said[0]
    else:
        assert said == []


@pytest.mark.full
def test_interleaved_pipeline_reproduces_serial(tmp_path):
    """--schedule interleaved: 2 ranks x 2 chunks each need 4 layers (SMALL has 2; the later flag wins)."""
    serial_out, serial_w = tmp_path / "s.json", tmp_path / "s.npz"
    out, weights = tmp_path / "p.json", tmp_path / "p.npz"
    common = ["--steps", "3", "--dtype", "float64", *SMALL, "--n-layer", "4"]
    assert demo(*common, "--json", str(serial_out), "--save", str(serial_w)).returncode == 0
    proc = demo(*common, "--pp", "2", "--microbatches", "2", "--schedule", "interleaved",
                "--json", str(out), "--save", str(weights), nprocs=2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report, serial = json.loads(out.read_text()), json.loads(serial_out.read_text())
    assert JSON_KEYS <= set(report) and report["layout"] == {"dp": 1, "tp": 1, "pp": 2, "zero": 0}
    np.testing.assert_allclose(report["losses"], serial["losses"], rtol=1e-9)
    got, want = dict(np.load(weights)), dict(np.load(serial_w))
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-7, atol=1e-12, err_msg=name)
    pipeline = report["pipeline"]
    assert pipeline["schedule"] == "interleaved" and pipeline["virtual_stages"] == 2  # --virtual-stages default
    assert pipeline["microbatches"] == 2 and pipeline["bubble_theory"] == pytest.approx(1 / 5)  # (p-1)/(v m+p-1)


@pytest.mark.full
@pytest.mark.parametrize("flags, message", [
    (["--microbatches", "3", "--batch-size", "6"], "m=3 is not a multiple of pp=2"),
    (["--virtual-stages", "3"], "pp=2 stages x virtual_stages=3 = 6 chunks needs at least 6 layers"),
])
def test_bad_interleaved_layouts_fail_before_any_message(flags, message):
    proc = demo("--pp", "2", "--schedule", "interleaved", "--n-layer", "4", *flags, "--steps", "1", nprocs=2)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.full
def test_demo_prints_the_node_layout_and_reproduces_serial_on_two_nodes(tmp_path):
    """MPICH's fork launcher with two made-up hosts: MPI sees two machines (chapter 2)."""
    serial_out, out = tmp_path / "s.json", tmp_path / "two.json"
    common = ["--steps", "3", "--dtype", "float64", *SMALL]
    assert demo(*common, "--json", str(serial_out)).returncode == 0
    cmd = [find_mpiexec(), "-launcher", "fork", "-hosts", "a,b", "-ppn", "2", "-n", "4",
           sys.executable, "-m", "minidist.demo", *common, "--dp", "4", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "minidist: 4 ranks on 2 nodes: node 0: ranks 0-1; node 1: ranks 2-3" in proc.stdout
    report, serial = json.loads(out.read_text()), json.loads(serial_out.read_text())
    assert report["all_reduce_algorithms"] == ["hierarchical"]  # auto, across nodes with neighbours
    np.testing.assert_allclose(report["losses"], serial["losses"], rtol=1e-9)
