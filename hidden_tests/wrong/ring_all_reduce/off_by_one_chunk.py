"""Off by one chunk: step s sends chunk r-s and reduces chunk r-s-1, so rank r ends with chunk r+1, not the chunk r the all-gather starts from.
max share: 0.27
"""
### BEGIN YOUR CODE assignment=ring_all_reduce
bounds = chunk_bounds(buf.size, ctx.size)
yield from _ring_reduce_scatter_inplace(ctx, buf, op, bounds)
yield from all_gather_ring(ctx, buf, bounds)
### END YOUR CODE
### BEGIN YOUR CODE assignment=ring_all_reduce
n, r = ctx.size, ctx.rank
right, left = (r + 1) % n, (r - 1) % n
tmp = np.empty(max(b - a for a, b in bounds), dtype=buf.dtype)
for s in range(n - 1):
    sa, sb = bounds[(r - s) % n]
    ra, rb = bounds[(r - s - 1) % n]
    incoming = tmp[: rb - ra]
    yield [ctx.recv(incoming, left), ctx.send(buf[sa:sb], right)]
    chunk = buf[ra:rb]
    op(chunk, incoming, out=chunk)
### END YOUR CODE
