"""Point-to-point messages (chapter 02: point-to-point vs collectives).

One idea: a message goes from one rank to another, and the receiver must *wait* for it.
Everything else in minidist.comm (every collective) is built from the few functions here:
`isend`/`irecv` post a message and return at once with a `Request`; `wait` blocks until
requests complete; `send`, `recv` and `sendrecv` are the blocking spellings.

We use mpi4py's fast *buffer* API (uppercase `Isend`/`Irecv`): the bytes of a NumPy array go
straight to MPI, with no pickling. (The lowercase API pickles Python objects: slow for arrays,
and e.g. `comm.allreduce(ndarray, op=MPI.MAX)` fails on them.) Arrays are sent as raw bytes
(`MPI.BYTE`), so any dtype works, float16 included; both sides must agree on dtype and size.

Every wait here (`wait`, `Request.wait`, and the blocking spellings) is the polite, timed wait of
waiting.py: it does not burn a core while the peer is busy, and it raises `CommTimeout` instead
of hanging. `wait`, `Request`, `set_wait_policy` and `CommTimeout` can be imported from here too.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from minidist import timeline
from minidist.comm import traffic
from minidist.comm.errors import CommTimeout  # noqa: F401  (re-exported)
from minidist.comm.waiting import Request, poll, poll_until, set_wait_policy, wait, wait_policy  # noqa: F401
from minidist.comm.world import World, resolve


def _as_bytes(array: np.ndarray):
    if not array.flags.c_contiguous:
        raise ValueError(f"minidist sends contiguous arrays only; got strides {array.strides} for shape {array.shape}")
    return [array, MPI.BYTE]


def isend(array: np.ndarray, dst: int, tag: int = 0, group: World | None = None, *,
          kind: str = "send", comm: MPI.Comm | None = None) -> Request:
    """Post a send of `array` to rank `dst`; returns at once. Do not modify `array` until the
    request completes. `comm` is used by the collectives (their private communicator)."""
    world = resolve(group)
    posted = time.perf_counter()
    req = (comm or world.comm).Isend(_as_bytes(array), dst, tag)
    kind = traffic.labelled(kind, world)
    traffic.record_send(kind, array.nbytes)  # every message is counted
    return _traced(Request(req, "send", dst, tag, array.nbytes, kind, world), posted, comm)


def irecv(array: np.ndarray, src: int, tag: int = 0, group: World | None = None, *,
          kind: str = "recv", comm: MPI.Comm | None = None) -> Request:
    """Post a receive into the preallocated `array` from rank `src`; returns at once."""
    world = resolve(group)
    posted = time.perf_counter()
    req = (comm or world.comm).Irecv(_as_bytes(array), src, tag)
    kind = traffic.labelled(kind, world)
    traffic.record_recv(kind, array.nbytes)
    return _traced(Request(req, "recv", src, tag, array.nbytes, kind, world), posted, comm)


def _traced(request: Request, posted: float, comm) -> Request:
    """While a trace records (chapter 5), tell it of the message: a send is one end of an arrow,
    the receive (when it is seen complete, waiting.py) the other."""
    if timeline.RECORDER is not None:
        timeline.RECORDER.posted(request, posted, comm is not None)
    return request


# -- the blocking spellings ------------------------------------------------------------------

def send(array: np.ndarray, dst: int, tag: int = 0, group: World | None = None, timeout=None):
    """Send `array` to rank `dst` and wait until its buffer may be reused."""
    wait(isend(array, dst, tag, group), timeout)


def recv(array: np.ndarray, src: int, tag: int = 0, group: World | None = None, timeout=None) -> np.ndarray:
    """Receive from rank `src` into the preallocated `array` (shape and dtype agreed beforehand)."""
    wait(irecv(array, src, tag, group), timeout)
    return array


def sendrecv(send_array: np.ndarray, dst: int, recv_array: np.ndarray, src: int, tag: int = 0,
             group: World | None = None, timeout=None) -> np.ndarray:
    """Send to `dst` and receive from `src` at the same time. Posting both before waiting is
    what makes a ring deadlock-free: if every rank did a blocking send first, large messages
    (which MPI does not buffer) would leave every rank waiting for its neighbour to receive."""
    ### BEGIN SOLUTION assignment=sendrecv
    r = irecv(recv_array, src, tag, group)
    s = isend(send_array, dst, tag, group)
    wait([r, s], timeout)
    ### END SOLUTION
    return recv_array
