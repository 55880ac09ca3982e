"""p - rank - 1 warm-up forwards even when there are fewer micro-batches: forwards of micro-batches that do not exist.
max share: 0.37
"""
### BEGIN YOUR CODE assignment=one_f_one_b
warmup = stages - rank - 1 if warmup is None else max(0, warmup)
### END YOUR CODE
### BEGIN YOUR CODE assignment=one_f_one_b
for i in range(warmup):
    yield FORWARD, i
for j in range(count - warmup):
    yield FORWARD, warmup + j
    yield BACKWARD, j
for j in range(count - warmup, count):
    yield BACKWARD, j
### END YOUR CODE
