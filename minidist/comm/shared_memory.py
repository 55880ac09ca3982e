"""All-reduce through shared memory: how a collective runs inside one machine (chapter 07).

One idea: processes on one machine need not send each other messages at all. They can map
the same pages (MPI-3 shared windows, `MPI.Win.Allocate_shared`), write their arrays there and
read each other's directly. A message between two local processes costs a copy *plus* a
handshake per message, and for large ones MPICH's single-copy path has the peer's kernel
read our pages (chapter 07 measures what that costs the sender); a shared page costs just
the copy. MPICH's own intra-node collectives and NCCL inside a node work this way, which is
why a message-only algorithm in Python could not keep up with them. minidist's
`all_reduce(algorithm="auto")` uses this whenever every rank of the group is on one machine.

The protocol for one array of S bytes on N ranks, in call number k (every rank of the group
makes the same calls in the same order, so every rank counts the same k):

  1. rank r copies its array into its slot r of the window (large arrays: all but the chunk r
     it reduces itself, which nobody else reads) and raises its flag: arrived[r] = k;
  2. it waits until every arrived[j] >= k: all N arrays are in memory;
  3. small arrays (up to SMALL bytes): every rank adds up all N slots itself, in the order
     0, 1, ..., N-1, so every rank gets the same bits. One handshake, done.
     Large arrays: rank r adds up only its chunk r of the N slots (a reduce-scatter) into a
     shared result, raises reduced[r] = k, waits for everyone's, and copies the whole result
     (an all-gather). Each rank reads 2(N-1)/N x S bytes that others wrote, like the ring.

Three details make it correct:
* `>= k`, not `== k`: a fast rank may already have raised its flag for call k+1 before a slow
  one looks.
* Two sets of slots, by the parity of k: after one handshake a fast rank may start call k+1
  while a slow one still reads call k, so k+1 writes the other set. It cannot get two calls
  ahead: call k+2 starts only after every rank raised its flag in k+1, i.e. finished k.
  That needs each rank to finish its calls in order: a new call first completes any
  asynchronous one still in flight on this window (collectives.all_reduce does it).
* Memory order: the data must be visible before the flag. x86 keeps stores in order; the
  window's `Sync` (a memory barrier) makes it hold on any CPU.

Arrays larger than a piece (128 KB x N^2, or the tuning table's measured piece) go through the
window piece after piece, one call number each. Traffic is counted as the bytes other ranks read
of what this rank wrote, so that it compares with the message algorithms (kind
"all_reduce.shared_memory").
"""
from __future__ import annotations

import atexit

import numpy as np
from mpi4py import MPI

from minidist.comm import tuning
from minidist.comm.algorithms import chunk_bounds
from minidist.comm.errors import CommTimeout
from minidist.comm.world import global_rank

LINE = 64          # one flag per cache line, so raising mine does not disturb my neighbour's
SMALL = 64 << 10   # up to this size: one handshake, everyone reduces everything
# Large arrays go in pieces of 128 KB x N^2 (512 KB on 2 ranks, 2 MB on 4): small enough to stay
# in the CPU's cache between the copies and the adds, large enough that the handshakes (which
# grow with N: more ranks must be scheduled on the same cores) stay a small part of each piece.
# A tuning table's measured piece replaces it (tuning.py, `bench collectives --tune`).
PIECE_PER_RANK_SQUARED = 128 << 10
ARRIVED, REDUCED = 0, 1
# Waiting for a flag yields the core at once instead of polling flat out for the polite wait's
# 5 us first (waiting.py): the rank that will raise it shares our core as often as not (4 ranks
# on 2 cores).
BUSY = 0.0


def available(world) -> bool:
    """True when every rank of `world` runs on this machine (decided once per World; the first
    call is a collective, made inside the first all_reduce every rank makes)."""
    return window_or_none(world) is not None


def window_or_none(world) -> "SharedWindow | None":
    """The group's shared window, or None when its ranks do not all share this machine."""
    cache = world.cache
    if "shared_window" not in cache:
        node = world.coll_comm.Split_type(MPI.COMM_TYPE_SHARED)
        if node.Get_size() == world.size:  # the same answer on every rank of the group
            cache["shared_window"] = SharedWindow(world, node)
            _OPEN.append(cache["shared_window"])
            if len(_OPEN) == 1:
                atexit.register(free_all)  # runs before mpi4py's MPI_Finalize
        else:
            node.Free()
            cache["shared_window"] = None
    return cache["shared_window"]


_OPEN: list = []  # every SharedWindow of this process, in the order the groups made them


def free_all():
    """Close every window's epoch, free it and its node communicator (chapter 07). The MPI
    standard wants this done before MPI_Finalize; left open, finalizing MPICH's TCP transport
    fails and the job exits non-zero although its results are right. Freeing is collective
    over each window's ranks; every rank freeing in the order the windows were made cannot
    deadlock, because making them was collective in that same order."""
    if MPI.Is_finalized():
        return
    while _OPEN:
        shared = _OPEN.pop(0)
        shared.free()
        shared.node.Free()
        shared.world.cache.pop("shared_window", None)


