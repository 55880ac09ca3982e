"""Collectives in the spirit of torch.distributed, on NumPy arrays (chapters 02 and 07).

One idea: a *collective* (集合通信) is a call that every rank of a group makes together and
that moves data among all of them; here each one is a schedule of point-to-point messages
(see algorithms.py) driven step by step (driver.py) with the polite wait of waiting.py.

    all_reduce(x, op="sum", group=None, algorithm="auto", async_op=False) -> x (in place)
    reduce(x, dst=0, op="sum", ...)            -> x (result on dst; others untouched)
    broadcast(x, src=0, ...)                   -> x (in place)
    reduce_scatter(x, op="sum", ..., out=None) -> my chunk of the reduced x (np.array_split)
    all_gather(x, ..., out=None)               -> concatenation of every rank's x
    all_to_all(x, ..., out=None)               -> chunk r of every rank's x, by source rank
    barrier(group=None)

Every array is seen as its flat sequence of elements (C order) and must be C-contiguous.
Ops: "sum", "avg" (sum / N, float dtypes only), "max", "min". With `async_op=True` the call
returns a `Work` (`test()` / `is_completed()` advance it without blocking, `wait()` finishes
it and returns the result) so compute can overlap with communication.

Before any message, a cheap consistency check (consistency.py) makes a call with different
sizes or dtypes on different ranks raise `CollectiveMismatch` on *every* rank, naming what
each rank passed, instead of deadlocking or returning garbage; on a group a strategy verified
when it was built (`World.verify`) the check is skipped.
"""
from __future__ import annotations

import contextlib

import numpy as np

from minidist import timeline
from minidist.comm import algorithms as alg
from minidist.comm import fast_paths, hierarchical, registered, shared_memory, tuning
from minidist.comm.consistency import (CollectiveMismatch, check_consistent, needs_check,  # noqa: F401
                                       set_check, unchecked)
from minidist.comm.cost import AUTO_CANDIDATES, AUTO_COST, auto_algorithm  # noqa: F401  (re-exported)
from minidist.comm.driver import Work, _Ctx, _run, reused_context  # noqa: F401  (Work re-exported)
from minidist.comm.world import World, resolve

OPS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}

ALL_REDUCE = {
    "naive": alg.all_reduce_naive,
    "tree": alg.all_reduce_tree,
    "recursive_doubling": alg.all_reduce_recursive_doubling,
    "halving_doubling": alg.all_reduce_halving_doubling,
    "ring": alg.all_reduce_ring,
    "shared_memory": shared_memory.all_reduce_shared_memory,
    "hierarchical": hierarchical.all_reduce_hierarchical,
}
BROADCAST = {"tree": alg.broadcast_tree, "naive": alg.broadcast_naive}
REDUCE = {"tree": alg.reduce_tree, "naive": alg.reduce_naive}
_NAMES = tuple(ALL_REDUCE)
_REGISTERED_BY = ("auto", "shared_memory")  # the algorithm names under which a registered array goes registered
_KIND = {name: f"all_reduce.{name}" for name in ALL_REDUCE}  # the traffic kinds, made once


def _flat(array: np.ndarray, name: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} takes a NumPy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} needs a C-contiguous array (use np.ascontiguousarray); got strides {array.strides}")
    return array if array.ndim == 1 else array.reshape(-1)  # a view: results land in the caller's array


def _sixteen_bit(dtype) -> bool:
    return shared_memory.sixteen_bit(np.dtype(dtype))


def _predivide(array: np.ndarray, n: int, out: np.ndarray):
    """op="avg" of 16-bit floats (chapter 10) divides before it sums, as DeepSpeed's gradient
    pre-division does: N values each below max/N cannot overflow where their sum would (fp16
    tops out at 65504), and for N a power of two the division is exact. Returns the sum ufunc."""
    np.multiply(array, np.float32(1.0 / n), out=out, casting="unsafe")
    return OPS["sum"]


def _op(op: str, dtype, name: str):
    if (op, dtype) in _CHECKED:  # every call checks: remembered, since the check costs a small call's microsecond
        return OPS[op]
    if op not in OPS:
        raise ValueError(f"{name}: unknown op {op!r}; choose from {sorted(OPS)}")
    floating = np.issubdtype(dtype, np.floating) or np.dtype(dtype).name == "bfloat16"  # ml_dtypes' (chapter 10)
    if op == "avg" and not floating:
        raise TypeError(f"{name}: op='avg' needs a floating dtype, got {dtype} (use 'sum' and divide)")
    _CHECKED.add((op, dtype))
    return OPS[op]


_CHECKED: set = set()  # (op, dtype) pairs _op has accepted


# -- the collectives -------------------------------------------------------------------------

