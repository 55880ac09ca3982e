"""Evenly spaced boundaries, rounded: balanced, but the larger stages land wherever rounding puts them.
max share: 0.5
"""
### BEGIN YOUR CODE assignment=layer_partition
bounds = np.rint(np.linspace(0, n_layer, stages + 1)).astype(int)
return [(int(bounds[r]), int(bounds[r + 1])) for r in range(stages)]
### END YOUR CODE
