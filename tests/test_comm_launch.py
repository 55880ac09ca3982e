"""The launcher and the fault model: results come back, failures end the job promptly."""
import subprocess
import sys
import time

import pytest

from minidist.comm.launch import LaunchTimeout, RankError, find_mpiexec, run


def rank_times(x):
    from mpi4py import MPI

    print(f"hello from {MPI.COMM_WORLD.rank}")
    return MPI.COMM_WORLD.rank * x


def explode_while_others_wait():
    import numpy as np
    from mpi4py import MPI

    import minidist.comm as dist

    if MPI.COMM_WORLD.rank == 1:
        raise RuntimeError("rank 1 exploded")
    dist.recv(np.zeros(3), src=1)  # would wait for the full timeout without the abort


def wait_for_a_message_never_sent():
    import numpy as np
    from mpi4py import MPI

    import minidist.comm as dist

    if MPI.COMM_WORLD.rank == 0:
        dist.recv(np.zeros(3), src=1, tag=42)
    else:
        time.sleep(60)


def sleep_forever():
    time.sleep(60)


def node_all_reduce():
    """Each node's ranks all-reduce among themselves through their shared window (what "auto"
    takes there for all but two ranks' small arrays)."""
    import numpy as np
    from mpi4py import MPI

    import minidist.comm as dist

    world = dist.get_world()
    node = world.split(MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).allreduce(world.rank, op=MPI.MIN))
    x = np.arange(4.0) + world.rank
    dist.all_reduce(x, group=node, algorithm="shared_memory")
    return x.tolist(), dist.choose_all_reduce("auto", node, 1 << 20)


@pytest.mark.full
def test_shared_memory_job_on_two_nodes_over_tcp_exits_cleanly():
    """The shared windows are freed before MPI_Finalize: left open, finalizing the TCP transport
    fails and the job exits non-zero although its results are right (`run` raises then)."""
    results = run(node_all_reduce, 4, nodes=2, tcp=True, timeout=60)
    assert results == [([1.0, 3.0, 5.0, 7.0], "shared_memory")] * 2 + [([5.0, 7.0, 9.0, 11.0], "shared_memory")] * 2


def test_results_come_back_in_rank_order(capsys):
    assert run(rank_times, 3, 10, timeout=60) == [0, 10, 20]
    out = capsys.readouterr().out  # each rank's output printed whole, prefixed
    assert out.splitlines() == [f"[rank {r}] hello from {r}" for r in range(3)]


def test_module_function_string_and_notebook_style_functions():
    assert run("minidist.comm.world:global_rank", 2, timeout=60) == [0, 1]

    def local_program(k):  # like a function defined in a notebook: sent as source
        import numpy as np

        import minidist.comm as dist

        return float(dist.all_reduce(np.full(3, k * (dist.get_rank() + 1.0)))[0])

    assert run(local_program, 3, 2.0, timeout=60) == [12.0, 12.0, 12.0]


def test_exception_on_one_rank_aborts_promptly_with_traceback():
    start = time.perf_counter()
    with pytest.raises(RankError) as info:
        run(explode_while_others_wait, 3, timeout=120)
    elapsed = time.perf_counter() - start
    assert elapsed < 20, f"took {elapsed:.1f} s: the abort did not end the waiting ranks"
    msg = str(info.value)
    assert "[rank 1] RuntimeError: rank 1 exploded" in msg
    assert "1 rank(s) raised" in msg


@pytest.mark.full
def test_wait_timeout_names_rank_peer_tag():
    with pytest.raises(RankError) as info:
        run(wait_for_a_message_never_sent, 2, timeout=60, env={"MINIDIST_TIMEOUT": "1.5"})
    msg = str(info.value)
    assert "CommTimeout: rank 0 of 2 (world rank 0) timed out after 1.5 s" in msg
    assert "recv of 24 bytes from rank 1, tag 42" in msg


@pytest.mark.full
def test_launch_timeout_kills_the_job():
    start = time.perf_counter()
    with pytest.raises(LaunchTimeout):
        run(sleep_forever, 2, timeout=3)
    assert time.perf_counter() - start < 10


def mpiexec_python(code, n=2, timeout=60):
    return subprocess.run([find_mpiexec(), "-n", str(n), sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.full
def test_uncaught_exception_under_plain_mpiexec_aborts_with_one_traceback():
    # What the demo and the benchmarks do: faults.install(), then MPI's own blocking Recv on
    # the other ranks, which would hang forever (spinning) without the abort.
    code = ("import numpy as np; from mpi4py import MPI; from minidist.comm import faults; faults.install()\n"
            "if MPI.COMM_WORLD.rank == 1: raise ValueError('bad thing on rank 1')\n"
            "MPI.COMM_WORLD.Recv(np.zeros(1), source=1)\n")
    start = time.perf_counter()
    proc = mpiexec_python(code, n=3)
    assert time.perf_counter() - start < 20
    assert proc.returncode != 0
    assert proc.stderr.count("[rank 1] ValueError: bad thing on rank 1") == 1


def test_fail_is_one_line_and_nonzero_exit():
    proc = mpiexec_python("from minidist.comm import faults; faults.fail('--dp 3 does not divide 4 ranks')")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[0] == "error: --dp 3 does not divide 4 ranks"
    assert proc.stderr.count("error:") == 1
