"""The collective algorithms, written only with point-to-point messages (chapter 07).

One idea: a collective is a schedule of point-to-point messages, step after step. Each
algorithm below is a Python *generator*: it posts the messages of one step (`ctx.send`,
`ctx.recv`), `yield`s the pending requests, and when it is resumed (all of them completed) it
reduces what arrived and posts the next step. Who drives it decides blocking or not:

* `collectives.all_reduce(x)` drives the generator to the end, waiting politely at each yield;
* `collectives.all_reduce(x, async_op=True)` returns a `Work` that advances it whenever it is
  polled (`work.test()`) and finishes it in `work.wait()`, so compute can run in between.

Every function works on flat, C-contiguous 1-D arrays (the caller flattens). `op` is a NumPy
ufunc (np.add, np.maximum, np.minimum) applied in place: `op(a, b, out=a)`. Ranks are
numbered 0..N-1 within the group; `ctx.rank`, `ctx.size`.

Uneven sizes: a count that N does not divide is cut like `np.array_split`: the first
`count % N` chunks hold one element more (`chunk_bounds`). Zero elements are fine.

Costs in the alpha-beta model (alpha = latency per message, beta = seconds per byte, S =
array bytes, N ranks; see cost.py and chapter 07):

    naive all-reduce      2(N-1) alpha + 2(N-1) S beta      (the root does all the talking)
    tree all-reduce       2 log2(N) alpha + 2 log2(N) S beta
    recursive doubling    log2(N) alpha + log2(N) S beta    (one exchange of S per round)
    halving-doubling      2 log2(N) alpha + 2 (N-1)/N S beta  (N a power of two)
    ring all-reduce       2(N-1) alpha + 2 (N-1)/N S beta   (bandwidth-optimal)
"""
from __future__ import annotations

import numpy as np


# Messages of this many bytes and more go by MPICH's single-copy path between processes of
# one machine (CMA, MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD): see all_reduce_recursive_doubling.
STAGE_BYTES = 8192


