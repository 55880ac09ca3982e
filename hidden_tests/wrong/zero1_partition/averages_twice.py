"""Averages twice: op="avg" already divides by N, and the chunk is divided by N again.
max share: 0.27
"""
### BEGIN YOUR CODE assignment=zero1_partition
for unit, flat in zip(self.units, self.grad_buffers):
    flat[unit.lo:unit.hi] = reduce_scatter(flat, op="avg", group=self.group) / self.group.size
### END YOUR CODE
### BEGIN YOUR CODE assignment=zero1_partition
for flat, shard in zip(self.param_buffers, self.optimizer.params):
    all_gather(shard, group=self.group, out=flat)
### END YOUR CODE
