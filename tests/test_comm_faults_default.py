"""Chapter 2's promise without asking for it: a program that communicates through minidist but
never calls `faults.install()` still ends the whole job when one rank raises, under real mpiexec."""
import os
import subprocess
import sys
import textwrap
import time

from minidist.comm.launch import find_mpiexec

PROGRAM = textwrap.dedent("""
    import numpy as np
    import minidist.comm as dist

    world = dist.get_world()
    if world.rank == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(np.ones(4))  # the others wait for rank 1, which never comes
""")


def test_a_rank_that_raises_ends_the_job_without_faults_install(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(PROGRAM)
    start = time.perf_counter()
    proc = subprocess.run([find_mpiexec(), "-n", "3", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, MINIDIST_TIMEOUT="100"))
    elapsed = time.perf_counter() - start
    assert proc.returncode != 0
    assert "[rank 1] RuntimeError: rank 1 gives up" in proc.stderr, proc.stderr
    assert elapsed < 30, f"the job took {elapsed:.0f} s: the waiting ranks were not ended"

