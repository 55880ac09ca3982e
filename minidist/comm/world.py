"""The world: processes, ranks, world size and communicators (chapter 02, core concepts).

One idea: every process of a job runs the same program, and the only thing that tells them
apart is their *rank* (进程编号) within a *communicator* (通信域) of *size* processes.
`MPI.COMM_WORLD` holds every process of the job; `World.split(color, key)` cuts it into groups
(e.g. the data-parallel replicas that hold the same pipeline stage), which later chapters use
to lay out DP x TP x PP.

A `World` wraps two MPI communicators over the same processes:

* `comm`       for the user's own point-to-point messages (`minidist.comm.p2p`), and
* `coll_comm`  a duplicate (`Idup`) used only by the hand-written collectives.

Why two: MPI matches a message by (communicator, source, tag). Keeping the collectives on
their own communicator means a user's `send(..., tag=5)` can never be swallowed by a ring
all-reduce that happens to use tag 5. Each collective call also takes a fresh tag
(`next_tag`), so several *asynchronous* collectives in flight at once keep their messages
apart. Every rank calls collectives in the same order, so every rank draws the same tag.
"""
from __future__ import annotations

import sys
import zlib

from mpi4py import MPI

from minidist.comm.errors import CollectiveMismatch
from minidist.comm.waiting import Request, wait


