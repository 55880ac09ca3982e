"""The consistency check: every rank must call a collective with arguments that fit together.

Chapter 7. A collective is a contract: every rank of the group calls it, in the same order, with
the same count, dtype, op and root. If one rank breaks it, a hand-written ring would wait forever
for a message that never comes, or add up arrays of different lengths. So before any message a
collective shares (collective, count, dtype, op, root) among the ranks through MPI's own small
Iallgather and compares: a mismatch raises `CollectiveMismatch` (errors.py) on *every* rank,
naming what each rank passed.

The check is one extra round trip per call. A strategy checks once instead, when it is built
(`World.verify`: the facts from which every later call's arguments follow), and its calls on
the returned group skip this one. Benchmarks may turn it off (`set_check(False)`, `unchecked()`).
"""
from __future__ import annotations

import contextlib
import zlib

import numpy as np

from minidist.comm import traffic
from minidist.comm.errors import CollectiveMismatch
from minidist.comm.waiting import Request, wait
from minidist.comm.world import World

_CHECK = [True]


def set_check(enabled: bool) -> bool:
    """Turn the consistency check on or off (on this rank; do it on all). Returns the old value."""
    old, _CHECK[0] = _CHECK[0], bool(enabled)
    return old


def needs_check(group) -> bool:
    """Whether a call on `group` checks its arguments first: yes, unless the check is off or
    the group was verified when its strategy was built (`World.verify`)."""
    return _CHECK[0] and (group is None or group.checked)


@contextlib.contextmanager
def unchecked():
    """Skip the check inside this block (benchmarks, and a user's own calls whose arguments
    agree by construction). Strategies verify their groups instead (`World.verify`)."""
    previous = set_check(False)
    try:
        yield
    finally:
        set_check(previous)


def _code(text: str) -> int:
    return zlib.crc32(text.encode())


def check_consistent(world: World, name: str, count: int, dtype, op: str = "", root: int = -1,
                     same_count: bool = True, algorithm: str = "") -> np.ndarray:
    """The mismatch check: every rank shares (collective, count, dtype, op, root, algorithm)
    through a small MPI Iallgather (waited for politely) and compares. Returns the counts per
    rank. Counted in traffic under the kind "check" (bytes as if sent directly to every peer)."""
    dtype = np.dtype(dtype)
    mine = np.array([_code(name), count, _code(dtype.str), _code(op), root, _code(algorithm)], dtype=np.int64)
    table = np.empty((world.size, mine.size), dtype=np.int64)
    req = world.coll_comm.Iallgather(mine, table)
    wait([Request(req, "coll", -1, -1, table.nbytes, f"the consistency check of {name} (MPI Iallgather)", world)])
    for _ in range(world.size - 1):
        traffic.record_send("check", mine.nbytes)
        traffic.record_recv("check", mine.nbytes)
    fields = [0, 2, 3, 4, 5] + ([1] if same_count else [])
    if (table[:, fields] != mine[fields]).any():
        # Every rank sees the same table, so every rank takes this path and raises the same
        # error; one more (pickled) allgather brings what each rank passed, in words.
        passed = world.coll_comm.allgather((name, int(count), dtype.name, op, root, algorithm))
        rows = [f"rank {r}: {n}(count={c}, dtype={d}" + (f", op={o}" if o else "")
                + (f", root={rt}" if rt >= 0 else "") + (f", algorithm={a}" if a else "") + ")"
                for r, (n, c, d, o, rt, a) in enumerate(passed)]
        raise CollectiveMismatch(
            f"{name} called with mismatched arguments on rank {world.rank}'s group of {world.size}: "
            + "; ".join(rows))
    return table[:, 1]
