"""All-reduces the arrays it is handed in place: g overwrites its input, f the gradient array it shares with others.
max share: 0.4
"""
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
return all_reduce(g, group=ctx.group), None
### END YOUR CODE
### BEGIN YOUR CODE assignment=tensor_parallel_f_g
return all_reduce(x, group=group)
### END YOUR CODE
