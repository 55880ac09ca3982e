"""The all-gather's result is a new array, never copied into the parameters: each rank updates only its chunk.
max share: 0.14
"""
### BEGIN YOUR CODE assignment=zero1_partition
for unit, flat in zip(self.units, self.grad_buffers):
    flat[unit.lo:unit.hi] = reduce_scatter(flat, op="avg", group=self.group)
### END YOUR CODE
### BEGIN YOUR CODE assignment=zero1_partition
for flat, shard in zip(self.param_buffers, self.optimizer.params):
    flat = all_gather(shard, group=self.group)
### END YOUR CODE
