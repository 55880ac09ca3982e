"""A job that survives a lost rank: `python -m minidist.launch` (chapter 11, fault tolerance).

Quick tier: the agent's command-line mistakes end in one line, exit status 2, before any rank
starts. Full tier, under real mpiexec: a seeded random rank is SIGKILLed (MINIDIST_KILL) at a
seeded random step of a dp4 run; the agent restarts it on 2 ranks (--shrink: dp2, accumulation
2), and the final weights equal the uninterrupted 4-rank run's to 1e-9; then once more on the
same 4 ranks, bit for bit. The agent's lines say what died, what was lost and what resumed.
With --restarts 0 the first failure stops the agent in one line, with the job's exit status.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import relative_difference
from test_checkpoint import (
    demo,  # the demo under mpiexec (timeout 120 s), with MINIDIST_KILL
)

N, K = 8, 2  # steps, --checkpoint-every
SMALL = ["--steps", str(N), "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
         "--batch-size", "8", "--dtype", "float64", "--log-every", "-1"]
SEED = 7  # the chaos plan's; printed with the plan


def launch(*words: str, kill: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m minidist.launch WORDS`, MINIDIST_KILL set only if `kill`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("MINIDIST_KILL", None)
    if kill:
        env["MINIDIST_KILL"] = kill
    return subprocess.run([sys.executable, "-m", "minidist.launch", *words], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def agent_lines(proc) -> list[str]:
    return [line.removeprefix("[launch] ") for line in proc.stderr.splitlines() if line.startswith("[launch] ")]


# ----------------------------------------------------------------------------- the command line (quick)

DEMO = [sys.executable, "-m", "minidist.demo", *SMALL]


@pytest.mark.parametrize("words, says", [
    (["-n", "2", *DEMO, "--dp", "2"], "give the command each rank runs after --"),
    (["-n", "2", "--"], "nothing after --"),
    (["-n", "0", "--", *DEMO, "--dp", "2"], "argument -n: expected an integer >= 1, got '0'"),
    (["--restarts", "2", "-n", "2", "--", *DEMO, "--dp", "2"],
     "--restarts 2 needs --checkpoint DIR in the command: without checkpoints there is nothing to resume from"),
    (["--restarts", "1", "--shrink", "-n", "2", "--", *DEMO, "--tp", "2", "--checkpoint", "ck"],
     "layout tp2 on 2 ranks cannot shrink: dp=1: no data-parallel replica to drop"),
    (["--restarts", "1", "-n", "2", "--", *DEMO, "--dp", "4", "--checkpoint", "ck"],
     "needs 4 ranks, but this job has 2"),
], ids=["no --", "nothing after --", "-n 0", "restarts without checkpoint", "cannot shrink", "wrong world"])
def test_a_mistake_is_one_line_before_any_rank(words, says, tmp_path):
    proc = launch(*words, timeout=30)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert lines[0].startswith("minidist.launch: error: ") and says in lines[0], lines[0]
    assert not (tmp_path / "ck").exists() and proc.stdout == ""


# ----------------------------------------------------------------------------- lost ranks (full)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted dp4 run's final weights."""
    tmp = tmp_path_factory.mktemp("launch")
    proc = demo(4, *SMALL, "--dp", "4", "--save", str(tmp / "straight.npz"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(tmp / "straight.npz"))


def killed_run(tmp_path, kill: str, *agent: str) -> tuple[subprocess.CompletedProcess, dict]:
    """A dp4 run under the agent, MINIDIST_KILL=kill; its output and final weights."""
    command = [*DEMO, "--dp", "4", "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", str(K),
               "--save", str(tmp_path / "final.npz")]
    proc = launch("--restarts", "1", *agent, "-n", "4", "--", *command, kill=kill)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, dict(np.load(tmp_path / "final.npz"))


def check_story(proc, rank: int, step: int, ckpt, resumed: str) -> None:
    """The agent's lines: what died, what was lost, that the fault was not injected again, what resumed."""
    lines = agent_lines(proc)
    saved = step - step % K  # MINIDIST_KILL fires before step `step`, after that step's checkpoint
    where = (f"the newest complete checkpoint is step {saved} ({ckpt / f'step-{saved:06d}'})" if saved
             else "there is no complete checkpoint yet")
    expected = [(f"lost: the attempt had done {step} step{'s' * (step != 1)} of {N}; {where}: "
                 + (f"{step - saved} step{'s' * (step - saved != 1)} lost" if step > saved else "nothing lost")),
                f"MINIDIST_KILL={rank}:{step} applied to the first attempt only: removed",
                f"resuming: step {saved} of {N} {resumed}", "done: attempt 2 finished"]
    for text in expected:
        assert any(text in line for line in lines), (text, lines)
    died = next(line for line in lines if line.startswith("attempt 1 failed: "))
    # the injected fault names its rank before it dies: on a busy machine the watch alone can see
    # another rank, killed by mpiexec, end first
    assert f"rank {rank} (pid " in died and "was killed by signal 9 (SIGKILL)" in died, died
    if saved:  # the demo's own word that it resumed
        assert f"resuming from {ckpt}: step {saved} of {N}" in proc.stdout


@pytest.mark.full
def test_a_lost_rank_resumes_on_fewer_ranks_as_the_same_run(straight, tmp_path):
    """dp4 loses a rank; the agent restarts dp2 with accumulation 2: the same global batch per
    step, the same weights as the uninterrupted dp4 run (float64, to 1e-9: summation order)."""
    rng = np.random.default_rng(SEED)
    rank, step = int(rng.integers(4)), int(rng.integers(1, N))
    print(f"chaos plan (seed {SEED}): rank {rank} killed before step {step}")
    proc, final = killed_run(tmp_path, f"{rank}:{step}", "--shrink")
    check_story(proc, rank, step, tmp_path / "ck", "on 2 ranks (was 4), layout dp2-m2, the global batch unchanged")
    assert set(final) == set(straight)
    for name in straight:
        assert relative_difference(final[name], straight[name]) < 1e-9, name


@pytest.mark.full
def test_a_lost_rank_resumes_on_the_same_ranks_bit_for_bit(straight, tmp_path):
    rank, step = 2, 5
    proc, final = killed_run(tmp_path, f"{rank}:{step}")
    check_story(proc, rank, step, tmp_path / "ck", "on the same 4 ranks, layout dp4")
    assert set(final) == set(straight)
    for name in straight:
        assert np.array_equal(final[name], straight[name]), name


@pytest.mark.full
def test_restarts_used_up_stop_in_one_line(tmp_path):
    """--restarts 0: the first failure is the last; the agent's exit status is the job's."""
    command = [*DEMO, "--dp", "2", "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", str(K)]
    proc = launch("-n", "2", "--", *command, kill="1:3")
    last = agent_lines(proc)[-1]
    assert last == f"stopped after 1 failed attempt (--restarts 0): last exit status {proc.returncode}", last
    assert proc.returncode != 0 and not any("resuming" in line for line in agent_lines(proc))
