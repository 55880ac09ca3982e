"""Registered buffers: an all-reduce that copies nothing (chapter 07).

shared_memory.py's all-reduce copies each array into a shared window, adds up one chunk there,
and copies the result back out: for S bytes on N ranks each rank moves about 2.5 S through its
caches besides the adding. If the array *lives* in shared memory to begin with, none of those
copies is needed. That is what registering a buffer does: the owner allocates it inside an MPI
shared window, every rank of the group can read and write every rank's copy, and an all-reduce
of it is

  1. my array is complete: raise arrived[r] = k (call number k of this buffer);
  2. wait until every arrived[j] >= k;
  3. add up my chunk r straight from the N ranks' arrays, in rank order 0, 1, ..., N-1 (the
     bits of shared_memory.py's sum), and write the result into chunk r of *every* rank's
     array; raise reduced[r] = k;
  4. wait until every reduced[j] >= k: every chunk of my array now holds the sum.

Each rank reads S bytes and writes S bytes, nothing else. Arrays of at most 64 KB
(shared_memory.SMALL) still take the window: its one handshake beats the two needed here, and
their copies are small. NCCL's user-buffer registration
(`ncclCommRegister`, PyTorch's `register_mem_pool`) exists for the same reason on GPUs, and
PyTorch's DDP writes its gradients into its buckets (`gradient_as_bucket_view`) so that those
buckets are what gets reduced. minidist's `DistributedDataParallel` allocates its buckets here
when its ranks share a machine (chapter 3), and `all_reduce` recognises a registered array and
takes this path whenever it would have used the shared-memory window.

Why it is safe without shared_memory.py's two sets of slots: a rank writes into chunk r of the
others' arrays only after every rank has raised arrived (their arrays are complete and nobody
writes them until this call ends), and a rank leaves the call only after every rank raised
reduced (nobody reads or writes its array any more). Calls on one buffer must run in order;
calls on different buffers are independent (each buffer has its own flags).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from minidist.comm import shared_memory
from minidist.comm.algorithms import chunk_bounds
from minidist.comm.driver import _run, reused_context
from minidist.comm.shared_memory import ARRIVED, LINE, REDUCED, FlagWait, _reduce

BLOCK_BYTES = 128 << 10  # the sum of a chunk goes through a scratch block this size, kept in cache

_BY_ID: dict = {}  # id(array) -> (Registered, index): how all_reduce recognises a registered array


class _Flags:
    """Buffer i's two flag rows, shaped as FlagWait expects of a window."""

    __slots__ = ("flag_rows", "flags", "rank", "size")

    def __init__(self, flags, rows, rank, size):
        self.flags, self.flag_rows, self.rank, self.size = flags, rows, rank, size


