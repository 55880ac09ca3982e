"""Receives from dst and sends to src: right for a swap between two ranks, wrong round a ring.
max share: 0.4
"""
### BEGIN YOUR CODE assignment=sendrecv
r = irecv(recv_array, dst, tag, group)
s = isend(send_array, src, tag, group)
wait([r, s], timeout)
### END YOUR CODE