def all_reduce(array: np.ndarray, op: str = "sum", group: World | None = None,
               algorithm: str | None = None, async_op: bool = False):
    """Reduce `array` over all ranks of `group`, in place; every rank gets the result.
    algorithm: "naive", "tree", "recursive_doubling", "halving_doubling", "ring",
    "shared_memory", "hierarchical", "auto" (`choose_all_reduce` says what it picks), or None: the process's
    default, "auto" unless `all_reduce_algorithm(name)` says otherwise."""
    world, buf = resolve(group), _flat(array, "all_reduce")
    ufunc = _op(op, buf.dtype, "all_reduce")
    algorithm = _DEFAULT_ALGORITHM[0] if algorithm is None else algorithm
    if algorithm not in ALL_REDUCE and algorithm != "auto":
        raise ValueError(f"all_reduce: unknown algorithm {algorithm!r}; choose from {sorted(ALL_REDUCE)} or 'auto'")
    if needs_check(group):
        check_consistent(world, "all_reduce", buf.size, buf.dtype, op, algorithm=algorithm)
    if op == "avg" and _sixteen_bit(buf.dtype):
        op, ufunc = "sum", _predivide(buf, world.size, buf)
    finish = (lambda: np.divide(buf, world.size, out=buf)) if op == "avg" else None
    if world.size == 1 or buf.size == 0:
        return _run(None, None, array, async_op, finish)
    # an array that lives in shared memory (registered.py): no copies, so `auto` takes it at every size
    # above the window's one-handshake path, also where the window's copies would lose to messages
    found = registered.find(buf) if buf.nbytes > shared_memory.SMALL and algorithm in _REGISTERED_BY else None
    if found is not None:
        return registered.all_reduce_registered(found, buf, ufunc, array, async_op, average=(op == "avg"))
    algorithm = choose_all_reduce(algorithm, world, buf.nbytes)
    straight = fast_paths.shortcut(world, buf, algorithm, async_op, timeline.RECORDER is not None)
    if straight is not None:  # the same work without the step machinery (chapter 7)
        straight(world, buf, ufunc, op == "avg")
        return array
    if algorithm == "shared_memory":  # it divides each reduced chunk itself, while the chunk is in cache
        return _run_in_order(shared_memory.window(world), buf, ufunc, array, async_op, average=(op == "avg"))
    ctx = _Ctx(world, _KIND[algorithm])
    return _run(ctx, ALL_REDUCE[algorithm](ctx, buf, ufunc), array, async_op, finish)


def choose_all_reduce(algorithm: str, world: World, nbytes: int) -> str:
    """What algorithm="auto" means, in one place (chapter 7).

    On one machine, the shared-memory window: every rank adds its share straight into the
    others' memory, no messages at all (shared_memory.py); except for two ranks and an array
    from 4 MB, where halving-doubling's messages (each copied once, process to process) are
    faster. Across machines with several ranks
    on some machine, the hierarchical all-reduce: reduce inside each machine, all-reduce among
    one leader per machine, broadcast inside (hierarchical.py), so that few bytes cross the
    expensive links. One rank per machine: the message algorithm the alpha-beta model
    (cost.py) predicts fastest for this size and group size (`cost.auto_algorithm`): recursive
    doubling for small arrays, halving-doubling or the ring for large ones. Every rank
    computes the same answer from the same numbers.

    With a tuning table (MINIDIST_TUNING, tuning.py, written by `bench collectives --tune`) the
    algorithm measured fastest for this group and size comes first. (A registered array above
    64 KB never asks: `all_reduce` takes registered.py's copy-free path for it first.)"""
    if algorithm != "auto":
        return algorithm
    # the answer depends only on the group and the size: worked out once per size (a small call's microsecond)
    remembered = world.cache.get("auto")
    if remembered is None:
        remembered = world.cache["auto"] = {}
    chosen = remembered.get(nbytes)
    if chosen is None:
        chosen = _auto_choice(world, nbytes)
        if len(remembered) < 1024:  # a job's sizes are few; a stream of ever new ones is not kept
            remembered[nbytes] = chosen
    return chosen


def _auto_choice(world: World, nbytes: int) -> str:
    """choose_all_reduce's answer for algorithm="auto", worked out."""
    if tuning.table_path() is not None:
        tuned = tuning.lookup(world.size, len(hierarchical.hierarchy(world).per_node), nbytes, known=_NAMES)
        if tuned is not None and (tuned != "shared_memory" or shared_memory.window_or_none(world) is not None):
            return tuned
    if shared_memory.window_or_none(world) is not None:
        if world.size == 2 and nbytes >= LARGE_FOR_TWO:
            # MPI hands a large message from process to process in one copy; the window needs
            # every byte copied in and read out again
            return "halving_doubling"
        return "shared_memory"
    if hierarchical.hierarchy(world).spans_nodes_with_neighbours:
        return "hierarchical"
    return auto_algorithm(nbytes, world.size)


