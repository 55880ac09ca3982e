"""Data parallelism reproduces the serial run (chapter 3), under real mpiexec with 2, 3, 4 ranks,
and with 4 ranks as 2 nodes x 2 over TCP sockets.

One launch per world size runs every variant (naive, bucketed with tiny/medium/whole-model
buckets, gradient accumulation, uneven and speed-balanced splits of the batch) for a few float64
steps; the serial reference runs here, in the test process, on the same global batches.
"""
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import layout, relative_difference, serial_run

from minidist.core.data import make_task
from minidist.comm.launch import find_mpiexec, run
from minidist.core.model import GPTConfig
from minidist.core.tensor import default_dtype
from minidist.training.train import OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
STEPS, BATCH = 3, 24  # 24 rows split evenly for dp = 2, 3, 4 with 1 or 2 accumulation steps
SETTINGS = dict(lr=1e-2, steps=STEPS, warmup=1, min_lr=1e-3, clip=1.0)
VARIANTS = [  # (name, overlap, bucket_cap_bytes, accumulation, all-reduce algorithm, split)
    ("naive", False, 1 << 20, 1, "auto", "even"),
    ("naive, ring as the process default", False, 1 << 20, 1, "default ring", "even"),  # algorithm=None
    ("bucket per parameter", True, 1, 1, "auto", "even"),
    ("medium buckets", True, 4096, 1, "auto", "even"),
    ("medium buckets, copied through the window", True, 4096, 1, "auto", "even"),  # registered_buckets=False
    ("one bucket", True, 1 << 30, 1, "ring", "even"),
    ("accumulation 2", True, 4096, 2, "auto", "even"),
    ("naive, uneven rows", False, 1 << 20, 1, "auto", "uneven"),
    ("uneven rows", True, 4096, 1, "auto", "uneven"),
    ("uneven rows, accumulation 2", True, 4096, 2, "auto", "uneven"),
    ("balanced", True, 4096, 1, "auto", "balance"),
]


COPIED = "medium buckets, copied through the window"


def uneven_rows(n):
    """A lopsided split of the 24 rows, every rank at least 2 (for 2 accumulation steps)."""
    return {2: [15, 9], 3: [11, 3, 10], 4: [2, 9, 5, 8]}[n]


def dp_rank_program(variants):
    import contextlib

    from minidist.comm import all_reduce_algorithm, get_world, registered, shared_memory, traffic
    from minidist.parallel.balance import BalancedDataParallelTrainer
    from minidist.parallel.data_parallel import DataParallelTrainer

    world = get_world()
    out = {}
    with default_dtype("float64"):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        for name, overlap, cap, accumulation, algorithm, split in variants:
            traffic.reset()
            kind = BalancedDataParallelTrainer if split == "balance" else DataParallelTrainer
            by_default = algorithm == "default ring"  # the trainer names no algorithm: the process's default rules
            trainer = kind(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, seed=0, group=world,
                           overlap=overlap, bucket_cap_bytes=cap, accumulation=accumulation,
                           algorithm=None if by_default else algorithm,
                           rows=uneven_rows(world.size) if split == "uneven" else None,
                           **({"registered_buckets": False} if name == COPIED else {}))
            traffic.reset()  # count the steps only, not the initial broadcast and checks
            with all_reduce_algorithm("ring") if by_default else contextlib.nullcontext():
                losses = [trainer.step(s)[0] for s in range(STEPS)]
            kinds = traffic.snapshot()
            grad_bytes = sum(p.data.nbytes for p in trainer.model.parameters())
            buckets = getattr(trainer.ddp, "buckets", [])  # the naive wrapper has none
            in_buckets = all(any(np.shares_memory(p.grad, b.buffer) for b in buckets)
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
                "all_reduce_kinds": sorted(k for k, v in kinds.items()
                                           if k.startswith("all_reduce.") and v["bytes_sent"] > 0),
                "any_comm_before_backward_ended": any(overlapped),
                "grads_live_in_buckets": in_buckets,
                "buckets_registered": bool(buckets) and all(registered.find(b.buffer) is not None for b in buckets),
                "one_machine": shared_memory.window_or_none(world) is not None,
                "overlap": overlap,
                "memory": trainer.memory(),
            }
    return out


