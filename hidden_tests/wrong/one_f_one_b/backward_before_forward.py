"""In the steady state, backward j before forward warmup + j: the last stage runs a backward before any forward.
max share: 0
"""
### BEGIN YOUR CODE assignment=one_f_one_b
warmup = min(stages - rank - 1 if warmup is None else max(0, warmup), microbatches)
### END YOUR CODE
### BEGIN YOUR CODE assignment=one_f_one_b
for i in range(warmup):
    yield FORWARD, i
for j in range(count - warmup):
    yield BACKWARD, j
    yield FORWARD, warmup + j
for j in range(count - warmup, count):
    yield BACKWARD, j
### END YOUR CODE