class World:
    """A group of processes that can talk to each other (a communicator, 通信域)."""

    checked = True  # collectives on this group check their arguments first (see `verify`)

    def __init__(self, comm: MPI.Comm, parent: "World | None" = None, label: str | None = None):
        self.comm = comm
        # what this group is for ("tp", "dp", "pp", ...): its messages are counted under it too
        # (chapter 9: traffic per dimension of the mesh); a group split from it inherits it
        self.label = label if label is not None else getattr(parent, "label", None)
        self._coll_comm = None  # private channel for the collectives, made on first use
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.parent = parent
        # Tags above this are reserved; MPI guarantees at least 32767, MPICH gives 2**29 - 1.
        self._tag_ub = min(int(comm.Get_attr(MPI.TAG_UB) or 32767), 2**30)
        self._seq = 0
        self.cache = {}  # per-group state of the collectives (e.g. the shared-memory window)

    # -- identity ---------------------------------------------------------------------------
    def __repr__(self):
        return f"World(rank={self.rank}, size={self.size}, global_rank={global_rank()})"

    @property
    def coll_comm(self) -> MPI.Comm:
        """The duplicate communicator of the collectives. Duplicating is itself a collective
        call, so it happens lazily inside the first collective (which every rank makes), and
        with the non-blocking `Idup` so that it waits politely and can time out (waiting.py)."""
        if self._coll_comm is None:
            self.open_collectives()
        return self._coll_comm

    def open_collectives(self, timeout=None) -> None:
        """Make `coll_comm` now, waiting at most `timeout` (default: the wait policy's) for the
        other ranks to join (a barrier whose ranks may wait long passes its own timeout)."""
        if self._coll_comm is None:
            comm, req = self.comm.Idup()
            wait([Request(req, "coll", -1, -1, 0, "MPI Idup of the communicator (every rank's first collective)", self)],
                 timeout)
            self._coll_comm = comm

    def next_tag(self) -> int:
        """A fresh tag for one collective call; equal on every rank that makes the same calls."""
        self._seq += 1
        return self._seq % self._tag_ub

    # -- groups -----------------------------------------------------------------------------
    def split(self, color: int, key: int | None = None, label: str | None = None) -> "World":
        """Cut this world into groups: ranks passing the same `color` land in one group,
        ordered by `key` (default: their rank here). Every rank of this world must call it.
        `label` names what the group is for, in the traffic counters (default: this world's).

        >>> # 4 ranks as 2 data-parallel replicas x 2 pipeline stages:
        >>> # stage = world.rank % 2; dp_group = world.split(color=stage)
        """
        key = self.rank if key is None else key
        return World(self.comm.Split(color, key), parent=self, label=label)

    def group(self, ranks) -> "World | None":
        """A group of the listed ranks (of this world), or None on ranks not listed.
        Every rank of this world must call it with the same list."""
        ranks = list(ranks)
        inside = self.rank in ranks
        sub = self.comm.Split(0 if inside else MPI.UNDEFINED, ranks.index(self.rank) if inside else 0)
        return World(sub, parent=self) if inside else None

    def verify(self, what: str, facts) -> "VerifiedGroup":
        """Check once that every rank holds the same `facts` (e.g. the shapes and dtypes of the
        arrays it will reduce every step) and return this group marked as verified.

        Chapter 7: a collective checks its arguments against every rank's before any message
        (`consistency.check_consistent`), an extra round trip per call. A strategy whose every
        call follows from facts verified here has nothing left to check, so its collectives on
        the returned group skip that round trip and read as one line:
        `all_reduce(grad, group=self.group)`."""
        codes = self.comm.allgather(zlib.crc32(repr(facts).encode()))  # once, at construction
        if len(set(codes)) > 1:
            groups = {}
            for rank, code in enumerate(codes):
                groups.setdefault(code, []).append(rank)
            raise CollectiveMismatch(f"{what}: not the same on every rank of this group of {self.size} ("
                                     + " vs ".join(f"ranks {ranks}" for ranks in groups.values()) + ")")
        return VerifiedGroup(self, what)

    def nodes(self) -> list[list[int]]:
        """The ranks of this world on each machine (node), in order of their first rank: e.g.
        [[0, 1], [2, 3]] for 2 ranks on each of 2 machines. MPI knows which processes share
        memory (`Split_type(COMM_TYPE_SHARED)`); every rank gets the same answer. Collective."""
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        first = node.allreduce(self.rank, op=MPI.MIN)  # the node's lowest rank names it
        node.Free()
        leaders = self.comm.allgather(first)
        return [[r for r, leader in enumerate(leaders) if leader == node_id] for node_id in sorted(set(leaders))]

    # -- printing without interleaving ------------------------------------------------------
    def print0(self, *args, **kwargs):
        """Print from rank 0 only. MPICH's launcher interleaves ranks' stdout mid-line."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    def print_all(self, text: str):
        """Every rank passes a text; rank 0 prints them whole, in rank order."""
        texts = self.comm.gather(str(text), root=0)  # small: the pickle API is fine here
        if self.rank == 0:
            for r, t in enumerate(texts):
                for line in t.splitlines() or [""]:
                    print(f"[rank {r}] {line}")
            sys.stdout.flush()


class VerifiedGroup:
    """A `World` whose ranks agreed on `what` when it was made (`World.verify`): the same group,
    the same communicators and tags, but collectives on it skip the per-call check."""

    checked = False

    def __init__(self, world: World, what: str):
        self.world, self.what = world, what

    def __getattr__(self, name):  # rank, size, comm, split, print0, ...: the world's own
        return getattr(self.world, name)

    def __repr__(self):
        return f"VerifiedGroup({self.world!r}, {self.what!r})"


_WORLD: World | None = None


def get_world() -> World:
    """The default world: every process of the job (`MPI.COMM_WORLD`), created on first use.

    In a job of several ranks, first use also installs `faults.install()` (unless the program
    has set its own `sys.excepthook`): a program that communicates through minidist gets the
    promise of chapter 2, any rank's uncaught exception ends the whole job, even if it never
    asked for it."""
    global _WORLD
    if _WORLD is None:
        _WORLD = World(MPI.COMM_WORLD)
        if _WORLD.size > 1 and sys.excepthook is sys.__excepthook__:
            from minidist.comm import faults

            faults.install()
    return _WORLD


def resolve(group: "World | None") -> World:
    """`group=None` means the whole world, as in torch.distributed; a verified group is its world."""
    if group is None:
        return get_world()
    return group.world if isinstance(group, VerifiedGroup) else group


def global_rank() -> int:
    return MPI.COMM_WORLD.Get_rank()


def get_rank(group: World | None = None) -> int:
    return resolve(group).rank


def get_world_size(group: World | None = None) -> int:
    return resolve(group).size
