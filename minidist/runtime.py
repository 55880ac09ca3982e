"""Process set-up that makes NumPy training fast and measurable on a small machine.

Chapter 1. glibc's malloc returns medium-sized freed blocks (above its mmap threshold, 128 KiB
at start) to the operating system, so every new temporary of that size page-faults again on
first touch, and a training step allocates thousands of such temporaries.
`tune_malloc()` keeps freed memory in the process instead. The demo, the benchmarks and the
multi-rank launcher call it at start-up (it is a process-wide setting, so the library does not
change it behind a user's back at import).

It also makes the collective benchmark fair (chapter 7): MPICH's own Allreduce allocates
large temporaries on every call, and at 64 MB their page faults alone made MPI's all-reduce
markedly slower than it needs to be. The setting applies to MPI's temporaries and NumPy's
alike, before any timing, and removes an allocator artefact that no algorithm is about.

`limit_threads_per_rank()` gives each rank its share of the machine's cores for BLAS, so that
`mpirun -n 4` on a 2-core machine runs 4 threads, not 4 x 2 fighting ones.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_tuned = False


def tune_malloc(threshold_bytes: int = 1 << 30) -> bool:
    """Serve allocations up to `threshold_bytes` from the heap and never trim it back.

    Returns True when the setting took effect (glibc), False elsewhere (e.g. macOS, musl).
    """
    global _tuned
    if _tuned:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, threshold_bytes * 2 - 1) == 1 and ok
    _tuned = ok
    return ok


def cores_available() -> int:
    """The cores this process may run on (its CPU affinity where the OS says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def memory_available() -> int:
    """Bytes of memory this machine can give a new job now (Linux's MemAvailable; elsewhere its
    physical memory): what the demo compares a run's least memory with before it starts."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def limit_threads_per_rank(comm=None, say=True) -> int:
    """Give each rank on this machine its share of the cores for BLAS and OpenMP threads.

    Chapter 2: every rank is a whole process, and a NumPy built on OpenBLAS starts one thread
    per core in each of them. Four ranks on two cores then run eight or more busy threads that
    take turns, and a step gets several times slower. The share is cores // (ranks on this
    machine), at least 1, applied with threadpoolctl. Collective over the MPI communicator
    `comm` (default: every rank of the job), whose ranks on this machine it counts; its rank 0
    says once what it set. Returns the share."""
    from mpi4py import MPI
    from threadpoolctl import threadpool_info, threadpool_limits

    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_ranks = node.Get_size()
    node.Free()
    share = max(1, cores_available() // local_ranks)
    before = max((pool.get("num_threads", 1) for pool in threadpool_info()), default=1)
    if before > share:
        threadpool_limits(limits=share)
        if say and comm.Get_rank() == 0:
            print(f"minidist: {local_ranks} ranks share {cores_available()} cores on this machine: "
                  f"{share} BLAS/OpenMP thread{'s' if share > 1 else ''} per rank (was {before})",
                  file=sys.stderr, flush=True)
    return share
