"""f as an identity both ways: the outputs are right, the replicated input's gradient misses the other ranks' shares.
max share: 0.2
"""
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
return g, None
### END YOUR CODE
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
return all_reduce(np.array(x, copy=True), group=group)
### END YOUR CODE
