"""Ignores the slices before this one: every slice's queue starts where the whole batch's does, so places collide across slices.
max share: 0.41
"""
### BEGIN YOUR CODE assignment=moe_capacity
per_choice = counts.sum(axis=0)
choice_start = np.cumsum(per_choice, axis=0) - per_choice
return np.broadcast_to(choice_start, counts.shape).copy()
### END YOUR CODE
### BEGIN YOUR CODE assignment=moe_capacity
n, k = experts.shape
slots = np.empty((n, k), dtype=np.int64)
for j in range(k):
    same = experts[:, j, None] == np.arange(starts.shape[1])
    ahead = np.cumsum(same, axis=0)[np.arange(n), experts[:, j]] - 1
    slots[:, j] = starts[j, experts[:, j]] + ahead
return slots
### END YOUR CODE
