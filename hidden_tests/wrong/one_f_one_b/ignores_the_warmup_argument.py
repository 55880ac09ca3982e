"""Always p - rank - 1 warm-up forwards: a warm-up passed by the caller is ignored.
max share: 0.45
"""
### BEGIN YOUR CODE assignment=one_f_one_b
warmup = min(stages - rank - 1, microbatches)
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
