"""Run a function on N real MPI processes and get each rank's result back (chapter 02).

One idea: a notebook or a test is *one* Python process, but a multi-rank program needs N of
them, started together by MPI's launcher. `run` starts

    <venv>/bin/mpiexec -n N <python> -m minidist.comm.launch <job dir>

and every rank calls `fn(*args, **kwargs)`; rank r's return value comes back as `run(...)[r]`.

    from minidist.comm.launch import run
    sums = run("minidist.comm.examples:ring_sum", 4)          # "module:function", or
    sums = run(my_rank_program, 4, 1024, timeout=60)           # a function object

Details that make it robust, in a test or a notebook:

* mpiexec is looked up next to the running Python (`sys.executable`), not on PATH: in a
  notebook the virtualenv is usually not activated, and `!mpiexec` would find none.
* Each rank is a fresh process that sees nothing of the caller's variables. A function from
  an importable module (a test file too) is imported by name; a function defined in a
  notebook (module `__main__`) is sent as source code, so it must import what it uses inside
  its own body. Arguments and results travel by pickle through a temporary directory.
* Each rank's stdout and stderr go to a file of their own; `run` prints them afterwards, one
  whole block per rank (MPICH's launcher would interleave ranks' lines mid-line).
* An exception on any rank aborts the whole job at once (`faults.abort`) and `run` raises
  `RankError` with every failing rank's traceback. If the job outlives `timeout`, the whole
  process group is killed and `LaunchTimeout` is raised; the ranks' own waits time out a
  little earlier (MINIDIST_TIMEOUT = 0.8 x timeout) so their error names who waited for what.
* OMP_NUM_THREADS=1 (and OpenBLAS's, MKL's) in the ranks: N ranks share few cores.
* `nodes=2` (or MINIDIST_NODES=2 for a whole test run) makes MPI see two machines, and
  `tcp=True` (MINIDIST_TCP=1) sends every message over a socket: the multi-node rehearsal.
"""
from __future__ import annotations

import importlib
import inspect
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path


class RankError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class LaunchTimeout(TimeoutError):
    """The job ran longer than its timeout and was killed."""


def find_mpiexec() -> str:
    """mpiexec next to this Python first (the venv's, from the `mpich` wheel), then PATH."""
    for name in ("mpiexec", "mpirun"):
        candidate = Path(sys.executable).parent / name
        if candidate.exists():
            return str(candidate)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("no mpiexec next to Python or on PATH: pip install mpich")
    return found


def _describe_target(fn):
    """How a fresh process can find `fn` again: ("import", module, name, path) or ("source", ...)."""
    if isinstance(fn, str):
        module, _, name = fn.partition(":")
        return ("import", module, name, None)
    module = fn.__module__
    if module == "__main__" or "<locals>" in fn.__qualname__:
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError) as exc:
            raise ValueError(f"cannot ship {fn!r} to the ranks: define it in a module or pass 'module:function'") from exc
        return ("source", fn.__name__, source, None)
    file = getattr(sys.modules[module], "__file__", None)
    root = None
    if file:  # the sys.path entry the module was imported from (pytest puts tests/ there)
        root = Path(file).resolve().parent
        for _ in range(module.count(".")):
            root = root.parent
        root = str(root)
    return ("import", module, fn.__qualname__, root)


