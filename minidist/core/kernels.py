"""The one switch between minidist's two kernel paths: "plain" and "fast".

Chapter 1. Every transformer operation exists twice: the plain form in `fused.py`, written as its
formula for a learner to read, and a fast form in `fused_fast.py` (same formula, same numbers to
rounding, tuned for the CPU's memory traffic). AdamW's update likewise (`optim.adamw_update`).
tests/test_kernels.py holds the two paths to the same numbers.

    kernels("plain")            # from now on, in this process
    with kernels("plain"):      # only inside the block
        ...
    current()                   # "plain" or "fast"
    chosen(fused.Linear)        # the class that runs that operation now

fused_fast.py builds on fused.py (each fast class subclasses its plain twin), so fused.py cannot
import it: fused_fast.py registers its classes here (`register_fast`) when it is imported, and
`import minidist` imports it. Which class runs is decided here, in one place.

The environment variable MINIDIST_KERNELS (read at import) sets the starting choice, for
notebooks and test runs; without it the fast path runs, as the demo and benchmarks expect.
"""
from __future__ import annotations

import os

CHOICES = ("plain", "fast")


def _checked(name: str) -> str:
    if name not in CHOICES:
        raise ValueError(f"kernels: unknown path {name!r}; choose 'plain' or 'fast'")
    return name


_current = _checked(os.environ.get("MINIDIST_KERNELS", "fast"))


def current() -> str:
    """The kernel path operations run on now: "plain" or "fast"."""
    return _current


class kernels:  # noqa: N801  (a function to its callers, like torch.set_grad_enabled)
    """Choose the kernel path: at once when called, and back to the previous one at the end of
    a `with` block when used as a context manager."""

    def __init__(self, name: str):
        global _current
        self.previous = _current
        _current = _checked(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        global _current
        _current = self.previous


# The fast twin of each plain operation class of fused.py, filled in by fused_fast.py.
_FAST: dict[type, type] = {}


def register_fast(plain: type, fast: type) -> None:
    """On the fast path, run `fast` wherever `plain` would run (fused_fast.py calls this)."""
    _FAST[plain] = fast


def chosen(plain: type) -> type:
    """The class that runs the operation of `plain` (a class of fused.py) on the current path:
    `plain` itself on the plain path, its twin of fused_fast.py on the fast path."""
    if _current == "plain":
        return plain
    fast = _FAST.get(plain)
    if fast is None:
        raise RuntimeError(f"kernels: no fast {plain.__name__} registered; fused_fast.py registers the fast "
                           "kernels when it is imported (`import minidist` imports it)")
    return fast
