"""Queues by position only: a token's second choice goes right after its first, before the next token's first choice.
max share: 0.36
"""
### BEGIN YOUR CODE assignment=moe_capacity
slice_start = np.cumsum(counts.sum(axis=1), axis=0) - counts.sum(axis=1)  # (R, E): earlier slices first
return np.repeat(slice_start[:, None, :], counts.shape[1], axis=1)
### END YOUR CODE
### BEGIN YOUR CODE assignment=moe_capacity
n, k = experts.shape
flat = experts.reshape(-1)  # token 0's choices, then token 1's, ...
same = flat[:, None] == np.arange(starts.shape[1])
ahead = np.cumsum(same, axis=0)[np.arange(flat.size), flat] - 1
return (starts[0, flat] + ahead).reshape(n, k)
### END YOUR CODE