def run(fn, nprocs: int, *args, timeout: float = 120.0, env: dict | None = None,
        echo: bool = True, nodes=None, tcp: bool | None = None, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `nprocs` MPI ranks; return [rank 0's result, rank 1's, ...].

    `nodes`: how many machines MPI should see, as a count (ranks spread evenly) or as ranks per
    node ([3, 1]); default: the environment variable MINIDIST_NODES ("2", "3,1"), else one.
    On this one machine each made-up node is a host of MPICH's host file started with the fork
    launcher, so `Split_type(COMM_TYPE_SHARED)` sees several nodes (chapter 2). `tcp=True`
    (default: MINIDIST_TCP=1) sends the messages between processes over TCP sockets on
    loopback instead of shared memory, as between real machines."""
    job = Path(tempfile.mkdtemp(prefix="minidist-job-"))
    try:
        with open(job / "job.pkl", "wb") as f:
            pickle.dump({"target": _describe_target(fn), "args": args, "kwargs": kwargs,
                         "sys_path": [p for p in sys.path if p]}, f)
        child_env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        child_env.setdefault("MINIDIST_TIMEOUT", str(max(1.0, 0.8 * timeout)))
        child_env.update(env or {})
        if tcp if tcp is not None else os.environ.get("MINIDIST_TCP") == "1":
            child_env.update(TCP_ENV)
        cmd = [find_mpiexec(), *node_flags(ranks_per_node(nprocs, nodes), job), "-n", str(nprocs),
               sys.executable, "-m", "minidist.comm.launch", str(job)]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env,
                                start_new_session=True)  # its own process group: killable as a whole
        try:
            launcher_output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise LaunchTimeout(f"{nprocs}-rank job {fn!r} still running after {timeout:.0f} s: killed.\n"
                                + _outputs(job, nprocs)) from None
        elapsed = time.perf_counter() - start
        results, failures = [], []
        for r in range(nprocs):
            path = job / f"result.{r}.pkl"
            if not path.exists():
                results.append(None)
                continue
            with open(path, "rb") as f:
                ok, value = pickle.load(f)
            results.append(value)
            if not ok:
                failures.append(value)
        if failures or proc.returncode != 0:
            detail = "\n".join(failures) if failures else launcher_output.decode(errors="replace")
            raise RankError(f"{nprocs}-rank job {fn!r} failed after {elapsed:.1f} s (exit {proc.returncode}); "
                            f"{len(failures)} rank(s) raised:\n{detail}\n--- output ---\n" + _outputs(job, nprocs))
        if echo:
            text = _outputs(job, nprocs)
            if text:
                print(text, end="")
        return results
    finally:
        shutil.rmtree(job, ignore_errors=True)


# MPICH's TCP transport on loopback: every message between processes crosses a socket
TCP_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"}


def ranks_per_node(nprocs: int, nodes=None) -> list[int]:
    """How many ranks each made-up node runs: `nodes` as a count or a list, or MINIDIST_NODES."""
    if nodes is None:
        nodes = os.environ.get("MINIDIST_NODES") or 1
    if isinstance(nodes, str):
        nodes = [int(n) for n in nodes.split(",")] if "," in nodes else int(nodes)
    if isinstance(nodes, int):
        count = max(1, min(nodes, nprocs))
        return [nprocs // count + (1 if i < nprocs % count else 0) for i in range(count)]
    nodes = [int(n) for n in nodes]
    if sum(nodes) != nprocs or min(nodes) < 1:
        raise ValueError(f"ranks per node {nodes} must be positive and add up to the {nprocs} ranks")
    return nodes


def node_flags(per_node: list[int], job: Path) -> list[str]:
    """mpiexec's flags for that layout: none for one node, else a host file and the fork launcher
    (each host a process group of this machine; no ssh)."""
    if len(per_node) == 1:
        return []
    hosts = job / "hosts"
    hosts.write_text("".join(f"node-{i}:{n}\n" for i, n in enumerate(per_node)))
    return ["-launcher", "fork", "-f", str(hosts)]


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _outputs(job: Path, nprocs: int) -> str:
    """Every rank's captured output, one whole block per rank, each line prefixed."""
    blocks = []
    for r in range(nprocs):
        path = job / f"output.{r}.txt"
        text = path.read_text(errors="replace") if path.exists() else ""
        prefix = f"[rank {r}]"  # tracebacks arrive prefixed already (faults.format_exception)
        blocks.extend((line if line.startswith(prefix) else f"{prefix} {line}") + "\n" for line in text.splitlines())
    return "".join(blocks)


# -- the rank side: python -m minidist.comm.launch <job dir> ---------------------------------

def _load_target(target):
    kind, a, b, root = target
    if kind == "source":
        namespace = {"__name__": "__minidist_job__"}
        exec(compile(b, f"<function {a} sent by minidist.comm.launch.run>", "exec"), namespace)
        return namespace[a]
    if root and root not in sys.path:
        sys.path.insert(0, root)
    obj = importlib.import_module(a)
    for part in b.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_main(job_dir: str):
    from mpi4py import MPI

    from minidist.comm import faults
    from minidist.runtime import tune_malloc

    tune_malloc()  # as the demo and the benchmarks do: measurements in notebooks agree with them
    job, rank = Path(job_dir), MPI.COMM_WORLD.Get_rank()
    out = open(job / f"output.{rank}.txt", "w", buffering=1)
    os.dup2(out.fileno(), 1)  # file descriptors too, so C-level output is captured as well
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    faults.install()
    with open(job / "job.pkl", "rb") as f:
        spec = pickle.load(f)
    for p in spec["sys_path"]:
        if p not in sys.path:
            sys.path.append(p)
    try:
        value = (True, _load_target(spec["target"])(*spec["args"], **spec["kwargs"]))
    except BaseException:
        exc_info = sys.exc_info()
        _write(job, rank, (False, faults.format_exception(*exc_info)))
        faults.abort(*exc_info)
    _write(job, rank, value)


def _write(job, rank, value):
    tmp = job / f"result.{rank}.tmp"
    try:
        data = pickle.dumps(value)
    except Exception as exc:  # an unpicklable result is this rank's error, not a hang
        data = pickle.dumps((False, f"[rank {rank}] result of type {type(value[1]).__name__} cannot be pickled: {exc}"))
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, job / f"result.{rank}.pkl")  # atomic: the parent never reads half a file


if __name__ == "__main__":
    _rank_main(sys.argv[1])
