"""g as an identity forward: each rank goes on with its own partial sum instead of the total.
max share: 0.4
"""
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
g = np.array(g, copy=True)
return all_reduce(g, group=ctx.group), None
### END YOUR CODE
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
return x
### END YOUR CODE
