"""Does nothing: no gradient is averaged, no updated chunk is gathered.
max share: 0
"""
### BEGIN YOUR CODE assignment=zero1_partition
pass
### END YOUR CODE
### BEGIN YOUR CODE assignment=zero1_partition
pass
### END YOUR CODE
