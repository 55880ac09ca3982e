"""Process set-up that makes NumPy training fast and measurable on a small machine.

Chapter 1. glibc's malloc returns medium-sized freed blocks (above its mmap threshold, 128 KiB
at start) to the operating system, so every new temporary of that size page-faults again on
first touch. A training step allocates thousands of such temporaries: measured on this machine,
raising the thresholds halved an MLP block's time and brought the step to PyTorch's speed.
`tune_malloc()` keeps freed memory in the process instead. The demo, the benchmarks and the
multi-rank launcher call it at start-up (it is a process-wide setting, so the library does not
change it behind a user's back at import).

It also makes the collective benchmark fair (chapter 7): MPICH's own Allreduce allocates
large temporaries on every call, and at 64 MB their page faults alone made MPI's all-reduce
markedly slower than it needs to be. The setting applies to MPI's temporaries and NumPy's
alike, before any timing, and removes an allocator artefact that no algorithm is about.
"""
from __future__ import annotations

import ctypes
import ctypes.util

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
