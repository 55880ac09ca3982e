"""GPipe's order presented as 1F1B: every forward, then every backward, whatever the warm-up.
max share: 0.1
"""
### BEGIN YOUR CODE assignment=one_f_one_b
warmup = min(stages - rank - 1 if warmup is None else max(0, warmup), microbatches)
### END YOUR CODE
### BEGIN YOUR CODE assignment=one_f_one_b
for i in range(count):
    yield FORWARD, i
for i in range(count):
    yield BACKWARD, i
### END YOUR CODE
