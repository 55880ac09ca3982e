"""Posts both messages on the world, not on `group`: dst and src are then read as world ranks.
max share: 0.4
"""
### BEGIN YOUR CODE assignment=sendrecv
r = irecv(recv_array, src, tag)
s = isend(send_array, dst, tag)
wait([r, s], timeout)
### END YOUR CODE