def window(world) -> "SharedWindow":
    shared = window_or_none(world)
    if shared is None:
        raise ValueError(f"all_reduce: algorithm='shared_memory' needs every rank of the group on one "
                         f"machine; rank {world.rank} of {world.size} shares memory with fewer")
    return shared


class FlagWait:
    """What the shared-memory all-reduce waits for: every rank's flag `row` at call k or later.
    The collectives' drivers poll `test()` where message algorithms give MPI requests, and
    call `timed_out(seconds)` to raise when it takes too long."""

    __slots__ = ("window", "row", "k", "flags")

    def __init__(self, window, row, k):
        self.window, self.row, self.k = window, row, k
        self.flags = window.flag_rows[row]

    def test(self) -> bool:
        # min of a memoryview: several times cheaper than a NumPy reduction on a few flags, and
        # a small all-reduce polls this many times
        return min(self.flags) >= self.k

    def timed_out(self, waited):
        flags = self.window.flags[self.row]
        late = [j for j in range(flags.size) if flags[j] < self.k]
        what = "arrive with its array" if self.row == ARRIVED else "reduce its chunk"
        raise CommTimeout(
            f"rank {self.window.rank} of {self.window.size} (world rank {global_rank()}) timed out after "
            f"{waited:.1f} s in the shared-memory all_reduce, call {self.k}, waiting for rank(s) {late} "
            f"to {what}. Are they alive, and did they make the same call?")


