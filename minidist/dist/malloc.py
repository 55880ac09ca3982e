"""Malloc tuning for fair timing of large collectives (chapter 07, benchmarks).

One idea: a big temporary buffer that glibc serves with a fresh `mmap` costs a page fault per
4 KB page on first touch, every time it is allocated, and is handed back to the kernel on
`free`. MPICH's own Allreduce allocates such temporaries on every call: measured at 64 MB,
that alone made MPI's all-reduce markedly slower than it needs to be. Two `mallopt` settings
keep large blocks on the heap and stop glibc returning freed memory to the kernel, so a
buffer freed by one call is reused, already mapped, by the next.

Why this is fair: it is applied once per process, before timing, and it affects MPI's
temporaries and minidist's (NumPy's) alike; the benchmark warms every algorithm up before
timing it. It only removes an allocator artefact that neither algorithm is about.
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3


def tune_malloc(threshold: int = 1 << 30) -> bool:
    """Serve blocks up to `threshold` bytes from the heap and never trim it. Returns False
    where glibc's mallopt is unavailable (e.g. macOS), which is harmless."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok_mmap = mallopt(M_MMAP_THRESHOLD, min(threshold, 2**31 - 1))
    ok_trim = mallopt(M_TRIM_THRESHOLD, min(threshold, 2**31 - 1))
    return bool(ok_mmap and ok_trim)