LARGE_FOR_TWO = 4 << 20   # measured (2 ranks): from here halving-doubling's messages beat the window

_DEFAULT_ALGORITHM = ["auto"]


@contextlib.contextmanager
def all_reduce_algorithm(name: str):
    """`with all_reduce_algorithm("ring"): ...` makes every all-reduce below that names no
    algorithm (every strategy's) use `name`: how the demo's `--algorithm` runs a strategy over
    the ring of chapter 7 instead of the shared-memory window."""
    if name not in ALL_REDUCE and name != "auto":
        raise ValueError(f"unknown all-reduce algorithm {name!r}; choose from {sorted(ALL_REDUCE)} or 'auto'")
    previous, _DEFAULT_ALGORITHM[0] = _DEFAULT_ALGORITHM[0], name
    try:
        yield
    finally:
        _DEFAULT_ALGORITHM[0] = previous


def _run_in_order(shared, buf, ufunc, array, async_op, average):
    """Drive the shared-memory all-reduce. Calls on one window must finish in order
    (shared_memory.py), so a new call first lets the one in flight finish: now, if this call
    blocks; queued behind it, if this call is asynchronous. It posts no messages, so it needs
    no fresh tag: one call context serves every call on the window."""
    ctx = reused_context(shared, _KIND["shared_memory"])
    steps = shared_memory.all_reduce_shared_memory(ctx, buf, ufunc, average)
    before, shared.in_flight = shared.in_flight, None
    if before is not None:
        if async_op:
            steps = shared_memory.after(before, steps)
        else:
            before.wait()
    result = _run(ctx, steps, array, async_op)
    if async_op:
        shared.in_flight = result
    return result


def reduce(array: np.ndarray, dst: int = 0, op: str = "sum", group: World | None = None,
           algorithm: str = "tree", async_op: bool = False):
    """Reduce `array` over all ranks onto rank `dst` (in place there; other ranks' arrays are
    left as they were)."""
    world, buf = resolve(group), _flat(array, "reduce")
    ufunc = _op(op, buf.dtype, "reduce")
    _check_root(world, dst, "reduce")
    if needs_check(group):
        check_consistent(world, "reduce", buf.size, buf.dtype, op, dst, algorithm=algorithm)

    ctx = steps = None
    if world.size > 1 and buf.size > 0:
        ctx = _Ctx(world, f"reduce.{algorithm}")
        steps = REDUCE[algorithm](ctx, buf, dst, ufunc)
    finish = (lambda: np.divide(buf, world.size, out=buf)) if op == "avg" and world.rank == dst else None
    return _run(ctx, steps, array, async_op, finish)


def broadcast(array: np.ndarray, src: int = 0, group: World | None = None,
              algorithm: str = "tree", async_op: bool = False):
    """Copy rank `src`'s `array` into every rank's `array` (same shape and dtype everywhere)."""
    world, buf = resolve(group), _flat(array, "broadcast")
    _check_root(world, src, "broadcast")
    if needs_check(group):
        check_consistent(world, "broadcast", buf.size, buf.dtype, "", src, algorithm=algorithm)

    ctx = steps = None
    if world.size > 1 and buf.size > 0:
        ctx = _Ctx(world, f"broadcast.{algorithm}")
        steps = BROADCAST[algorithm](ctx, buf, src)
    return _run(ctx, steps, array, async_op)


def reduce_scatter(array: np.ndarray, op: str = "sum", group: World | None = None,
                   out: np.ndarray | None = None, algorithm: str = "ring", async_op: bool = False):
    """Reduce `array` over all ranks and give rank r only chunk r of the result, where the
    chunks are cut like np.array_split(array.ravel(), N). `array` is not modified; the
    chunk is returned (in `out` if given: 1-D, that chunk's size)."""
    world, buf = resolve(group), _flat(array, "reduce_scatter")
    ufunc = _op(op, buf.dtype, "reduce_scatter")
    if algorithm != "ring":
        raise ValueError(f"reduce_scatter: unknown algorithm {algorithm!r}; only 'ring'")
    a, b = alg.chunk_bounds(buf.size, world.size)[world.rank]
    if out is None:
        out = np.empty(b - a, dtype=buf.dtype)
    elif out.shape != (b - a,) or out.dtype != buf.dtype:
        raise ValueError(f"reduce_scatter: rank {world.rank} needs out of shape {(b - a,)} and dtype "
                         f"{buf.dtype}, got {out.shape} {out.dtype}")
    if needs_check(group):
        check_consistent(world, "reduce_scatter", buf.size, buf.dtype, op)
    if op == "avg" and _sixteen_bit(buf.dtype):  # on a copy: the caller's array stays as it was
        divided = np.empty_like(buf)
        op, ufunc = "sum", _predivide(buf, world.size, divided)
        buf = divided

    ctx = steps = None
    if buf.size > 0:
        ctx = _Ctx(world, "reduce_scatter.ring")
        steps = alg.reduce_scatter_ring(ctx, buf, ufunc, out)
    finish = (lambda: np.divide(out, world.size, out=out)) if op == "avg" else None
    return _run(ctx, steps, out, async_op, finish)