def chunk_bounds(count: int, n: int) -> list[tuple[int, int]]:
    """[(start, stop)] of n chunks of `count` elements, exactly as np.array_split cuts them."""
    q, r = divmod(count, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + q + (1 if i < r else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


# -- broadcast and reduce: trees rooted at `root` ---------------------------------------------

def broadcast_tree(ctx, buf, root):
    """Binomial tree: in round k every rank that has the data sends it to the rank 2**k
    further away (relative to the root), so the number of holders doubles every round:
    ceil(log2 N) rounds instead of N-1."""
    n, vr = ctx.size, (ctx.rank - root) % ctx.size  # vr: my rank counted from the root
    mask = 1
    while mask < n:  # find my parent: clear my lowest set bit
        if vr & mask:
            yield [ctx.recv(buf, (vr - mask + root) % n)]
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:  # my children are vr + 2**k for every 2**k below my lowest set bit
        if vr + mask < n:
            sends.append(ctx.send(buf, (vr + mask + root) % n))
        mask >>= 1
    if sends:
        yield sends


def broadcast_naive(ctx, buf, root):
    """The root sends the whole array to every other rank: N-1 messages leave one rank."""
    if ctx.rank == root:
        yield [ctx.send(buf, r) for r in range(ctx.size) if r != root]
    else:
        yield [ctx.recv(buf, root)]


def reduce_tree(ctx, buf, root, op):
    """Binomial tree, the broadcast tree run backwards: in round k, every rank whose bit k is
    set sends its partial result to the rank 2**k closer to the root and drops out.
    The root ends with the result in `buf`; other ranks' `buf` is left unchanged."""
    n, vr = ctx.size, (ctx.rank - root) % ctx.size
    acc, tmp, mask = buf, None, 1
    while mask < n:
        if vr & mask:
            yield [ctx.send(acc, (vr - mask + root) % n)]
            return
        if vr + mask < n:
            if tmp is None:
                tmp = np.empty_like(buf)
                if ctx.rank != root:
                    acc = buf.copy()  # keep the caller's array intact on non-root ranks
            yield [ctx.recv(tmp, (vr + mask + root) % n)]
            op(acc, tmp, out=acc)
        mask <<= 1


def reduce_naive(ctx, buf, root, op):
    """Every rank sends its array to the root, which adds them up one after another."""
    if ctx.rank != root:
        yield [ctx.send(buf, root)]
        return
    tmp = np.empty_like(buf)
    for r in range(ctx.size):
        if r != root:
            yield [ctx.recv(tmp, r)]
            op(buf, tmp, out=buf)


# -- all-reduce ------------------------------------------------------------------------------

def all_reduce_naive(ctx, buf, op):
    """Reduce everything to rank 0, then rank 0 sends the result to everyone."""
    yield from reduce_naive(ctx, buf, 0, op)
    yield from broadcast_naive(ctx, buf, 0)


def all_reduce_tree(ctx, buf, op):
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast from rank 0."""
    yield from reduce_tree(ctx, buf, 0, op)
    yield from broadcast_tree(ctx, buf, 0)


def all_reduce_recursive_doubling(ctx, buf, op):
    """In round k, rank r swaps its whole partial result with rank r XOR 2**k and both
    reduce: after log2(N) rounds everyone holds the total. Few messages (good for small
    arrays), but each carries all S bytes (bad for large ones).

    N not a power of two: with P the largest power of two <= N and E = N - P extra ranks,
    the first 2E ranks pair up (2i, 2i+1); the even one hands its data to the odd one and
    sits out; the P remaining ranks run the rounds; the odd ones hand the result back."""
    n, r = ctx.size, ctx.rank
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    tmp = np.empty_like(buf)
    if r < 2 * extra:
        if r % 2 == 0:  # sit out: give my data to my odd neighbour, get the result back
            yield [ctx.send(buf, r + 1)]
            yield [ctx.recv(buf, r + 1)]
            return
        yield [ctx.recv(tmp, r - 1)]
        op(buf, tmp, out=buf)
        vr = r // 2
    else:
        vr = r - extra

    def real(v):  # virtual rank among the P participants -> rank in the group
        return 2 * v + 1 if v < extra else v + extra

    # From 8 KB up, send a staging copy instead of `buf` itself: we add into `buf` right after
    # the exchange, and writing into an array the peer's kernel has just read (MPICH's
    # single-copy path) is slow. One copy costs less (chapter 07, "Staging copies").
    staged = np.empty_like(buf) if buf.nbytes >= STAGE_BYTES else None
    mask = 1
    while mask < p:
        partner = real(vr ^ mask)
        outgoing = buf
        if staged is not None:
            np.copyto(staged, buf)
            outgoing = staged
        yield [ctx.recv(tmp, partner), ctx.send(outgoing, partner)]
        op(buf, tmp, out=buf)  # same op on both sides: a+b == b+a exactly, so ranks agree
        mask <<= 1
    if r < 2 * extra:
        yield [ctx.send(buf, r - 1)]


def all_reduce_halving_doubling(ctx, buf, op):
    """Rabenseifner's all-reduce: a reduce-scatter by recursive *halving* (in round k, swap
    half of what I am still responsible for with rank vr XOR P/2**k, keep and reduce the other
    half), then an all-gather by recursive *doubling* (swap everything I hold, the blocks
    double). The ring's bandwidth, 2(P-1)/P x S per rank, in only 2 log2(P) steps instead of
    2(P-1). Non-powers of two fold in and out like recursive doubling."""
    n, r = ctx.size, ctx.rank
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if r < 2 * extra:
        if r % 2 == 0:
            yield [ctx.send(buf, r + 1)]
            yield [ctx.recv(buf, r + 1)]
            return
        tmp = np.empty_like(buf)
        yield [ctx.recv(tmp, r - 1)]
        op(buf, tmp, out=buf)
        vr = r // 2
    else:
        vr = r - extra

    def real(v):
        return 2 * v + 1 if v < extra else v + extra

    bounds = chunk_bounds(buf.size, p)

    def span(lo, hi):  # elements of chunks lo..hi-1
        return bounds[lo][0], bounds[hi - 1][1]

    tmp = np.empty(span(0, max(p // 2, 1))[1], dtype=buf.dtype)  # the largest half
    lo, hi, mask = 0, p, p // 2
    while mask >= 1:  # halving: keep the half of [lo, hi) that holds my chunk vr
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if vr & mask else ((lo, mid), (mid, hi))
        (ka, kb), (ga, gb) = span(*keep), span(*give)
        incoming = tmp[: kb - ka]
        partner = real(vr ^ mask)
        yield [ctx.recv(incoming, partner), ctx.send(buf[ga:gb], partner)]
        mine = buf[ka:kb]
        op(mine, incoming, out=mine)
        (lo, hi), mask = keep, mask // 2
    mask = 1  # now [lo, hi) == [vr, vr + 1): my chunk is fully reduced
    while mask < p:  # doubling: swap blocks with vr XOR mask; together they are aligned
        plo, phi = (lo - mask, lo) if vr & mask else (hi, hi + mask)
        (ma, mb), (pa, pb) = span(lo, hi), span(plo, phi)
        partner = real(vr ^ mask)
        yield [ctx.recv(buf[pa:pb], partner), ctx.send(buf[ma:mb], partner)]
        lo, hi, mask = min(lo, plo), max(hi, phi), mask * 2
    if r < 2 * extra:
        yield [ctx.send(buf, r - 1)]


def all_reduce_ring(ctx, buf, op):
    """Ring all-reduce = ring reduce-scatter + ring all-gather, both in place in `buf`.

    The array is cut into N chunks. Reduce-scatter: in step s (0..N-2) rank r sends chunk
    (r-s-1) mod N to rank r+1 and receives chunk (r-s-2) mod N from rank r-1, adding its
    own values into it; after N-1 steps rank r holds the total of chunk r. All-gather: N-1
    more steps pass the finished chunks around the ring. Every rank sends
    2 (N-1) chunks = 2 (N-1)/N x S bytes, whatever N is: that is bandwidth-optimal."""
    ### BEGIN SOLUTION assignment=ring_all_reduce
    bounds = chunk_bounds(buf.size, ctx.size)
    yield from _ring_reduce_scatter_inplace(ctx, buf, op, bounds)
    yield from all_gather_ring(ctx, buf, bounds)
    ### END SOLUTION


def _ring_reduce_scatter_inplace(ctx, buf, op, bounds):
    """The first half of ring all-reduce, in place in `buf`: in N - 1 steps each rank sends one
    chunk (bounds[i] = its [start, end)) to its right neighbour and adds what its left neighbour
    sends into its own copy of that chunk (`op(a, b, out=a)`), so that afterwards rank r's chunk r
    holds the reduction over all ranks (the other chunks hold partial sums). Each step yields the
    list of its messages, [ctx.recv(...), ctx.send(...)], as the other algorithms in this file do."""
    ### BEGIN SOLUTION assignment=ring_all_reduce
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    tmp = np.empty(max(b - a for a, b in bounds), dtype=buf.dtype)
    for s in range(n - 1):
        sa, sb = bounds[(r - s - 1) % n]
        ra, rb = bounds[(r - s - 2) % n]
        incoming = tmp[: rb - ra]
        yield [ctx.recv(incoming, left), ctx.send(buf[sa:sb], right)]
        chunk = buf[ra:rb]
        op(chunk, incoming, out=chunk)
    # rank r now holds the reduced chunk (r - (n-2) - 2) mod n == r
    ### END SOLUTION


def reduce_scatter_ring(ctx, buf, op, out):
    """Ring reduce-scatter without touching `buf`: rank r ends with the reduced chunk r in
    `out`. Same schedule as the first half of ring all-reduce, but the partial sums travel
    in two chunk-sized buffers instead of overwriting the input.
    Per rank: N-1 messages, (N-1)/N x S bytes."""
    ### BEGIN REFERENCE assignment=ring_all_reduce stub=yield from _reduce_scatter_on_a_copy(ctx, buf, op, out)
    n, r = ctx.size, ctx.rank
    bounds = chunk_bounds(buf.size, n)
    right, left = (r + 1) % n, (r - 1) % n
    if n == 1:
        out[...] = buf
        return
    big = max(b - a for a, b in bounds)
    send_buf, recv_buf = np.empty(big, buf.dtype), np.empty(big, buf.dtype)
    a, b = bounds[(r - 1) % n]
    outgoing = buf[a:b]  # step 0 sends my own values of chunk r-1
    for s in range(n - 1):
        ra, rb = bounds[(r - s - 2) % n]
        last = s == n - 2
        incoming = out if last else recv_buf[: rb - ra]  # the last step lands in `out`
        yield [ctx.recv(incoming, left), ctx.send(outgoing, right)]
        op(incoming, buf[ra:rb], out=incoming)  # add my own contribution to the partial sum
        outgoing, send_buf, recv_buf = incoming, recv_buf, send_buf
    ### END REFERENCE


def _reduce_scatter_on_a_copy(ctx, buf, op, out):
    """reduce_scatter_ring's result by the in-place ring on a copy of `buf` (one more buffer of
    the full size): what the course's student copy runs instead, so that its ring is the student's."""
    bounds = chunk_bounds(buf.size, ctx.size)
    work = buf.copy()
    yield from _ring_reduce_scatter_inplace(ctx, work, op, bounds)
    start, end = bounds[ctx.rank]
    out[...] = work[start:end]


def all_gather_ring(ctx, out, bounds):
    """Ring all-gather in place in `out`, where rank r already holds chunk r at bounds[r]:
    in step s rank r forwards chunk (r-s) to rank r+1 and receives chunk (r-s-1) from rank
    r-1, so what arrives in one step leaves in the next.
    Per rank: N-1 messages, (N-1)/N x S bytes (S = total bytes gathered)."""
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        sa, sb = bounds[(r - s) % n]
        ra, rb = bounds[(r - s - 1) % n]
        yield [ctx.recv(out[ra:rb], left), ctx.send(out[sa:sb], right)]


# -- all-to-all and barrier ------------------------------------------------------------------

def all_to_all_pairwise(ctx, buf, out):
    """Rank r's chunk j goes to rank j, landing at position r of rank j's output. In step s
    (1..N-1) rank r sends to r+s and receives from r-s: each step pairs every rank with
    exactly one sender and one receiver, so nobody is flooded."""
    n, r = ctx.size, ctx.rank
    src = chunk_bounds(buf.size, n)
    part = src[r][1] - src[r][0]  # every rank sends me its chunk r: same size everywhere
    a, b = src[r]
    out[r * part:(r + 1) * part] = buf[a:b]
    for s in range(1, n):
        to, frm = (r + s) % n, (r - s) % n
        a, b = src[to]
        yield [ctx.recv(out[frm * part:(frm + 1) * part], frm), ctx.send(buf[a:b], to)]


def barrier_dissemination(ctx):
    """In round k each rank pings rank r + 2**k and waits for a ping from r - 2**k. After
    ceil(log2 N) rounds every rank has (indirectly) heard from every other: nobody leaves
    before everybody has arrived."""
    n, r = ctx.size, ctx.rank
    token, got = np.zeros(0, np.uint8), np.zeros(0, np.uint8)
    k = 1
    while k < n:
        yield [ctx.recv(got, (r - k) % n), ctx.send(token, (r + k) % n)]
        k <<= 1
