"""Does nothing: the receive buffer is returned as it was.
max share: 0
"""
### BEGIN YOUR CODE assignment=sendrecv
pass
### END YOUR CODE
