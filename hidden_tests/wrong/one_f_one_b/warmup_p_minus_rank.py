"""p - rank warm-up forwards, one too many: the stage holds one micro-batch more than it needs.
max share: 0.1
"""
### BEGIN YOUR CODE assignment=one_f_one_b
warmup = min(stages - rank if warmup is None else max(0, warmup), microbatches)
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