@pytest.fixture(scope="module")
def serial():
    reference = serial_run(CONFIG, SETTINGS, BATCH, STEPS)
    return reference["losses"], reference["state"]


@pytest.fixture(scope="module", params=[layout(2), layout(3, full=True), layout(4, full=True),
                                        layout(4, nodes=2, tcp=True, full=True)])
def parallel(request):
    n, nodes, tcp = request.param
    results = run(dp_rank_program, n, VARIANTS, timeout=240, nodes=nodes, tcp=tcp)
    assert len(results) == n and all(len(result) == len(VARIANTS) for result in results)
    return n, results


@pytest.mark.parametrize("variant", [v[0] for v in VARIANTS])
def test_data_parallel_equals_serial(serial, parallel, variant):
    n, results = parallel
    serial_losses, serial_state = serial
    assert len(results) == n
    for rank, result in enumerate(results):
        got = result[variant]
        np.testing.assert_allclose(got["losses"], serial_losses, rtol=1e-9, err_msg=f"dp={n} rank {rank} {variant}")
        assert set(got["state"]) == set(serial_state)
        for key, value in serial_state.items():
            diff = relative_difference(got["state"][key], value)
            assert diff <= 1e-9, f"dp={n} rank {rank} {variant}: {key} differs from serial by {diff:.2e}"


def test_replicas_hold_identical_weights(parallel):
    n, results = parallel
    assert len(results) == n and len(results[0]) == len(VARIANTS)
    for variant in results[0]:
        for rank in range(1, n):
            for key, value in results[0][variant]["state"].items():
                assert np.array_equal(results[rank][variant]["state"][key], value), (variant, rank, key)


def test_traffic_is_one_ring_all_reduce_of_the_gradient(parallel):
    """Bucketed DP with the ring sends 2(N-1)/N x gradient bytes per rank per step (the "auto"
    choice may pick recursive doubling or halving-doubling for small buckets: test the ring)."""
    n, results = parallel
    assert len(results) == n
    for result in results:
        got = result["one bucket"]
        expected = 2 * (n - 1) / n * got["grad_bytes"]
        sent = got["all_reduce_bytes_per_step"]
        # plus the 16-byte all-reduce of (loss, accuracy) per step (a few messages of 16 bytes)
        assert 0 <= sent - expected <= 16 * 2 * n, (n, sent, expected)


def test_the_process_default_algorithm_reaches_data_parallel(parallel):
    """algorithm=None (the default) follows `all_reduce_algorithm`: under ("ring") every
    all-reduce of the step, gradients and statistics, runs over chapter 7's ring."""
    n, results = parallel
    assert len(results) == n
    for result in results:
        assert result["naive, ring as the process default"]["all_reduce_kinds"] == ["all_reduce.ring"]


def test_bucketed_gradients_live_in_the_buckets(parallel):
    """Backward writes each gradient into its bucket (no copy, no second gradient-sized array),
    so the memory ledger counts the buckets once, as the gradients."""
    n, results = parallel
    assert len(results) == n
    for result in results:
        assert len(result) == len(VARIANTS)
        for variant, got in result.items():
            assert got["grads_live_in_buckets"] == got["overlap"], variant
            ledger = got["memory"]
            assert ledger["buckets"] == 0 and ledger["grads"] == got["grad_bytes"], (variant, ledger)
            assert ledger["peak"] == ledger["params"] + ledger["grads"] + ledger["optimizer"] + ledger["activations"]


def test_registered_buckets_give_the_bits_of_buckets_copied_through_the_window(parallel):
    """The buckets live in shared memory whenever the ranks share a machine (and the wrapper is
    not told otherwise); their all-reduce adds the same numbers in the same order as the window's."""
    n, results = parallel
    assert len(results) == n
    for result in results:
        one_machine = result["medium buckets"]["one_machine"]
        assert result["medium buckets"]["buckets_registered"] == one_machine
        assert result["accumulation 2"]["buckets_registered"] == one_machine
        assert not result[COPIED]["buckets_registered"] and not result["naive"]["buckets_registered"]
        assert result[COPIED]["losses"] == result["medium buckets"]["losses"]
        for key, value in result["medium buckets"]["state"].items():
            assert np.array_equal(result[COPIED]["state"][key], value), key


