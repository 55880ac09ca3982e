"""n_layer // stages blocks each: the remainder is never run.
max share: 0.17
"""
### BEGIN YOUR CODE assignment=layer_partition
size = n_layer // stages
return [(r * size, (r + 1) * size) for r in range(stages)]
### END YOUR CODE
