"""Off by one: the running count includes the token itself, so places start at 1 and each expert keeps one choice fewer.
max share: 0.06
"""
### BEGIN YOUR CODE assignment=moe_capacity
per_choice = counts.sum(axis=0)
choice_start = np.cumsum(per_choice, axis=0) - per_choice
slice_start = np.cumsum(counts, axis=0) - counts
return choice_start[None] + slice_start
### END YOUR CODE
### BEGIN YOUR CODE assignment=moe_capacity
n, k = experts.shape
slots = np.empty((n, k), dtype=np.int64)
for j in range(k):
    same = experts[:, j, None] == np.arange(starts.shape[1])
    ahead = np.cumsum(same, axis=0)[np.arange(n), experts[:, j]]
    slots[:, j] = starts[j, experts[:, j]] + ahead
return slots
### END YOUR CODE
