"""Nothing lost: every strategy's training resumes from a checkpoint bit for bit, under real mpiexec.

For each strategy the demo trains N steps straight; then the same command with --checkpoint is
stopped at step N/2 (MINIDIST_KILL: a rank SIGKILLs itself) and run again, resuming; and a chaos
run kills a seeded random rank at a seeded random step (sometimes inside a save) and is run
again. Losses and final weights equal the uninterrupted run's, float64 with dropout on. Then
the checks before loading: damaged, truncated, cut, edited or foreign checkpoints are refused by
name (another layout is not another run: tests/test_checkpoint_reshard.py resumes across layouts).
"""
import json
import os
import shutil
import subprocess
import sys
import zlib

import numpy as np
import pytest

from minidist.training import checkpoint
from minidist.comm.launch import find_mpiexec

SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
         "--log-every", "-1", "--dtype", "float64", "--steps", "8"]
N, K = 8, 2  # steps, --checkpoint-every
STRATEGIES = {  # name: (ranks, flags)
    "serial": (1, []),
    "dp": (2, ["--dp", "2"]),
    "dp-naive": (2, ["--dp", "2", "--naive-dp"]),
    "dp-balance": (2, ["--dp", "2", "--balance"]),
    "zero1": (2, ["--dp", "2", "--zero", "1"]),
    "zero2": (2, ["--dp", "2", "--zero", "2"]),
    "zero3": (2, ["--dp", "2", "--zero", "3"]),
    "tp": (2, ["--tp", "2"]),
    "tp-sp": (2, ["--tp", "2", "--sequence-parallel"]),
    "mp": (2, ["--pp", "2", "--microbatches", "1"]),
    "pp-gpipe": (2, ["--pp", "2", "--schedule", "gpipe"]),
    "pp-1f1b": (2, ["--pp", "2", "--schedule", "1f1b"]),
    "pp-interleaved": (2, ["--pp", "2", "--schedule", "interleaved", "--n-layer", "4"]),
}


def dropout(name: str) -> list[str]:
    """Dropout on, for every strategy: where the balancer re-splits rows by timing the masks
    follow the rows (core/fused.py dropout_rows), so only rounding differs between splits."""
    return ["--dropout", "0.1"]


def demo(nprocs: int, *flags, kill: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "minidist.demo", *flags]
    if nprocs > 1:
        cmd = [find_mpiexec(), "-n", str(nprocs)] + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("MINIDIST_KILL", None)
    if kill:
        env["MINIDIST_KILL"] = kill
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def results(tmp, tag: str):
    return json.loads((tmp / f"{tag}.json").read_text()), dict(np.load(tmp / f"{tag}.npz"))


def assert_same(name, got_losses, want_losses, got, want):
    assert len(got_losses) == len(want_losses) > 0 and set(got) == set(want)
    if name == "dp-balance":  # the split follows timing: equal up to summation order
        np.testing.assert_allclose(got_losses, want_losses, rtol=1e-10)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-12, err_msg=key)
        return
    assert got_losses == want_losses
    for key in want:
        assert np.array_equal(got[key], want[key]), f"{name}: {key} differs"


