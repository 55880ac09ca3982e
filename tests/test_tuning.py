"""The all-reduce tuning table (minidist/comm/tuning.py, chapter 7): `auto` takes the algorithm the
table measured fastest, under real mpiexec, and the result still equals MPI's Allreduce."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.comm import tuning
from minidist.comm.collectives import ALL_REDUCE
from minidist.comm.launch import find_mpiexec, run


def table(path, ranks=2, rows=((1024, "ring"), (65536, "naive")), machines=1):
    data = {"format": tuning.FORMAT, "tables": [{"ranks": ranks, "machines": machines, "mpi": "",
                                                "sizes": [{"bytes": b, "algorithm": a} for b, a in rows]}]}
    path.write_text(json.dumps(data))
    return str(path)


def test_the_entry_of_the_largest_measured_size_not_above_the_array(tmp_path):
    path = table(tmp_path / "t.json", rows=((1024, "recursive_doubling"), (16384, "ring"), (1 << 20, "naive")))
    tuning._read.cache_clear()
    expected = {4: "recursive_doubling", 1024: "recursive_doubling", 16383: "recursive_doubling",
                16384: "ring", 500000: "ring", 1 << 20: "naive", 1 << 30: "naive"}
    for nbytes, algorithm in expected.items():
        assert tuning.lookup(2, 1, nbytes, path) == algorithm, nbytes
    assert tuning.lookup(4, 1, 1024, path) is None  # no table for 4 ranks: the built-in choice
    assert tuning.lookup(2, 2, 1024, path) is None


def test_write_keeps_the_other_groups_tables(tmp_path):
    path = str(tmp_path / "t.json")
    tuning.write(path, 2, 1, [{"bytes": 1024, "algorithm": "ring", "seconds": {"ring": 1e-5}}])
    tuning.write(path, 4, 1, [{"bytes": 1024, "algorithm": "tree", "seconds": {"tree": 2e-5}}])
    tuning.write(path, 2, 1, [{"bytes": 1024, "algorithm": "naive", "seconds": {"naive": 1e-5}}])
    data = json.load(open(path))
    assert [(t["ranks"], t["sizes"][0]["algorithm"]) for t in data["tables"]] == [(2, "naive"), (4, "tree")]
    assert tuning.lookup(2, 1, 4096, path) == "naive" and tuning.lookup(4, 1, 4096, path) == "tree"
    assert os.listdir(tmp_path) == ["t.json"]  # written through a temporary file, renamed


@pytest.mark.parametrize("content, why", [
    ("{", "is not JSON"),
    ('{"tables": []}', "is not a tuning table"),
    (json.dumps({"format": tuning.FORMAT, "tables": [{"ranks": 2}]}), "needs ranks, machines and sizes"),
    (json.dumps({"format": tuning.FORMAT, "tables": [{"ranks": 2, "machines": 1,
                                                      "sizes": [{"bytes": 4, "algorithm": "magic"}]}]}),
     "unknown algorithms ['magic']"),
])
def test_an_unusable_table_is_named_with_the_reason(tmp_path, content, why):
    path = tmp_path / "bad.json"
    path.write_text(content)
    tuning._read.cache_clear()
    with pytest.raises(tuning.TuningError, match="MINIDIST_TUNING=.*bad.json") as error:
        tuning.lookup(2, 1, 1024, str(path), known=tuple(ALL_REDUCE))
    assert why in str(error.value)
    with pytest.raises(tuning.TuningError, match="cannot be read"):
        tuning.lookup(2, 1, 1024, str(tmp_path / "missing.json"))


def tuned_rank_program(sizes):
    from mpi4py import MPI

    from minidist.comm import all_reduce, choose_all_reduce, get_world, traffic

    world, out = get_world(), {}
    for nbytes in sizes:
        x = np.random.default_rng(world.rank).standard_normal(nbytes // 4).astype(np.float32)
        expected = np.empty_like(x)
        MPI.COMM_WORLD.Allreduce(x, expected, op=MPI.SUM)
        traffic.reset()
        all_reduce(x)  # algorithm="auto"
        kinds = sorted(k for k in traffic.snapshot() if k.startswith("all_reduce"))
        out[nbytes] = {"chosen": choose_all_reduce("auto", world, nbytes), "kinds": kinds,
                       "error": float(np.max(np.abs(x - expected)))}
    return out


def test_auto_takes_the_tables_choice_and_equals_mpi(tmp_path, monkeypatch):
    path = table(tmp_path / "t.json", rows=((4, "recursive_doubling"), (16384, "ring")))
    monkeypatch.setenv("MINIDIST_TUNING", path)
    sizes = [1024, 16384, 1 << 20]
    for rank in run(tuned_rank_program, 2, sizes, timeout=120):
        assert {n: r["chosen"] for n, r in rank.items()} == {1024: "recursive_doubling", 16384: "ring",
                                                              1 << 20: "ring"}
        assert rank[1024]["kinds"] == ["all_reduce.recursive_doubling"] and rank[1 << 20]["kinds"] == ["all_reduce.ring"]
        assert all(r["error"] < 1e-5 for r in rank.values())
    monkeypatch.delenv("MINIDIST_TUNING")
    for rank in run(tuned_rank_program, 2, [1024, 1 << 20], timeout=120):  # without it: the built-in choice
        assert rank[1024]["chosen"] == rank[1 << 20]["chosen"] == "shared_memory"
        assert all(r["error"] < 1e-5 for r in rank.values())


def test_tune_writes_a_table_auto_then_follows(tmp_path):
    path = tmp_path / "tuning.json"
    command = [find_mpiexec(), "-n", "2", sys.executable, "-m", "minidist.bench", "collectives",
               "--tune", str(path), "--sizes", "1K,64K", "--budget", "0.002", "--rounds", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["format"] == tuning.FORMAT and [t["ranks"] for t in data["tables"]] == [2]
    rows = data["tables"][0]["sizes"]
    assert [row["bytes"] for row in rows] == [1024, 65536]
    for row in rows:  # the fastest of those timed, every algorithm timed
        assert row["algorithm"] == min(row["seconds"], key=row["seconds"].get)
        assert set(row["seconds"]) == {"naive", "tree", "recursive_doubling", "halving_doubling", "ring",
                                       "shared_memory"}
    assert "MINIDIST_TUNING=" in proc.stdout and "fastest" in proc.stdout
    # the window's piece, timed first: half to 16 times the built-in 512 KB on 1, 4 and 16 MB arrays;
    # chosen for the least time relative to the best piece at each size
    table = data["tables"][0]
    seconds = {int(p): {int(n): t for n, t in times.items()} for p, times in table["piece_seconds"].items()}
    assert sorted(seconds) == [256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]
    assert all(sorted(times) == [1 << 20, 4 << 20, 16 << 20] for times in seconds.values())
    best = {n: min(times[n] for times in seconds.values()) for n in (1 << 20, 4 << 20, 16 << 20)}
    assert table["piece_bytes"] == min(seconds, key=lambda p: sum(seconds[p][n] / best[n] for n in best))
    assert "shared-memory piece on 2 ranks" in proc.stdout and "<- chosen" in proc.stdout


def test_the_table_may_carry_the_windows_measured_piece(tmp_path):
    """`piece_bytes`: the shared-memory all-reduce's piece `bench collectives --tune` measured fastest."""
    path = str(tmp_path / "t.json")
    tuning.write(path, 2, 1, [{"bytes": 1024, "algorithm": "ring", "seconds": {"ring": 1e-5}}],
                 piece=1 << 20, piece_seconds={"262144": {"1048576": 3e-4}, "1048576": {"1048576": 2e-4}})
    tuning.write(path, 4, 1, [{"bytes": 1024, "algorithm": "tree", "seconds": {"tree": 2e-5}}])
    assert tuning.piece(2, 1, path) == 1 << 20
    assert tuning.piece(4, 1, path) is None and tuning.piece(3, 1, path) is None  # the built-in piece
    assert json.load(open(path))["tables"][0]["piece_seconds"]["1048576"] == {"1048576": 2e-4}


