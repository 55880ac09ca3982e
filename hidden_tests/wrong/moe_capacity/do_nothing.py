"""Does nothing: no queue starts, no places.
max share: 0
"""
### BEGIN YOUR CODE assignment=moe_capacity
pass
### END YOUR CODE
### BEGIN YOUR CODE assignment=moe_capacity
pass
### END YOUR CODE
