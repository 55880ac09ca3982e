"""Does nothing: no stage gets a block.
max share: 0
"""
### BEGIN YOUR CODE assignment=layer_partition
return []
### END YOUR CODE
