"""Does nothing: no bucket is ever launched, so there is nothing to wait for.
max share: 0
"""
### BEGIN YOUR CODE assignment=ddp_bucket_hook
pass
### END YOUR CODE
### BEGIN YOUR CODE assignment=ddp_bucket_hook
pass
### END YOUR CODE
