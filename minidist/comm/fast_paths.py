"""Hot-path shortcuts of the collectives, kept apart from the plain code (chapter 7).

The plain collectives (collectives.py) drive every algorithm the same way: a call context, a
generator of steps, a wait per step. That machinery costs about 2 µs of Python per call, as long
as MPI's whole all-reduce of 1 KB on two ranks. For the cases where that dominates, this file
does the same work straight; `shortcut` says which way a call takes:

- `window_small`: an array of at most 64 KB through the shared-memory window (shared_memory.py)
  is one handshake: copy in, raise a flag, wait for every flag, add up. The same two methods the
  protocol's generator calls (`SharedWindow.arrive_small`, `add_up_small`), called in a row.
  What `auto` runs for every small array on one machine.

- `window_straight`: a blocking all-reduce of one larger piece through the window, its protocol
  (`SharedWindow.all_reduce_piece`, the same generator) driven by a plain loop instead of the
  call machinery, when no asynchronous call is in flight on the window.

- `exchange_two`: an all-reduce on two ranks by recursive doubling is a single exchange and one
  add (algorithms.all_reduce_recursive_doubling with N = 2), posted with the call's own tag,
  counted under the same traffic kind, waited for politely, a timeout naming the peer as the
  plain path does. Arrays below the staging size only (larger ones are the plain path's).

One switch: `ENABLED` (`use_fast_paths(False)`, or MINIDIST_COMM_FAST_PATHS=0 in the environment)
sends every call down the plain path; tests/test_comm_fast_paths.py checks that both give the
same bits and the same counters. A recording trace (chapter 5) always takes the plain path, which
it instruments.
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from minidist.comm import shared_memory, traffic
from minidist.comm.algorithms import STAGE_BYTES
from minidist.comm.waiting import Request, poll, poll_until

ENABLED = [os.environ.get("MINIDIST_COMM_FAST_PATHS", "1") != "0"]
_BYTE = MPI.BYTE
_testall = MPI.Request.Testall


def use_fast_paths(on: bool) -> None:
    """Turn the shortcuts on or off for this process (every rank must agree)."""
    ENABLED[0] = bool(on)


def shortcut(world, buf: np.ndarray, algorithm: str, async_op: bool, recording: bool):
    """Which of the straight ways below takes this all-reduce call: a function
    f(world, buf, ufunc, average), or None for the plain path."""
    if not ENABLED[0] or async_op or recording:
        return None
    if algorithm == "shared_memory":
        shared = world.cache.get("shared_window")  # made by the group's first call, on the plain path
        if shared is None or shared.ctx is None or shared.in_flight is not None or buf.nbytes > shared.capacity:
            return None  # not made yet, several pieces, or behind an asynchronous call
        return window_small if buf.nbytes <= shared_memory.SMALL else window_straight
    if algorithm == "recursive_doubling" and world.size == 2 and buf.nbytes < STAGE_BYTES:
        return exchange_two
    return None


def exchange_two(world, buf: np.ndarray, ufunc, average: bool) -> None:
    """All-reduce `buf` in place on a group of two: swap with the other rank, then `ufunc` (the
    same on both sides: a + b == b + a exactly, so both ranks hold the same bits); `average`:
    then halve."""
    kind = "all_reduce.recursive_doubling"
    peer, comm, tag = 1 - world.rank, world.coll_comm, world.next_tag()
    cache = world.cache
    theirs = _receive_buffer(cache, buf)
    requests = [comm.Irecv([theirs, _BYTE], peer, tag), comm.Isend([buf, _BYTE], peer, tag)]
    if not _testall(requests):
        poll(requests, None, lambda: [Request(requests[0], "recv", peer, tag, buf.nbytes, kind, world),
                                      Request(requests[1], "send", peer, tag, buf.nbytes, kind, world)])
    counts = cache.get(kind)
    if counts is None:
        counts = cache[kind] = traffic.counter(traffic.labelled(kind, world))
    counts.calls += 1
    counts.messages += 1
    counts.messages_received += 1
    counts.bytes_sent += buf.nbytes
    counts.bytes_received += buf.nbytes
    ufunc(buf, theirs, buf)
    if average:
        np.divide(buf, 2, buf)


def _receive_buffer(cache: dict, buf: np.ndarray) -> np.ndarray:
    """Where the peer's array lands: kept per (dtype, size) on the group, since each call ends
    before it returns (a fresh array costs a small call's half microsecond). A few dozen are
    kept; a stream of ever new sizes gets fresh arrays."""
    buffers = cache.get("exchange buffers")
    if buffers is None:
        buffers = cache["exchange buffers"] = {}
    key = (buf.dtype, buf.size)
    theirs = buffers.get(key)
    if theirs is None:
        theirs = np.empty_like(buf)
        if len(buffers) < 64:  # at most 64 x STAGE_BYTES held
            buffers[key] = theirs
    return theirs


def window_small(world, buf: np.ndarray, ufunc, average: bool) -> None:
    """`window_straight` for an array of at most shared_memory.SMALL bytes: the window's one
    handshake (copy in, raise the flag, wait for every flag, add up) with no generator at all,
    through the same two methods the protocol's generator calls."""
    shared = world.cache["shared_window"]
    counts = shared.ctx.counts
    counts.calls += 1
    shared.calls += 1
    k = shared.calls
    slots = shared.views(k & 1, buf.dtype, buf.size)[0]
    shared.arrive_small(slots, buf, k, counts)
    flags = shared.wait_for(shared_memory.ARRIVED, k)
    if not flags.test():
        poll_until(flags.test, None, flags.timed_out, busy=shared_memory.BUSY)
    shared.add_up_small(slots, buf, ufunc, average, counts)


def window_straight(world, buf: np.ndarray, ufunc, average: bool) -> None:
    """All-reduce `buf` (one piece) in place through the group's shared window: the window's own
    steps, each flag waited for politely, counted as the plain path counts them."""
    shared = world.cache["shared_window"]
    ctx = shared.ctx
    ctx.counts.calls += 1
    for flags in shared.all_reduce_piece(ctx, buf, ufunc, average):
        if not flags.test():
            poll_until(flags.test, None, flags.timed_out, busy=shared_memory.BUSY)

