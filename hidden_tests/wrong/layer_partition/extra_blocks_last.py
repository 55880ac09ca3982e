"""The blocks left over go to the last stages, the ones that also run the head and the loss.
max share: 0.17
"""
### BEGIN YOUR CODE assignment=layer_partition
sizes = [n_layer // stages + (r >= stages - n_layer % stages) for r in range(stages)]
starts = [sum(sizes[:r]) for r in range(stages)]
return [(starts[r], starts[r] + sizes[r]) for r in range(stages)]
### END YOUR CODE