@pytest.mark.parametrize("piece", [1000, 1024, -65536, "1M", True, 1 << 31])
def test_a_piece_the_window_cannot_take_is_refused(tmp_path, piece):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "tables": [
        {"ranks": 2, "machines": 1, "piece_bytes": piece, "sizes": [{"bytes": 4, "algorithm": "ring"}]}]}))
    tuning._read.cache_clear()
    with pytest.raises(tuning.TuningError, match=r"piece_bytes must be a multiple of 64 from 65536"):
        tuning.piece(2, 1, str(path))


def piece_rank_program(nbytes):
    from mpi4py import MPI

    from minidist.comm import all_reduce, get_world, shared_memory

    world = get_world()
    x = np.random.default_rng(world.rank).standard_normal(nbytes // 4).astype(np.float32)
    expected = np.empty_like(x)
    MPI.COMM_WORLD.Allreduce(x, expected, op=MPI.SUM)
    all_reduce(x, algorithm="shared_memory")
    window = shared_memory.window(world)
    before = window.calls
    all_reduce(x, algorithm="shared_memory")  # once more, to count its pieces
    return {"piece": window.piece, "pieces": window.calls - before, "error": float(np.max(np.abs(x - 2 * expected)))}


@pytest.mark.parametrize("piece", [None, 128 << 10, 4 << 20])
def test_the_window_goes_by_the_tables_piece_and_still_equals_mpi(tmp_path, monkeypatch, piece):
    """2 ranks, a 3 MB array: the built-in 512 KB piece (6 pieces), the table's 128 KB (24) or 4 MB (1)."""
    rows = [{"bytes": 4, "algorithm": "shared_memory", "seconds": {"shared_memory": 1e-5}}]
    path = str(tmp_path / "t.json")
    tuning.write(path, 2, 1, rows, piece=piece)
    monkeypatch.setenv("MINIDIST_TUNING", path)
    nbytes = 3 << 20
    expected_piece = piece or 512 << 10
    for rank in run(piece_rank_program, 2, nbytes, timeout=120):
        assert rank["piece"] == expected_piece and rank["pieces"] == -(-nbytes // expected_piece)
        assert rank["error"] < 1e-4
