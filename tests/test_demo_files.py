"""Nothing lost on the way out: the demo checks where its results go before it trains, and writes
them whole, with the user's permissions."""
import os
import subprocess
import sys
import time

import pytest

from minidist.comm.launch import find_mpiexec

SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
         "--log-every", "-1"]


def demo(*flags, nprocs=None):
    cmd = [sys.executable, "-m", "minidist.demo", *flags]
    if nprocs:
        cmd = [find_mpiexec(), "-n", str(nprocs)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("flag", ["--json", "--save"])
def test_a_result_path_that_cannot_be_written_fails_before_training(tmp_path, flag):
    missing = tmp_path / "no" / "such" / "dir" / "out.file"
    start = time.perf_counter()
    proc = demo("--steps", "100000", *SMALL, flag, str(missing))  # would train for minutes
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{flag} {missing}: the directory" in proc.stderr and "does not exist" in proc.stderr
    assert time.perf_counter() - start < 60


def test_save_with_the_tour_is_refused_in_one_line(tmp_path):
    proc = demo("--steps", "1", *SMALL, "--save", str(tmp_path / "w.npz"), nprocs=2)
    assert proc.returncode != 0
    assert "--save needs one layout" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_results_are_written_whole_with_the_users_permissions(tmp_path):
    out, weights = tmp_path / "run.json", tmp_path / "w.npz"
    proc = demo("--steps", "2", *SMALL, "--json", str(out), "--save", str(weights))
    assert proc.returncode == 0, proc.stderr
    umask = os.umask(0)
    os.umask(umask)
    for path in (out, weights):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, oct(path.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "w.npz"]  # no temporary left
