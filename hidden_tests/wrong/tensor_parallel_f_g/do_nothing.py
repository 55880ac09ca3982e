"""Does nothing: f's backward hands the gradient back, g's forward its input; no all-reduce at all.
max share: 0
"""
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
return g, None
### END YOUR CODE
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
return x
### END YOUR CODE
