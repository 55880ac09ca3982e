"""Walks the named axes in the order they are named, not the grid's: a group of several axes lists its ranks out of world order.
max share: 0.39
"""
### BEGIN YOUR CODE assignment=mesh_groups
grid = np.arange(math.prod(sizes.get(axis, 1) for axis in AXES)).reshape([sizes.get(a, 1) for a in AXES])
walked = [AXES.index(axis) for axis in vary]
held = [i for i in range(len(AXES)) if i not in walked]
size = math.prod(grid.shape[i] for i in walked)
return [tuple(int(r) for r in row) for row in np.transpose(grid, held + walked).reshape(-1, size)]
### END YOUR CODE
### BEGIN YOUR CODE assignment=mesh_groups
rest, tp = divmod(rank, tp_size)
pp, dp = divmod(rest, dp_size)
return pp, dp, tp
### END YOUR CODE
