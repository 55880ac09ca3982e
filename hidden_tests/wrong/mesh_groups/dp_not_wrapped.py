"""The dp coordinate is rank // tp_size, never taken modulo dp_size: right on the first pipeline stage only.
max share: 0.42
"""
### BEGIN YOUR CODE assignment=mesh_groups
grid = np.arange(math.prod(sizes.get(axis, 1) for axis in AXES)).reshape([sizes.get(a, 1) for a in AXES])
walked = [AXES.index(axis) for axis in AXES if axis in vary]
held = [i for i in range(len(AXES)) if i not in walked]
size = math.prod(grid.shape[i] for i in walked)
return [tuple(int(r) for r in row) for row in np.transpose(grid, held + walked).reshape(-1, size)]
### END YOUR CODE
### BEGIN YOUR CODE assignment=mesh_groups
return rank // (dp_size * tp_size), rank // tp_size, rank % tp_size
### END YOUR CODE
