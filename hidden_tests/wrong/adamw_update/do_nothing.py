"""Does nothing: weights and moments stay as they were.
max share: 0
"""
### BEGIN YOUR CODE assignment=adamw_update
pass
### END YOUR CODE