def all_gather(array: np.ndarray, group: World | None = None, out: np.ndarray | None = None,
               algorithm: str = "ring", async_op: bool = False):
    """Concatenate every rank's `array` (flattened) in rank order; every rank gets it all.
    Ranks may pass different counts. With `out` given (1-D, the total size), rank r's part
    is np.array_split(out, N)[r] and nothing but the data is exchanged; without it the
    counts are first shared with a small MPI Allgather (the consistency check)."""
    world, buf = resolve(group), _flat(array, "all_gather")
    if algorithm != "ring":
        raise ValueError(f"all_gather: unknown algorithm {algorithm!r}; only 'ring'")
    if out is None or needs_check(group):
        counts = check_consistent(world, "all_gather", buf.size, buf.dtype, same_count=False)
        total = int(counts.sum())
        bounds = [(int(counts[:r].sum()), int(counts[:r + 1].sum())) for r in range(world.size)]
        if out is None:
            out = np.empty(total, dtype=buf.dtype)
        elif out.shape != (total,) or out.dtype != buf.dtype or bounds != alg.chunk_bounds(total, world.size):
            raise ValueError(f"all_gather: with out of shape {out.shape} and {out.dtype}, every rank must pass "
                             f"its np.array_split part of dtype {out.dtype}; counts per rank were {counts.tolist()}")
    else:
        bounds = alg.chunk_bounds(out.size, world.size)
        a, b = bounds[world.rank]
        if b - a != buf.size or out.dtype != buf.dtype:
            raise ValueError(f"all_gather: rank {world.rank} must pass {b - a} elements of {out.dtype} for "
                             f"out of size {out.size}, got {buf.size} of {buf.dtype}")
    a, b = bounds[world.rank]
    out[a:b] = buf

    ctx = steps = None
    if out.size > 0:
        ctx = _Ctx(world, "all_gather.ring")
        steps = alg.all_gather_ring(ctx, out, bounds)
    return _run(ctx, steps, out, async_op)


def all_to_all(array: np.ndarray, group: World | None = None, out: np.ndarray | None = None,
               async_op: bool = False):
    """Cut `array` into N chunks like np.array_split; chunk j goes to rank j. Rank r gets
    the concatenation of every rank's chunk r, in source-rank order (all ranks pass the same
    count, so every chunk r has the same size)."""
    world, buf = resolve(group), _flat(array, "all_to_all")
    a, b = alg.chunk_bounds(buf.size, world.size)[world.rank]
    n_out = world.size * (b - a)
    if out is None:
        out = np.empty(n_out, dtype=buf.dtype)
    elif out.shape != (n_out,) or out.dtype != buf.dtype:
        raise ValueError(f"all_to_all: rank {world.rank} needs out of shape {(n_out,)} {buf.dtype}")
    if needs_check(group):
        check_consistent(world, "all_to_all", buf.size, buf.dtype)
    ctx = _Ctx(world, "all_to_all.pairwise")
    return _run(ctx, alg.all_to_all_pairwise(ctx, buf, out), out, async_op)


def barrier(group: World | None = None, timeout=None):
    """Return only when every rank of `group` has called barrier (dissemination algorithm)."""
    world = resolve(group)
    world.open_collectives(timeout)  # a first collective duplicates the communicator: same timeout
    ctx = _Ctx(world, "barrier.dissemination")
    _run(ctx, alg.barrier_dissemination(ctx), None, async_op=True).wait(timeout)


def any_rank(flag: bool, group: World | None = None) -> bool:
    """True on every rank if `flag` is true on any (an all-reduce MAX of one number): how ranks
    that each saw part of the gradients agree to skip a step together (chapter 10)."""
    value = np.array([1.0 if flag else 0.0])
    all_reduce(value, op="max", group=group)
    return bool(value[0])


def _check_root(world, root, name):
    if not 0 <= root < world.size:
        raise ValueError(f"{name}: root rank {root} is outside the group of {world.size} ranks")