def chaos_plan(name: str, nprocs: int) -> str:
    """A seeded random rank and step; on a checkpoint step, inside that step's save (its part
    written, the commit not yet made)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    rank, step = int(rng.integers(nprocs)), int(rng.integers(1, N))
    return f"{rank}:{step}" + (":save" if step % K == 0 else "")


# data parallelism in the quick tier; one strategy of each family in the full tier, the rest extended
FULL = {"serial", "dp-balance", "zero3", "tp-sp", "pp-interleaved"}


def tier(name: str) -> list:
    return [] if name == "dp" else [pytest.mark.full] if name in FULL else [pytest.mark.extended]


@pytest.fixture(scope="module", params=[pytest.param(name, marks=tier(name)) for name in STRATEGIES])
def runs(request, tmp_path_factory):
    """Per strategy: straight; stopped at N/2 and resumed; killed at random and rerun."""
    name = request.param
    nprocs, layout = STRATEGIES[name]
    tmp = tmp_path_factory.mktemp(name)
    flags = SMALL + dropout(name) + layout

    def outputs(tag):
        return ["--json", str(tmp / f"{tag}.json"), "--save", str(tmp / f"{tag}.npz")]

    straight = demo(nprocs, *flags, *outputs("straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    command = flags + ["--checkpoint", str(tmp / "ckpt"), "--checkpoint-every", str(K)] + outputs("resumed")
    stopped = demo(nprocs, *command, kill=f"0:{N // 2}")
    resumed = demo(nprocs, *command)
    plan = chaos_plan(name, nprocs)
    chaos_command = [str(tmp / "chaos") if a == str(tmp / "ckpt") else a for a in command]
    chaos_command = [a.replace("resumed.", "chaos.") for a in chaos_command]
    killed = demo(nprocs, *chaos_command, kill=plan)
    rerun = demo(nprocs, *chaos_command)
    return name, tmp, straight, stopped, resumed, plan, killed, rerun


def test_a_stopped_run_resumes_bit_for_bit(runs):
    name, tmp, _, stopped, resumed, *_ = runs
    assert stopped.returncode != 0  # killed at step N/2, after its checkpoint of step N/2
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {tmp / 'ckpt'}: step {N // 2} of {N}" in resumed.stdout
    want, want_weights = results(tmp, "straight")
    got, got_weights = results(tmp, "resumed")
    assert want["first_step"] == 0 and got["first_step"] == N // 2
    assert_same(name, got["losses"], want["losses"][N // 2:], got_weights, want_weights)
    assert [p.name for p in (tmp / "ckpt").iterdir()] == [checkpoint.step_name(N - K)]  # older ones deleted


def test_chaos_a_random_rank_killed_at_a_random_step_loses_nothing(runs):
    name, tmp, _, _, _, plan, killed, rerun = runs
    rank, step = (int(x) for x in plan.split(":")[:2])
    assert killed.returncode != 0, plan
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # the newest complete checkpoint before the kill: a save killed half-way does not count
    newest = (step - 1 if plan.endswith("save") else step) // K * K
    want, want_weights = results(tmp, "straight")
    got, got_weights = results(tmp, "chaos")
    assert got["first_step"] == newest, (plan, rerun.stdout)
    assert_same(name, got["losses"], want["losses"][newest:], got_weights, want_weights)


# ----------------------------------------------------------------------------- validation


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank dp checkpoint of step 4 (the run killed before step 5), and the straight weights."""
    tmp = tmp_path_factory.mktemp("validation")
    flags = SMALL + ["--dropout", "0.1", "--dp", "2"]
    assert demo(2, *flags, "--save", str(tmp / "straight.npz")).returncode == 0
    killed = demo(2, *flags, "--checkpoint", str(tmp / "ckpt"), "--checkpoint-every", "2", kill="1:5")
    assert killed.returncode != 0 and (tmp / "ckpt" / "step-000004" / "manifest.json").exists()
    return tmp, flags


def resume_copy(saved, tmp_path, damage=None, *extra):
    """Copy the checkpoint, damage the copy, run the same command on it."""
    root, flags = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    step = tmp_path / "ckpt" / "step-000004"
    if damage:
        damage(step)
    return demo(2, *flags, "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
                "--save", str(tmp_path / "w.npz"), *extra)


def one_line_error(proc) -> str:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.full
def test_a_half_written_newer_checkpoint_is_ignored(saved, tmp_path):
    def half_written(step):  # a save of step 6 that died before its commit
        partial = step.parent / "step-000006.partial"
        shutil.copytree(step, partial)
        (partial / "manifest.json").unlink()
        part = partial / checkpoint.part_name(1, 2)
        part.write_bytes(part.read_bytes()[:100])

    proc = resume_copy(saved, tmp_path, half_written)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 4 of 8" in proc.stdout
    want, got = dict(np.load(saved[0] / "straight.npz")), dict(np.load(tmp_path / "w.npz"))
    assert all(np.array_equal(got[k], want[k]) for k in want) and set(got) == set(want)


