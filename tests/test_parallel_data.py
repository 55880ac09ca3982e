"""Data parallelism reproduces the serial run (chapter 3), under real mpiexec with 2, 3, 4 ranks.

One launch per world size runs every variant (naive, bucketed with tiny/medium/whole-model
buckets, gradient accumulation) for a few float64 steps; the serial reference runs here, in
the test process, on the same global batches.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from minidist.data import make_task
from minidist.dist.launch import find_mpiexec, run
from minidist.model import GPTConfig
from minidist.tensor import default_dtype
from minidist.train import OptimSettings, SerialTrainer

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
STEPS, BATCH = 3, 24  # 24 rows split evenly for dp = 2, 3, 4 with 1 or 2 accumulation steps
SETTINGS = dict(lr=1e-2, steps=STEPS, warmup=1, min_lr=1e-3, clip=1.0)
VARIANTS = [  # (name, overlap, bucket_cap_bytes, accumulation, all-reduce algorithm)
    ("naive", False, 1 << 20, 1, "auto"),
    ("bucket per parameter", True, 1, 1, "auto"),
    ("medium buckets", True, 4096, 1, "auto"),
    ("one bucket", True, 1 << 30, 1, "ring"),
    ("accumulation 2", True, 4096, 2, "auto"),
]


def dp_rank_program(variants):
    from minidist.dist import get_world, traffic
    from minidist.parallel.data import DataParallelTrainer

    world = get_world()
    out = {}
    with default_dtype("float64"):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        for name, overlap, cap, accumulation, algorithm in variants:
            traffic.reset()
            trainer = DataParallelTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, seed=0,
                                          group=world, overlap=overlap, bucket_cap_bytes=cap,
                                          accumulation=accumulation, algorithm=algorithm)
            traffic.reset()  # count the steps only, not the initial broadcast and checks
            losses = [trainer.step(s)[0] for s in range(STEPS)]
            kinds = traffic.snapshot()
            grad_bytes = sum(p.data.nbytes for p in trainer.model.parameters())
            in_buckets = all(any(np.shares_memory(p.grad, b.buffer) for b in trainer.ddp.buckets)
                             for p in trainer.model.parameters())
            backward = [(e[2], e[3]) for e in trainer.timeline.events if e[1] == "backward"]
            overlapped = [any(start <= e[2] < end for start, end in backward)
                          for e in trainer.timeline.events if e[1] == "comm"]
            out[name] = {
                "losses": losses,
                "state": trainer.state_dict(),
                "grad_bytes": grad_bytes,
                "all_reduce_bytes_per_step": sum(v["bytes_sent"] for k, v in kinds.items()
                                                 if k.startswith("all_reduce.") and k != "total") / STEPS,
                "any_comm_before_backward_ended": any(overlapped),
                "grads_live_in_buckets": in_buckets,
                "memory": trainer.memory(),
            }
    return out


def serial_reference():
    with default_dtype("float64"):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        trainer = SerialTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, seed=0)
        losses = [trainer.step(s)[0] for s in range(STEPS)]
        return losses, trainer.state_dict()


@pytest.fixture(scope="module")
def serial():
    return serial_reference()


@pytest.fixture(scope="module", params=[2, 3, 4])
def parallel(request):
    return request.param, run(dp_rank_program, request.param, VARIANTS, timeout=240)


def relative_difference(a, b):
    """max |a - b| relative to max |b|, or to 0.01 (the weights' scale) for a parameter whose
    true gradient is zero (attention's k_proj.bias: softmax ignores a shift shared by every key),
    so that its values are pure round-off, ~1e-15, and a relative comparison means nothing."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-2))


@pytest.mark.parametrize("variant", [v[0] for v in VARIANTS])
def test_data_parallel_equals_serial(serial, parallel, variant):
    n, results = parallel
    serial_losses, serial_state = serial
    for rank, result in enumerate(results):
        got = result[variant]
        np.testing.assert_allclose(got["losses"], serial_losses, rtol=1e-9, err_msg=f"dp={n} rank {rank} {variant}")
        for key, value in serial_state.items():
            diff = relative_difference(got["state"][key], value)
            assert diff <= 1e-9, f"dp={n} rank {rank} {variant}: {key} differs from serial by {diff:.2e}"


def test_replicas_hold_identical_weights(parallel):
    n, results = parallel
    for variant in results[0]:
        for rank in range(1, n):
            for key, value in results[0][variant]["state"].items():
                assert np.array_equal(results[rank][variant]["state"][key], value), (variant, rank, key)


def test_traffic_is_one_ring_all_reduce_of_the_gradient(parallel):
    """Bucketed DP with the ring sends 2(N-1)/N x gradient bytes per rank per step (the "auto"
    choice may pick recursive doubling or halving-doubling for small buckets: test the ring)."""
    n, results = parallel
    for result in results:
        got = result["one bucket"]
        expected = 2 * (n - 1) / n * got["grad_bytes"]
        sent = got["all_reduce_bytes_per_step"]
        # plus the 16-byte all-reduce of (loss, accuracy) per step (a few messages of 16 bytes)
        assert 0 <= sent - expected <= 16 * 2 * n, (n, sent, expected)


def test_bucketed_gradients_live_in_the_buckets(parallel):
    """Backward writes each gradient into its bucket (no copy, no second gradient-sized array),
    so the memory ledger counts the buckets once, as the gradients."""
    _, results = parallel
    for result in results:
        for variant, got in result.items():
            assert got["grads_live_in_buckets"] == (variant != "naive"), variant
            ledger = got["memory"]
            assert ledger["buckets"] == 0 and ledger["grads"] == got["grad_bytes"], (variant, ledger)
            assert ledger["peak"] == ledger["params"] + ledger["grads"] + ledger["optimizer"] + ledger["activations"]


def test_bucketed_all_reduce_starts_during_backward(parallel):
    _, results = parallel
    for result in results:
        assert result["bucket per parameter"]["any_comm_before_backward_ended"]
        assert not result["naive"]["any_comm_before_backward_ended"]


def _demo(nprocs, *flags):
    cmd = [find_mpiexec(), "-n", str(nprocs), sys.executable, "-m", "minidist.demo", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_batch_not_divisible_fails_before_training():
    proc = _demo(2, "--dp", "2", "--batch-size", "6", "--accumulation", "4", "--steps", "1")
    assert proc.returncode != 0
    assert "global batch 6 is not divisible by dp=2 x accumulation=4" in proc.stderr
    assert proc.stderr.count("error") == 1, proc.stderr  # one line, from rank 0 only


def test_layout_not_matching_world_fails_with_one_line():
    proc = _demo(4, "--dp", "3", "--steps", "1")
    assert proc.returncode != 0
    assert "layout dp=3 needs 3 ranks, but this job has 4" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bench_dp_json_has_speedups_and_the_share_of_the_ceiling(tmp_path):
    """`python -m minidist.bench dp` (one short job): its JSON keeps its keys, and each dp row
    says what share of its ceiling it reached (a ratio of times, so between 0 and ~1.5)."""
    from minidist.bench import dp as bench_dp

    path = tmp_path / "dp.json"
    assert bench_dp.main(["--dp", "2", "--repeats", "1", "--steps", "2", "--warmup", "1", "--json", str(path)]) == 0
    records = {r["mode"]: r for r in json.loads(path.read_text())}
    assert set(records) == {"serial", "naive", "bucketed", "ceiling"}
    for mode in ("naive", "bucketed"):
        r = records[mode]
        assert r["speedup_vs_serial"] > 0 and r["bytes_sent_per_rank_per_step"] == pytest.approx(
            r["ring_formula_bytes"], rel=0.01)
        assert 0.2 < r["of_ceiling"] < 1.5 and r["of_ceiling_range"][0] <= r["of_ceiling"] <= r["of_ceiling_range"][1]