def test_bucketed_all_reduce_starts_during_backward(parallel):
    n, results = parallel
    assert len(results) == n
    for result in results:
        assert result["bucket per parameter"]["any_comm_before_backward_ended"]
        assert not result["naive"]["any_comm_before_backward_ended"]


def _demo(nprocs, *flags):
    cmd = [find_mpiexec(), "-n", str(nprocs), sys.executable, "-m", "minidist.demo", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.full
def test_batch_not_divisible_fails_before_training():
    proc = _demo(2, "--dp", "2", "--batch-size", "6", "--accumulation", "4", "--steps", "1")
    assert proc.returncode != 0
    assert "--batch-size 6 (the global batch) is not divisible by dp=2 x 4 accumulation steps" in proc.stderr
    assert proc.stderr.count("error") == 1, proc.stderr  # one line, from rank 0 only


@pytest.mark.full
def test_layout_not_matching_world_fails_with_one_line():
    proc = _demo(4, "--dp", "3", "--steps", "1")
    assert proc.returncode != 0
    assert "--dp 3: dp=3 needs 3 ranks, but this job has 4" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.full
def test_bench_dp_json_has_speedups_and_the_share_of_the_ceiling(tmp_path):
    """`python -m minidist.bench dp` (one short job): its JSON keeps its keys, and each dp row
    says what share of its ceiling it reached: the ceiling's step time over the row's, in the same
    job (two timed steps on a shared machine: the ratio itself can land anywhere near 1)."""
    from minidist.bench import dp as bench_dp

    path = tmp_path / "dp.json"
    assert bench_dp.main(["--dp", "2", "--repeats", "1", "--steps", "2", "--warmup", "1", "--slow", "1:0.5",
                          "--json", str(path)]) == 0
    records = {r["mode"]: r for r in json.loads(path.read_text())}
    assert set(records) == {"serial", "naive", "bucketed", "balanced", "ceiling"}
    assert all(r["slow"] == {"rank": 1, "ms_per_row": 0.5} for r in records.values())
    for mode in ("naive", "bucketed", "balanced"):
        r = records[mode]
        assert r["speedup_vs_serial"] > 0 and r["bytes_sent_per_rank_per_step"] == pytest.approx(
            r["ring_formula_bytes"], rel=0.01)
        assert r["of_ceiling"] == pytest.approx(records["ceiling"]["seconds"] / r["seconds"], rel=1e-12)
        assert r["of_ceiling_range"] == [r["of_ceiling"]] * 2 and 0.1 < r["of_ceiling"] < 10  # one job; a ratio, not a %
    splits = records["balanced"]["splits"]  # rows per rank of each timed step, e.g. {"8/8": 1, "9/7": 1}
    assert sum(splits.values()) == 2 and all(sum(map(int, k.split("/"))) == 16 for k in splits), splits
    assert records["bucketed"]["splits"] == {}
    # the bucketed wrappers' hooks do the all-reduce work inside backward; the naive one has none
    assert all(0 < records[m]["hook_seconds"] < records[m]["seconds"] for m in ("bucketed", "balanced"))
    assert all(records[m]["hook_seconds"] == 0.0 for m in ("serial", "naive", "ceiling"))


def test_bench_dp_rotates_the_variants_after_serial():
    """Serial first every step; the others rotate, so none always runs right after it."""
    from minidist.bench.dp import in_turn

    trainers = {"serial": 0, "naive": 1, "bucketed": 2, "ceiling": 3}
    orders = [[mode for mode, _ in in_turn(trainers, step)] for step in range(4)]
    assert orders == [["serial", "naive", "bucketed", "ceiling"], ["serial", "bucketed", "ceiling", "naive"],
                      ["serial", "ceiling", "naive", "bucketed"], ["serial", "naive", "bucketed", "ceiling"]]
    assert [m for m, _ in in_turn({"bucketed": 0, "ceiling": 1}, 1)] == ["ceiling", "bucketed"]


def test_bench_dp_rejects_a_slow_rank_that_does_not_exist(capsys):
    from minidist.bench import dp as bench_dp

    with pytest.raises(SystemExit):
        bench_dp.main(["--dp", "1,2", "--slow", "1:3"])
    assert "rank 1 does not exist at dp=1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_dp.main(["--dp", "2", "--slow", "3ms"])
    assert "--slow takes RANK:MS" in capsys.readouterr().err


def test_bench_dp_torch_yardstick_says_when_torch_is_missing(capsys, monkeypatch):
    """PyTorch is never a dependency: without it, --torch stops with the command to install it."""
    from minidist.bench import dp as bench_dp

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(SystemExit):
        bench_dp.main(["--dp", "2", "--torch"])
    assert "--torch needs PyTorch: pip install torch" in capsys.readouterr().err


# ----------------------------------------------------------------------------- stragglers


def test_balanced_split_gives_the_slow_rank_fewer_rows():
    from minidist.parallel.balance import balanced_split

    assert balanced_split(16, [1.0, 1.0], [0.0, 0.0]) == [8, 8]
    assert balanced_split(16, [1.0, 2.0], [0.0, 0.0]) == [11, 5]  # finishes at 11 and 10 (10/6 would be 12)
    assert balanced_split(24, [1.0, 1.0, 1.0], [0.0, 0.0, 6.0]) == [10, 10, 4]  # fixed cost counts too
    assert balanced_split(8, [1.0, 100.0], [0.0, 0.0], min_rows=2) == [6, 2]  # never below min_rows
    with pytest.raises(ValueError, match="cannot give each of 3 ranks 2 rows"):
        balanced_split(5, [1.0] * 3, [0.0] * 3, min_rows=2)


def test_row_balancer_moves_rows_only_for_a_real_gain():
    from minidist.parallel.balance import RowBalancer

    balancer = RowBalancer(16, 2)  # default margin: 10%
    assert balancer.rows == [8, 8]
    assert balancer.update([0.080, 0.096], [0.005, 0.005]) == [8, 8]  # 20% apart: 9/7 would gain 6%, stay
    assert balancer.update([0.080, 0.120], [0.005, 0.0075]) != [8, 8]  # rank 1 1.5x slower
    assert balancer.rows[1] < balancer.rows[0] and sum(balancer.rows) == 16
    eager = RowBalancer(16, 2, margin=0.0)
    assert eager.update([0.080, 0.096], [0.005, 0.005]) == [9, 7]  # without a margin it moves


def test_uneven_rows_are_slices_of_the_serial_batch():
    from minidist.core.data import shard_rows

    task = make_task("sort", 16, seed=0)
    x, _ = task.get_batch(3, 10)
    parts = [task.get_batch(3, 10, r, 3, counts=[5, 2, 3])[0] for r in range(3)]
    assert [len(p) for p in parts] == [5, 2, 3] and np.array_equal(np.concatenate(parts), x)
    with pytest.raises(ValueError, match=r"rows per rank \[5, 5\] must be 3 positive counts"):
        shard_rows(10, 0, 3, counts=[5, 5])


def test_balancer_takes_rows_from_a_rank_that_stays_slow():
    """The balanced layer's loop without MPI: ranks whose seconds grow with their rows, rank 1
    1.5x slower per row. The split leaves the even one and settles where `balanced_split` says."""
    from minidist.parallel.balance import RowBalancer, balanced_split

    per_row, fixed = np.array([0.004, 0.006]), np.array([0.005, 0.005])
    balancer = RowBalancer(16, 2)
    splits = [list(balancer.rows)]
    for _ in range(5):
        splits.append(list(balancer.update(np.array(balancer.rows) * per_row, fixed)))
    assert len(splits) == 6 and splits[0] == [8, 8]
    assert splits[-1] == balanced_split(16, list(per_row), list(fixed)) == [10, 6], splits
    assert all(rows == splits[-1] for rows in splits[1:]), splits  # found at once, then kept


FAST, FIXED = 0.001, 0.005  # seconds per row of an ordinary rank, seconds of every rank's optimizer


def slow_rank_program(slow_rank, seconds_per_row):
    """BalancedDataParallelTrainer where one rank reports itself slow. Each rank's measured
    seconds are replaced by the test's own (its rows x its seconds per row, and FIXED for the
    optimizer), so the split does not depend on how loaded this machine is: the rows it gets,
    step by step."""
    from minidist.comm import get_world
    from minidist.parallel.balance import BalancedDataParallelTrainer

    class ReportedSeconds(BalancedDataParallelTrainer):
        def forward_backward(self, x, y):
            means = super().forward_backward(x, y)
            self.compute_seconds = len(x) * (seconds_per_row if self.world.rank == slow_rank else FAST)
            return means

        def optimizer_step(self, step):
            super().optimizer_step(step)
            self.fixed_seconds = FIXED

    world = get_world()
    with default_dtype("float64"):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        trainer = ReportedSeconds(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, seed=0, group=world)
        rows, losses = [], []
        for s in range(STEPS):
            rows.append(list(trainer.rows))
            losses.append(trainer.step(s)[0])
        return {"rows": rows, "losses": losses, "state": trainer.state_dict()}


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.full)])
def test_balancing_takes_rows_from_a_slow_rank_and_still_equals_serial(serial, n):
    from minidist.parallel.balance import RowBalancer

    results = run(slow_rank_program, n, n - 1, 0.01, timeout=240)  # the last rank: 10 ms a row
    assert len(results) == n
    rows = results[0]["rows"]
    assert len(rows) == STEPS and rows[0] == [BATCH // n] * n, rows  # the first step is even: nothing measured yet
    assert rows[-1][-1] < BATCH // n and min(rows[-1][:-1]) > BATCH // n, rows
    per_row = np.array([FAST] * (n - 1) + [0.01])
    replay = RowBalancer(BATCH, n)  # the same seconds, in this process: the same splits
    expected = [list(replay.rows)] + [list(replay.update(np.array(replay.rows) * per_row, [FIXED] * n))
                                      for _ in range(STEPS - 1)]
    assert rows == expected
    serial_losses, serial_state = serial
    for rank, result in enumerate(results):
        assert result["rows"] == rows  # every rank computed the same split
        np.testing.assert_allclose(result["losses"], serial_losses, rtol=1e-9)
        assert set(result["state"]) == set(serial_state)
        for key, value in serial_state.items():
            assert relative_difference(result["state"][key], value) <= 1e-9, (n, rank, key)


@pytest.mark.full
def test_demo_balance_flag_reports_the_split_of_every_step(tmp_path):
    path = tmp_path / "run.json"
    proc = _demo(2, "--dp", "2", "--balance", "--steps", "4", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(path.read_text())
    assert len(report["rows_per_rank"]) == 4 and report["rows_per_rank"][0] == [8, 8]
    assert all(sum(rows) == 16 and min(rows) >= 1 for rows in report["rows_per_rank"])
    proc = _demo(2, "--tp", "2", "--balance", "--steps", "1")
    assert proc.returncode != 0 and "--balance needs --dp N alone" in proc.stderr


def test_a_proportional_straggler_works_in_proportion_to_its_own_compute():
    from minidist.lab.stragglers import SlowedModel

    def forward(x, y=None):  # 10 ms of "compute" per call
        time.sleep(0.01)
        return x

    slowed = SlowedModel(forward, slowdown=1.0)
    start = time.perf_counter()
    slowed(np.zeros((4, 2)))
    assert time.perf_counter() - start >= 0.01 + 1.0 * 3 * 0.01  # its forward, then 3x it in busy work
    with pytest.raises(ValueError, match="slowdown >= 0"):
        SlowedModel(forward, slowdown=-1)
