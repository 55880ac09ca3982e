"""Does nothing: no groups, every rank at the origin.
max share: 0
"""
### BEGIN YOUR CODE assignment=mesh_groups
return []
### END YOUR CODE
### BEGIN YOUR CODE assignment=mesh_groups
return 0, 0, 0
### END YOUR CODE