class Registered:
    """Arrays of the given (count, dtype)s, allocated in one shared window over `world`'s ranks
    (collective: every rank passes the same list). `arrays[i]` is this rank's, zeroed."""

    def __init__(self, world, shapes: list[tuple[int, np.dtype]]):
        self.world = world
        self.node = world.coll_comm.Split_type(MPI.COMM_TYPE_SHARED)
        if self.node.Get_size() != world.size:
            self.node.Free()
            raise ValueError("registered buffers need every rank of the group on one machine")
        self.rank, self.size = self.node.Get_rank(), self.node.Get_size()
        n, count = self.size, len(shapes)
        flag_bytes = 2 * count * n * LINE
        offsets, mine = [], 0
        for items, dtype in shapes:
            offsets.append(mine)
            mine += -(-items * np.dtype(dtype).itemsize // LINE) * LINE
        mine = max(mine, LINE)
        ahead = flag_bytes if self.rank == 0 else 0
        self.win = MPI.Win.Allocate_shared(ahead + mine, LINE, comm=self.node)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch, in which Sync is a memory barrier
        segments = [np.frombuffer(self.win.Shared_query(j)[0], np.uint8) for j in range(n)]
        segments[0] = segments[0][flag_bytes:]
        flags = np.frombuffer(self.win.Shared_query(0)[0], np.uint8)[:flag_bytes]
        table = flags.view(np.int64).reshape(count, 2, n, LINE // 8)[..., 0]
        words, stride = memoryview(flags).cast("q"), LINE // 8
        self.flags = []
        for i in range(count):
            rows = [words[(2 * i + row) * n * stride:(2 * i + row + 1) * n * stride:stride] for row in range(2)]
            self.flags.append(_Flags(table[i], rows, self.rank, n))
        self.peers = []  # peers[i][j]: rank j's array i
        for (items, dtype), at in zip(shapes, offsets):
            nbytes = items * np.dtype(dtype).itemsize
            self.peers.append([segment[at:at + nbytes].view(dtype) for segment in segments])
        self.arrays = [copies[self.rank] for copies in self.peers]
        for a in self.arrays:
            a[...] = 0
        table[:, :, self.rank] = 0
        self.calls = [0] * count
        self.waits = [[FlagWait(f, ARRIVED, 0), FlagWait(f, REDUCED, 0)] for f in self.flags]
        self.scratch = {}
        self.ctx = None
        self.node.Barrier()  # every array and flag is zero before anyone uses them
        for i, a in enumerate(self.arrays):
            _BY_ID[id(a)] = (self, i)
        shared_memory._OPEN.append(self)  # freed before MPI_Finalize, in the order made (collective)

    def free(self):
        """End the epoch and free the window (collective over the group's ranks)."""
        if self.win is not None:
            for a in self.arrays:
                _BY_ID.pop(id(a), None)
            for f in self.flags:
                for row in f.flag_rows:
                    row.release()
            self.flags = self.peers = self.arrays = self.waits = None
            self.win.Unlock_all()
            self.win.Free()
            self.win = None

    def raise_flag(self, i, row, k, counts):
        self.win.Sync()  # my data first, then my flag
        self.flags[i].flag_rows[row][self.rank] = k
        counts.messages += 1

    def wait_for(self, i, row, k) -> FlagWait:
        wait = self.waits[i][row]
        wait.k = k
        return wait

    def all_reduce_steps(self, ctx, i, op, average):
        """The protocol above for array i, as a generator that yields where it waits."""
        self.calls[i] += 1
        k, n, r = self.calls[i], self.size, self.rank
        copies = self.peers[i]
        self.raise_flag(i, ARRIVED, k, ctx.counts)
        yield self.wait_for(i, ARRIVED, k)
        self.win.Sync()  # their flags seen, now their data
        a, b = chunk_bounds(copies[r].size, n)[r]
        dtype = copies[r].dtype
        step = max(1, BLOCK_BYTES // dtype.itemsize)
        scratch = self.scratch.get(dtype)
        if scratch is None:
            scratch = self.scratch[dtype] = np.empty(step, dtype)
        for start in range(a, b, step):  # block by block: the sum stays in cache while it is written N times
            stop = min(start + step, b)
            total = scratch[:stop - start]
            _reduce([c[start:stop] for c in copies], op, total, n if average else None)
            for c in copies:
                c[start:stop] = total
        self.raise_flag(i, REDUCED, k, ctx.counts)
        yield self.wait_for(i, REDUCED, k)
        self.win.Sync()
        moved = (n - 1) * (b - a) * dtype.itemsize + (copies[r].size - (b - a)) * dtype.itemsize
        ctx.counts.bytes_sent += moved  # my chunk written into N-1 arrays; the rest of mine read by others
        ctx.counts.bytes_received += moved


def allocate(world, shapes: list[tuple[int, np.dtype]]) -> list[np.ndarray] | None:
    """Zeroed arrays of `shapes`, registered over `world` (collective); None when its ranks do
    not all share this machine (then there is nothing to register with)."""
    if shared_memory.window_or_none(world) is None:
        return None
    return Registered(world, shapes).arrays


def find(buf: np.ndarray):
    """(Registered, index) when `buf` is a registered array itself, else None."""
    found = _BY_ID.get(id(buf))
    if found is not None and found[0].arrays is not None and found[0].arrays[found[1]] is buf:
        return found
    return None


def all_reduce_registered(found, buf, ufunc, array, async_op, average):
    """Drive the protocol for a registered array (collectives.all_reduce calls this)."""
    registered, i = found
    ctx = reused_context(registered, "all_reduce.shared_memory")
    return _run(ctx, registered.all_reduce_steps(ctx, i, ufunc, average), array, async_op)
