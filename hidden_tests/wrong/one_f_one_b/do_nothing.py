"""Does nothing: no warm-up and no forward or backward at all, only the optimizer step.
max share: 0
"""
### BEGIN YOUR CODE assignment=one_f_one_b
warmup = 0
### END YOUR CODE
### BEGIN YOUR CODE assignment=one_f_one_b
return iter(())
### END YOUR CODE