@pytest.mark.full
def test_a_truncated_file_is_refused_by_name(saved, tmp_path):
    def truncate(step):
        part = step / checkpoint.part_name(1, 2)
        part.write_bytes(part.read_bytes()[:-100])

    line = one_line_error(resume_copy(saved, tmp_path, truncate))
    assert checkpoint.part_name(1, 2) in line and "truncated" in line


@pytest.mark.full
def test_corrupted_bytes_are_refused_by_name(saved, tmp_path):
    def flip(step):
        part = step / checkpoint.part_name(0, 2)
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))

    line = one_line_error(resume_copy(saved, tmp_path, flip))
    assert checkpoint.part_name(0, 2) in line and "checksum mismatch" in line


@pytest.mark.full
@pytest.mark.parametrize("manifest_agrees", [False, True])
def test_arrays_cut_to_size_1_are_refused(saved, tmp_path, manifest_agrees):
    """Cut arrays would broadcast into the weights: refused by the part's listed shapes, and, where
    the part's listing was rewritten to match, by the place of each piece in its global array.
    (Rank 0's part: data-parallel copies are written once, by the lowest rank.)"""
    def cut(step):
        part = step / checkpoint.part_name(0, 2)
        state = {k: (v.ravel()[:1] if not checkpoint.LOCAL.match(k) and v.ndim else v)
                 for k, v in np.load(part).items()}
        data = checkpoint.npz_bytes(state)
        part.write_bytes(data)
        manifest = json.loads((step / "manifest.json").read_text())
        entry = manifest["parts"][0]
        arrays = checkpoint.shapes(state) if manifest_agrees else entry["arrays"]
        entry.update(checkpoint.describe(data, state), arrays=arrays)
        (step / "manifest.json").write_text(json.dumps(manifest))

    line = one_line_error(resume_copy(saved, tmp_path, cut))
    assert checkpoint.part_name(0, 2) in line and "shape (1,)" in line


@pytest.mark.full
def test_a_damaged_manifest_is_refused_by_name(saved, tmp_path):
    line = one_line_error(resume_copy(saved, tmp_path, lambda step: (step / "manifest.json").write_text('{"form')))
    assert "manifest.json" in line and "not valid JSON" in line


@pytest.mark.full
@pytest.mark.parametrize("extra, difference", [
    (["--lr", "0.001"], "lr 0.003 there, 0.001 here"),
    (["--steps", "10"], "steps 8 there, 10 here"),
    (["--n-embd", "64"], "config.n_embd 32 there, 64 here"),
    (["--dtype", "float32"], "dtype float64 there, float32 here"),
])
def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(saved, tmp_path, extra, difference):
    line = one_line_error(resume_copy(saved, tmp_path, None, *extra))
    assert "belongs to another run" in line and difference in line


@pytest.mark.full
@pytest.mark.parametrize("edit, words", [
    (lambda arrays: arrays["param.wte.weight"]["pieces"][0].update(box=[[0, 999], [0, 32]]), "is not inside shape"),
    (lambda arrays: arrays["step"]["pieces"].append(dict(arrays["step"]["pieces"][0])), "overlaps another piece"),
    (lambda arrays: arrays.pop("param.wte.weight"), "has no array param.wte.weight"),
])
def test_an_edited_manifest_is_refused_in_one_line(saved, tmp_path, edit, words):
    """A piece outside its array, two pieces of one place, an array gone: refused on every rank,
    naming the manifest, before the trainer runs a step."""
    def edited(step):
        manifest = json.loads((step / "manifest.json").read_text())
        edit(manifest["arrays"])
        (step / "manifest.json").write_text(json.dumps(manifest))

    line = one_line_error(resume_copy(saved, tmp_path, edited))
    assert "manifest.json" in line and words in line