class SharedWindow:
    """One MPI shared window per group: two flag rows, two sets of N slots, one result."""

    def __init__(self, world, node_comm):
        self.world, self.node = world, node_comm
        self.rank, self.size = node_comm.Get_rank(), node_comm.Get_size()
        self.calls = 0          # call numbers k (equal on every rank)
        self.in_flight = None   # the asynchronous Work still using the window, if any
        self.ctx = None         # the collectives' call context, made once (collectives._run_in_order)
        self.capacity, self.win = 0, None
        self.piece = tuning.piece(self.size) or PIECE_PER_RANK_SQUARED * self.size ** 2

    def set_piece(self, nbytes: int):
        """Send large arrays through in pieces of `nbytes` from the next call on (collective: every
        rank of the group, at the same point; `bench collectives --tune` times several)."""
        if self.in_flight is not None:
            raise RuntimeError("set_piece: an asynchronous all_reduce still uses the window; wait for it first")
        self.free()
        self.piece = nbytes

    def ensure(self, nbytes: int):
        """Grow the window to hold a piece of min(nbytes, self.piece) bytes. Allocating is a
        collective call; every rank sees the same sizes in the same order, so all grow together."""
        if nbytes <= self.capacity:
            return
        need = -(-min(nbytes, self.piece) // LINE) * LINE
        if need <= self.capacity:
            return
        capacity = max(need, min(2 * self.capacity, self.piece), SMALL)
        self.free()
        n, flag_bytes = self.size, 2 * self.size * LINE
        total = flag_bytes + (2 * n + 1) * capacity
        self.win = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=self.node)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch, in which Sync is a memory barrier
        memory = np.frombuffer(self.win.Shared_query(0)[0], np.uint8)
        self.flags = memory[:flag_bytes].view(np.int64).reshape(2, n, LINE // 8)[:, :, 0]
        words, stride = memoryview(memory[:flag_bytes]).cast("q"), LINE // 8
        self.flag_rows = [words[row * n * stride:(row + 1) * n * stride:stride] for row in range(2)]
        self.slot_bytes = memory[flag_bytes:flag_bytes + 2 * n * capacity].reshape(2, n, capacity)
        self.result_bytes = memory[flag_bytes + 2 * n * capacity:]
        self.capacity, self.calls, self._views = capacity, 0, {}
        self.waits = [FlagWait(self, ARRIVED, 0), FlagWait(self, REDUCED, 0)]  # reused: calls run in order
        self.flags[:, self.rank] = 0
        self.node.Barrier()  # every flag is zero before anyone raises one

    def free(self):
        """End the passive epoch and free the window (collective over the node's ranks)."""
        if self.win is not None:
            for row in self.flag_rows:
                row.release()
            self.flags = self.flag_rows = self.slot_bytes = self.result_bytes = self._views = None
            self.win.Unlock_all()
            self.win.Free()
            self.win, self.capacity = None, 0

    def raise_flag(self, row, k, counts):
        self.win.Sync()  # my data first, then my flag
        self.flag_rows[row][self.rank] = k
        counts.messages += 1  # a raised flag is this protocol's message (N-1 others read it)

    def wait_for(self, row, k) -> FlagWait:
        wait = self.waits[row]
        wait.k = k
        return wait

    def views(self, parity, dtype, count):
        """([slot of rank j for j in 0..N-1], result) as arrays of `count` elements of `dtype`;
        made once per (parity, dtype, count): building NumPy views costs more than the 1 KB copy."""
        key = (parity, dtype, count)
        found = self._views.get(key)
        if found is None:
            nbytes = count * dtype.itemsize
            slots = self.slot_bytes[parity, :, :nbytes].view(dtype)
            found = self._views[key] = (list(slots), self.result_bytes[:nbytes].view(dtype))
        return found

    def arrive_small(self, slots, x, k, counts):
        """A small array's step 1: copy it into my slot, then raise my flag."""
        slots[self.rank][...] = x  # (a plain assignment: a third of np.copyto's cost at 1 KB)
        self.raise_flag(ARRIVED, k, counts)

    def add_up_small(self, slots, x, op, average, counts):
        """A small array's step 3, once every flag is up: x = the slots added up in rank order."""
        n = self.size
        self.win.Sync()  # their flags seen, now their data
        _reduce(slots, op, x, n if average else None)
        counts.bytes_sent += (n - 1) * x.nbytes     # everyone read my whole slot
        counts.bytes_received += (n - 1) * x.nbytes

    def all_reduce_piece(self, ctx, x, op, average=False):
        """The protocol above for one piece x (at most `capacity` bytes), as a generator that
        yields a FlagWait wherever it must wait for the other ranks. `average`: divide the sum
        by N (op="avg"), each rank only the part it reduced, while that part is in cache."""
        self.calls += 1
        k, n, r = self.calls, self.size, self.rank
        slots, result = self.views(k & 1, x.dtype, x.size)  # slots[j] is rank j's
        counts = ctx.counts
        if x.nbytes <= SMALL:  # everyone adds up everything, in the same order
            self.arrive_small(slots, x, k, counts)
            yield self.wait_for(ARRIVED, k)
            self.add_up_small(slots, x, op, average, counts)
            return
        # Large: the others read only their chunks of my slot, so only those are copied in; my own
        # chunk I add up straight from my array (the same values in the same order: the same bits).
        a, b = chunk_bounds(x.size, n)[r]
        np.copyto(slots[r][:a], x[:a])
        np.copyto(slots[r][b:], x[b:])
        self.raise_flag(ARRIVED, k, counts)
        yield self.wait_for(ARRIVED, k)
        self.win.Sync()  # their flags seen, now their data
        mine = result[a:b]
        _reduce([x[a:b] if j == r else s[a:b] for j, s in enumerate(slots)], op, mine, n if average else None)
        np.copyto(x[a:b], mine)  # still in the cache
        self.raise_flag(REDUCED, k, counts)
        yield self.wait_for(REDUCED, k)
        self.win.Sync()
        np.copyto(x[:a], result[:a])
        np.copyto(x[b:], result[b:])
        mine_bytes = (b - a) * x.itemsize  # others read their chunks of my slot, then my chunk of the result
        moved = (x.nbytes - mine_bytes) + (n - 1) * mine_bytes
        counts.bytes_sent += moved
        counts.bytes_received += moved


def _reduce(pieces: list, op, out: np.ndarray, divide_by: int | None) -> None:
    """out = op(pieces[0], pieces[1], ...), in rank order, then / divide_by. 16-bit floats are
    sent as 16-bit words but summed in fp32 and rounded once (chapter 10): N - 1 roundings to
    fp16 or bf16 along the way would add N - 1 errors of half an epsilon each."""
    if op is np.add and sixteen_bit(out.dtype):
        total = pieces[0].astype(np.float32)
        for piece in pieces[1:]:
            total += piece
        if divide_by:
            total /= divide_by
        out[...] = total
        return
    op(pieces[0], pieces[1], out)  # out positional: a keyword costs a small call a tenth of a microsecond
    for piece in pieces[2:]:
        op(out, piece, out)
    if divide_by:
        np.divide(out, divide_by, out=out)


def sixteen_bit(dtype) -> bool:
    """float16 or bfloat16? Remembered per dtype: NumPy's `dtype.name` takes microseconds."""
    known = _SIXTEEN_BIT.get(dtype)
    if known is None:
        known = _SIXTEEN_BIT[dtype] = dtype.name in ("float16", "bfloat16")
    return known


_SIXTEEN_BIT: dict = {}


def all_reduce_shared_memory(ctx, buf, op, average=False):
    """All-reduce `buf` in place through the group's shared window, piece by piece. Nothing
    runs before the first step is asked for, so a call queued behind another (`after`) grows
    the window only once that one is done."""
    shared = window(ctx.world)
    shared.ensure(buf.nbytes)
    step = shared.capacity // buf.itemsize
    for start in range(0, buf.size, step):
        yield from shared.all_reduce_piece(ctx, buf[start:start + step], op, average)


class AfterWork:
    """Waits for an earlier asynchronous call on the same window (calls run in order)."""

    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def test(self) -> bool:
        return self.work.test()  # advances the earlier call as far as it can go

    def timed_out(self, waited):
        self.work.timed_out(waited)  # the earlier call's own timeout, naming its ranks, after `waited` s


def after(work, steps):
    """`steps`, started only once `work` (an earlier call on this window) has finished."""
    yield AfterWork(work)
    yield from steps
