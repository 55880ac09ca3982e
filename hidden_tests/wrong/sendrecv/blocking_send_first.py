"""A blocking send, then a blocking receive: fine while MPI buffers the message, a deadlock once it does not.
max share: 0.4
"""
### BEGIN YOUR CODE assignment=sendrecv
send(send_array, dst, tag, group, timeout)
recv(recv_array, src, tag, group, timeout)
### END YOUR CODE
