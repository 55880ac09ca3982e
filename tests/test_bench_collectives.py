"""`python -m minidist.bench collectives` (chapter 7): the all-reduce algorithms of a size timed side
by side (`compare_many`), so that `auto` can be set against minidist's fastest of the same run
(`auto_against_fastest`), under real mpiexec."""
import json
import os
import subprocess
import sys

from minidist.bench.collectives import auto_against_fastest
from minidist.comm.launch import find_mpiexec


def record(algorithm, nbytes, seconds, collective="all_reduce"):
    return {"collective": collective, "algorithm": algorithm, "bytes": nbytes, "seconds": seconds}


def test_auto_is_set_against_the_fastest_other_algorithm_of_its_size():
    records = [record("ring", 1024, 3e-5), record("shared_memory", 1024, 1e-5), record("auto", 1024, 1.1e-5),
               record("auto+spin", 1024, 0.5e-5), record("ring", 4096, 2e-5), record("auto", 4096, 4e-5),
               record("ring", 1024, 0.1e-5, collective="reduce_scatter"), record("auto", 65536, 1e-4)]
    marked = auto_against_fastest(records)
    assert [(x["bytes"], x["fastest_algorithm"]) for x in marked] == [(1024, "shared_memory"), (4096, "ring")]
    assert abs(marked[0]["of_fastest"] - 1.1) < 1e-12 and abs(marked[1]["of_fastest"] - 2.0) < 1e-12
    assert "of_fastest" not in records[-1]  # nothing else timed at 64 KB


def test_the_run_times_every_algorithm_beside_the_same_mpi(tmp_path):
    out = tmp_path / "coll.json"
    command = [find_mpiexec(), "-n", "2", sys.executable, "-m", "minidist.bench", "collectives", "--sizes", "1K,64K",
               "--algorithms", "ring,shared_memory,auto", "--budget", "0.002", "--rounds", "2", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text()) if r["collective"] == "all_reduce"]
    for nbytes in (1024, 65536):
        size = {r["algorithm"]: r for r in rows if r["bytes"] == nbytes}
        assert set(size) == {"ring", "shared_memory", "auto"}
        assert len({r["mpi_seconds"] for r in size.values()}) == 1  # one MPI figure, timed beside each of them
        fastest = min(("ring", "shared_memory"), key=lambda a: size[a]["seconds"])
        assert size["auto"]["fastest_algorithm"] == fastest
        assert abs(size["auto"]["of_fastest"] - size["auto"]["seconds"] / size[fastest]["seconds"]) < 1e-12
    assert "auto against minidist's fastest algorithm" in proc.stdout
