"""Faults never hang: a failing rank ends the whole job, loudly (chapter 02).

One idea: under MPI, an exception on one rank does not end the job. That rank's Python exits,
but the others wait forever for its messages (measured with MPICH: the job hangs, a waiting
rank spinning at 100% CPU). So minidist turns an uncaught exception on any rank into
`MPI.COMM_WORLD.Abort(1)`, which makes the launcher kill every rank of the job at once,
after printing that rank's traceback (once, each line prefixed by its rank, so it cannot be
lost among the other ranks' output).

    from minidist.comm import faults
    faults.install()              # first thing in the demo, the benchmarks, rank programs

The other half of "never hang" is the timeout on every wait (waiting.py raises CommTimeout,
naming the rank, the peer and the tag), which `install()` then turns into an abort as well.

What an abort cleans up. MPICH keeps its shared memory in files /dev/shm/mpich_shm_* (its
intra-node transport, and every `MPI.Win.Allocate_shared` window such as shared_memory.py's),
and removes them in MPI_Finalize only: after MPI_Abort they stay, a few MB per failed job,
mapped by no process. Before aborting, `abort` removes the names of exactly the segments
this process has mapped (read from /proc/self/maps): they belong to this job, since
MPICH shares a segment only among the ranks of one job on one machine. Removing a name
does not unmap the memory, so ranks still running keep working until the launcher ends
them. Not cleaned: segments of this job that this rank never mapped (on another machine:
there the launcher kills the ranks before any of them can clean), anything left by a rank
killed from outside (SIGKILL, out of memory), and other jobs' leftovers. minidist does not
free its windows (`MPI_Win_free`) on this path: freeing is collective, and the other ranks
are not there to take part; unlinking the files is what releases their memory once the
processes are gone.

The same clean-up runs where minidist itself ends a rank, or is told to: before the SIGKILL of
an injected fault (`MINIDIST_KILL`, minidist/parallel/checkpointing.py) and on SIGTERM (what
mpirun passes on to every rank when it is itself terminated), after which the rank exits with
status 143 (128 + SIGTERM), even from inside an MPI call (a thread watches for the signal:
`_watch_sigterm`). An abort also removes the launcher's file: MPICH's hydra proxy writes the
machine's topology to /tmp/hydra_hwloc_xmlfile_* for its ranks and deletes it when the job ends,
but an aborted job's proxy is killed first and the file stays, one per failed job. The proxy
(this rank's parent) holds the file open, which names it: `launcher_files`.

`fail(message)` is for errors every rank detects alike before any message is sent (an
invalid layout such as --dp 3 on 4 ranks): rank 0 prints one line, every rank exits with
status 2; no traceback, no abort needed.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from mpi4py import MPI

_installed = [False]


def format_exception(exc_type, exc, tb) -> str:
    """The traceback, each line prefixed by this process's rank in COMM_WORLD."""
    rank = MPI.COMM_WORLD.Get_rank()
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))


def mapped_shared_memory() -> list[str]:
    """The MPICH shared-memory files this process maps (none where /proc is not there)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = {line.split(maxsplit=5)[5] for line in lines if line.count(" ") >= 5 and "/dev/shm/mpich_shm_" in line}
    return sorted(p for p in paths if p.startswith("/dev/shm/mpich_shm_") and not p.endswith(" (deleted)"))


def remove_shared_memory() -> None:
    """Remove the names of this job's shared-memory segments (see the module's docstring)."""
    for path in mapped_shared_memory():
        try:
            os.unlink(path)
        except OSError:
            pass  # another rank of the job removed it first


def launcher_files() -> list[str]:
    """The topology file of this job's hydra proxy (this process's parent), which holds it open."""
    fds = f"/proc/{os.getppid()}/fd"
    try:
        names = os.listdir(fds)
    except OSError:
        return []  # not Linux, or not started by hydra
    found = set()
    for name in names:
        try:
            target = os.readlink(os.path.join(fds, name))
        except OSError:
            continue  # closed meanwhile
        if os.path.basename(target).startswith("hydra_hwloc_xmlfile_"):
            found.add(target)
    return sorted(found)


def remove_job_files() -> None:
    """Remove what this job leaves behind when it does not end normally: its shared-memory
    segments and its launcher's topology file (see the module's docstring)."""
    remove_shared_memory()
    for path in launcher_files():
        try:
            os.unlink(path)
        except OSError:
            pass  # another rank of the job removed it first


def abort(exc_type, exc, tb, grace: float = 0.2):
    """Print the traceback once, remove this job's shared-memory files, end every rank."""
    sys.stderr.write(format_exception(exc_type, exc, tb))
    sys.stderr.flush()
    sys.stdout.flush()
    remove_job_files()
    if MPI.COMM_WORLD.Get_size() > 1:
        # Other ranks often fail at the same moment for the same reason (a mismatch error is
        # raised on every rank); a short grace period lets them print before we kill them.
        time.sleep(grace)
    MPI.COMM_WORLD.Abort(1)
    os._exit(1)  # MPICH's Abort can return before the launcher kills us: never run on


def _hook(exc_type, exc, tb):
    if issubclass(exc_type, KeyboardInterrupt) and MPI.COMM_WORLD.Get_size() == 1:
        return sys.__excepthook__(exc_type, exc, tb)
    abort(exc_type, exc, tb)


def _thread_hook(args):
    abort(args.exc_type, args.exc_value, args.exc_traceback)


_ending = threading.Lock()
_rank_pid = [None]  # the process that installed the handler (a forked child is not the rank)


def _terminate(*_) -> None:
    """SIGTERM: remove this job's files, then end the process with the status a SIGTERM gives
    (128 + 15). Once, from whichever thread sees the signal first (see `_watch_sigterm`)."""
    if os.getpid() != _rank_pid[0]:  # a child forked by the rank: it owns no job files
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    with _ending:
        remove_job_files()
        os._exit(128 + signal.SIGTERM)


def _watch_sigterm(wakeup: int) -> None:
    """Python runs a signal handler in the main thread, between two bytecodes: never while that
    thread waits inside a C call (an MPI collective). The interpreter also writes each signal's
    number to a wake-up pipe at once, so this thread sees a SIGTERM whatever the main thread
    is doing (mpi4py releases the GIL while it waits)."""
    while True:
        try:
            numbers = os.read(wakeup, 64)
        except OSError:
            return
        if signal.SIGTERM in numbers:
            _terminate()


def _catch_sigterm() -> None:
    """SIGTERM (mpirun passes it on to every rank when it is itself terminated) removes the
    job's files first. Only where the program has no handler and no wake-up pipe of its own."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    theirs = signal.set_wakeup_fd(write)
    if theirs != -1:  # the program's own (asyncio's): leave it, and SIGTERM, alone
        signal.set_wakeup_fd(theirs)
        os.close(read)
        os.close(write)
        return
    _rank_pid[0] = os.getpid()
    signal.signal(signal.SIGTERM, _terminate)
    threading.Thread(target=_watch_sigterm, args=(read,), name="minidist-sigterm", daemon=True).start()


def install():
    """Make any uncaught exception, in any thread of this rank, abort the whole job; and a
    SIGTERM remove the job's files before it ends the rank."""
    if not _installed[0]:
        sys.excepthook = _hook
        threading.excepthook = _thread_hook
        _catch_sigterm()
        _installed[0] = True


def fail(message: str, code: int = 2):
    """Every rank found the same problem before communicating: one line, non-zero exit."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
