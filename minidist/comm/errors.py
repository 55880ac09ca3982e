"""The two ways communication fails loudly instead of hanging (chapters 02 and 07).

One idea: when ranks stop fitting together, every rank should say so, naming the ranks
involved, rather than wait forever. minidist.comm raises one of two errors:

- `CommTimeout`: a wait took longer than its timeout (waiting.py); the message names this rank,
  the peer, the tag and what it waited for.
- `CollectiveMismatch`: ranks called a collective with arguments that do not fit together
  (consistency.py checks every call; `World.verify` checks a strategy's groups once); raised on
  every rank, naming what each rank passed.

faults.py turns either, uncaught, into the end of the whole job. They are raised at several
levels of minidist.comm (world.py, waiting.py, consistency.py, shared_memory.py), so they live
below all of them, here.
"""
from __future__ import annotations


class CommTimeout(TimeoutError):
    """A wait took longer than the timeout: a peer is dead, stuck, or never sent."""


class CollectiveMismatch(ValueError):
    """Ranks called a collective with arguments that do not fit together."""
