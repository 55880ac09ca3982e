"""Sends the whole buffer at every step of the reduce-scatter and reduces only the chunk due: right values, N times the ring's bytes.
max share: 0.47
"""
### BEGIN YOUR CODE assignment=ring_all_reduce
bounds = chunk_bounds(buf.size, ctx.size)
yield from _ring_reduce_scatter_inplace(ctx, buf, op, bounds)
yield from all_gather_ring(ctx, buf, bounds)
### END YOUR CODE
### BEGIN YOUR CODE assignment=ring_all_reduce
n, r = ctx.size, ctx.rank
right, left = (r + 1) % n, (r - 1) % n
incoming = np.empty_like(buf)
for s in range(n - 1):
    ra, rb = bounds[(r - s - 2) % n]
    yield [ctx.recv(incoming, left), ctx.send(buf, right)]
    chunk = buf[ra:rb]
    op(chunk, incoming[ra:rb], out=chunk)
### END YOUR CODE
