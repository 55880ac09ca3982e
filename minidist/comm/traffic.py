"""Traffic counters: how many messages and bytes each rank sends and receives (chapters 02, 07).

One idea: a formula such as "ring all-reduce sends 2(N-1)/N x S bytes per rank" is only
believable next to a measurement. Every point-to-point message minidist posts is recorded
here, per rank, under a *kind*: "send"/"recv" for the user's own messages, and
"<collective>.<algorithm>" (e.g. "all_reduce.ring") for messages posted by a hand-written
collective. The small consistency check that runs before a collective (see
`consistency.check_consistent`) uses MPI's own Allgather and is counted separately under
the kind "check" with its bytes estimated, so it never pollutes a collective's numbers.

    from minidist.comm import traffic
    traffic.reset()
    all_reduce(x)
    traffic.snapshot()        # {"all_reduce.ring": {...}, "total": {...}} on this rank
    traffic.gather()          # on every rank: one dict per rank, for the demo's --json

A group made with a label (`world.split(color, label="tp")`, as the device mesh makes its
groups) counts its messages under "<kind>@<label>", e.g. "all_reduce.ring@dp", so a composed
layout's traffic splits by dimension (`by_label`).
"""
from __future__ import annotations

_FIELDS = ("bytes_sent", "bytes_received", "messages", "messages_received", "calls")


class Counter:
    """The counts of one kind. Plain attributes (`__slots__`), so counting a message on the hot
    path of a collective is two integer additions, not dict lookups (chapter 7)."""

    __slots__ = _FIELDS

    def __init__(self):
        for f in _FIELDS:
            setattr(self, f, 0)


_counts: dict[str, Counter] = {}


def counter(kind: str) -> Counter:
    """The Counter of `kind`, created on first use. Hold on to it to count cheaply."""
    c = _counts.get(kind)
    if c is None:
        c = _counts[kind] = Counter()
    return c


def labelled(kind: str, world) -> str:
    """The kind under which a message on `world` is counted: "pipeline@pp" on a group labelled
    "pp" (chapter 9: the mesh's groups), plain `kind` on an unlabelled one."""
    label = getattr(world, "label", None)
    return f"{kind}@{label}" if label else kind


def by_label(counts: dict) -> dict:
    """Bytes sent per group label, from one rank's `by_kind` counters: {"tp": ..., "dp": ...};
    messages on unlabelled groups are left out."""
    totals = {}
    for kind, c in counts.items():
        if "@" in kind:
            label = kind.rsplit("@", 1)[1]
            totals[label] = totals.get(label, 0) + c["bytes_sent"]
    return totals


def record_send(kind: str, nbytes: int):
    c = counter(kind)
    c.bytes_sent += int(nbytes)
    c.messages += 1


def record_recv(kind: str, nbytes: int):
    c = counter(kind)
    c.bytes_received += int(nbytes)
    c.messages_received += 1


def record_call(kind: str):
    """One call of a collective (so a notebook can divide bytes by calls)."""
    counter(kind).calls += 1


def reset():
    for c in _counts.values():  # zero in place: a collective in flight may hold a Counter
        for f in _FIELDS:
            setattr(c, f, 0)


def snapshot(exclude=("check",)) -> dict:
    """This rank's counters: {kind: {field: n}}, plus "total" over all kinds not excluded.
    `messages` counts messages sent; `messages_received` those received."""
    out = {k: {f: getattr(c, f) for f in _FIELDS} for k, c in sorted(_counts.items())
           if any(getattr(c, f) for f in _FIELDS)}
    total = dict.fromkeys(_FIELDS, 0)
    for kind, c in out.items():
        if kind in exclude:
            continue
        for f in _FIELDS:
            total[f] += c[f]
    out["total"] = total
    return out


def gather(group=None) -> list[dict]:
    """Every rank's totals, as a list indexed by rank, returned on every rank of `group`:
    [{"rank": r, "bytes_sent": ..., "bytes_received": ..., "messages": ...,
      "messages_received": ..., "by_kind": {...}}, ...]. Collective: all ranks must call it.
    Uses MPI's own (pickle) allgather, which is not itself counted."""
    from minidist.comm.world import resolve

    world = resolve(group)
    snap = snapshot()
    mine = {"rank": world.rank, **snap.pop("total"), "by_kind": snap}
    return world.comm.allgather(mine)
