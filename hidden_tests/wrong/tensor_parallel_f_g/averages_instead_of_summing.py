"""Averages instead of summing, as data parallelism does: partial sums and gradients come out t times too small.
max share: 0
"""
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
g = np.array(g, copy=True)
return all_reduce(g, op="avg", group=ctx.group), None
### END YOUR CODE
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
return all_reduce(np.array(x, copy=True), op="avg", group=group)
### END YOUR CODE
