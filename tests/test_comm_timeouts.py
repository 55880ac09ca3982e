"""The fault model's edges (chapter 2): a timeout names the time really waited, also for a wait
queued behind an asynchronous all-reduce on the shared-memory window (collectives._run_in_order,
shared_memory.after); an aborted job removes the shared-memory files it mapped (faults.abort)."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from minidist.comm.launch import find_mpiexec, run

TIMEOUT = 1.0


def queued_behind_an_async_all_reduce(wait_first: int):
    """Rank 0 posts two asynchronous all-reduces that rank 1 never joins, then waits on one."""
    import minidist.comm as dist
    from minidist.comm.p2p import CommTimeout, set_wait_policy

    world = dist.get_world()
    x = np.ones(1000)
    dist.all_reduce(x, algorithm="shared_memory")  # both ranks: the window exists
    if world.rank != 0:
        return None  # never comes to the next two calls
    set_wait_policy(timeout=TIMEOUT)
    with dist.unchecked():  # no consistency check: it would wait for rank 1 before the call
        works = [dist.all_reduce(np.ones(1000), algorithm="shared_memory", async_op=True) for _ in range(2)]
    try:
        works[wait_first].wait()
    except CommTimeout as error:
        return str(error)
    return "no timeout"


@pytest.mark.full  # the collectives' tests check a timeout's words in the quick tier
@pytest.mark.parametrize("wait_first", [0, 1], ids=["the-first-call", "the-call-queued-behind-it"])
def test_a_timeout_reports_the_seconds_really_waited(wait_first):
    message = run(queued_behind_an_async_all_reduce, 2, wait_first, timeout=60)[0]
    found = re.search(r"timed out after ([0-9.]+) s in the shared-memory all_reduce", message)
    assert found, message
    assert TIMEOUT - 0.05 <= float(found.group(1)) < TIMEOUT + 5, message  # not 0.0: the real wait
    assert "waiting for rank(s) [1]" in message, message


def test_an_aborted_job_removes_the_shared_memory_it_mapped(tmp_path):
    """faults.abort removes the names of the MPICH segments its rank mapped (faults.py)."""
    listing = tmp_path / "segments.txt"
    code = ("import numpy as np; import minidist.comm as dist; from minidist.comm import faults; faults.install()\n"
            "dist.all_reduce(np.ones(10), algorithm='shared_memory')\n"
            "if dist.get_rank() == 1:\n"
            f"    open({str(listing)!r}, 'w').write('\\n'.join(faults.mapped_shared_memory()))\n"
            "    raise RuntimeError('this rank fails')\n"
            "import time; time.sleep(30)\n")
    proc = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "this rank fails" in proc.stdout + proc.stderr
    segments = listing.read_text().split()
    assert len(segments) >= 1 and all(s.startswith("/dev/shm/mpich_shm_") for s in segments), segments
    assert [s for s in segments if os.path.exists(s)] == []
