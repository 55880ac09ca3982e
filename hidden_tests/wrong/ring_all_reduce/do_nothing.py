"""Does nothing: neither function posts a message or yields.
max share: 0
"""
### BEGIN YOUR CODE assignment=ring_all_reduce
pass
### END YOUR CODE
### BEGIN YOUR CODE assignment=ring_all_reduce
pass
### END YOUR CODE
