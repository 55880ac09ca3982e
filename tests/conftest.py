"""What every strategy's test shares: the serial reference run, and how to compare with it; and
the two test tiers.

Principle 1 of the book: every parallel layout reproduces the single-process run. Each
strategy's test file runs its layouts under real mpiexec and compares them here, with the
serial run made by `serial_run` and differences measured by `relative_difference`.

The tiers. Plain `pytest` runs the quick tier, for a learner at work: the unit tests and at
least one multi-rank run of every strategy under real mpiexec, a few minutes on 2 cores.
`pytest --full` runs everything, as CI does: every other layout (more ranks, several nodes,
TCP), the slow end-to-end runs, and every notebook. The quick tier deselects (it does not skip)
the notebooks and whatever is marked `@pytest.mark.full`, a test or one of its parameters
(`pytest.param(..., marks=pytest.mark.full)`, `layout(..., full=True)`). A file runs alone
either way: `pytest tests/test_x.py` runs its quick tests, `pytest --full tests/test_x.py` all.
A third set, the extended tier, is left out of both: more cases of what the full tier already
checks, minutes of them (every wrong solution the course ships, every framework config of the
corpus run scaled down): `pytest --full --extended`, marked `@pytest.mark.extended`.
"""
from __future__ import annotations

import functools
import numpy as np
import pytest

from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.core.tensor import default_dtype
from minidist.training.train import OptimSettings, SerialTrainer


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="the full tier: every test and every notebook, as CI runs them (default: the quick tier)")
    parser.addoption("--extended", action="store_true", default=False,
                     help="with --full, also the extended tier: more cases of what the full tier checks "
                          "(every wrong solution of the course, every corpus config run), minutes more")


def pytest_collection_modifyitems(config, items):
    def left_out(item):
        if item.get_closest_marker("extended"):
            return not (config.getoption("--full") and config.getoption("--extended"))
        return not config.getoption("--full") and (item.path.suffix == ".ipynb" or item.get_closest_marker("full"))

    deselected = [item for item in items if left_out(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not left_out(item)]


def pytest_report_collectionfinish(config):
    if config.getoption("--full"):
        return "tier: full (every test and every notebook, as CI runs them); plain `pytest` runs the quick tier"
    return "tier: quick (no notebooks, one multi-rank run per strategy); `pytest --full` runs everything, as CI does"


def serial_run(config: dict, settings: dict, batch: int, steps: int, seed: int = 0, dtype: str = "float64",
               **config_changes) -> dict:
    """The serial reference: `steps` steps of SerialTrainer on the sort task, in float64.

    Returns {"steps": [(loss, accuracy), ...], "losses": [...], "initial": state_dict,
    "state": state_dict}; `config_changes` override fields of `config` (e.g. tie_weights=False)."""
    config = GPTConfig(**{**config, **config_changes})
    with default_dtype(dtype):
        task = make_task("sort", config.block_size, seed=seed)
        trainer = SerialTrainer(config, OptimSettings(**settings), task, batch, seed=seed)
        initial = trainer.state_dict()
        results = [trainer.step(s) for s in range(steps)]
    return {"steps": results, "losses": [loss for loss, _ in results], "initial": initial,
            "state": trainer.state_dict()}


def relative_difference(a, b) -> float:
    """max |a - b| relative to max |b|, or to 0.01 (the weights' scale) where max |b| is smaller.

    The floor matters for a parameter whose true gradient is zero (attention's k_proj.bias:
    softmax ignores a shift shared by every key): its values are pure round-off, ~1e-15, and a
    relative comparison of round-off means nothing."""
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(np.max(np.abs(b)), 1e-2))


def check_against_serial(results: list[dict], reference: dict, rtol: float = 1e-9) -> None:
    """Principle 1 for one multi-rank run: `results` (one dict per rank, with "results" = the
    (loss, accuracy) of each step and "state" = the consolidated state dict on rank 0, None on
    the others) against `serial_run`'s `reference`: the same losses and accuracies on every rank,
    and the same weights, relative `rtol`."""
    steps = np.array(results[0]["results"])
    np.testing.assert_allclose(steps[:, 0], [loss for loss, _ in reference["steps"]], rtol=rtol)
    np.testing.assert_allclose(steps[:, 1], [acc for _, acc in reference["steps"]], rtol=rtol)
    for rank_result in results[1:]:  # every rank reports the same loss and accuracy
        assert rank_result["results"] == results[0]["results"]
    state = results[0]["state"]
    assert set(state) == set(reference["state"])
    for name, value in reference["state"].items():
        assert state[name].shape == value.shape, name
        assert relative_difference(state[name], value) < rtol, name
    assert all(r["state"] is None for r in results[1:])  # the whole model lands on rank 0 only


def layout(nprocs: int, nodes=None, tcp: bool = False, full: bool = False):
    """One launch of a module's multi-rank fixture: `nprocs` ranks on `nodes` nodes as MPI sees
    them (`launch.run`; None: one, or MINIDIST_NODES), over TCP sockets if `tcp`; in the full tier
    only if `full`. Its id names it: "4", "4 on 2x2 tcp", "4 on 3+1"."""
    from minidist.comm.launch import ranks_per_node

    name = str(nprocs)
    if nodes is not None:
        per_node = ranks_per_node(nprocs, nodes)
        even = len(set(per_node)) == 1
        name += " on " + (f"{len(per_node)}x{per_node[0]}" if even else "+".join(map(str, per_node)))
    return pytest.param((nprocs, nodes, tcp), id=name + (" tcp" if tcp else ""), marks=[pytest.mark.full] if full else [])


def ranks_on_each_node(comm) -> list[int]:
    """How many ranks of the mpi4py communicator `comm` run on each node, as MPI reports it
    (chapter 2: `Split_type(COMM_TYPE_SHARED)`), nodes in the order of their lowest rank.
    Called by every rank of `comm` together."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = [size for first, size in comm.allgather((node.Get_rank() == 0, node.Get_size())) if first]
    node.Free()
    return per_node


def ranks_share_a_node(comm) -> bool:
    """Whether every rank of `comm` runs on one node, as MPI reports it."""
    return len(ranks_on_each_node(comm)) == 1


@functools.cache
def hidden_rows(path: str) -> int:
    """How many test cases a file of the instructor's hidden tests has (pytest's collection), for
    the grader's tests: the report counts them (tests/test_assignments_*.py)."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", path], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120)
    return sum("::" in line for line in proc.stdout.splitlines())
