"""Reduce-scatters straight into its own slice of the input buffer: the ring reads that slice after the last message has overwritten it.
max share: 0.27
"""
### BEGIN YOUR CODE assignment=zero1_partition
for unit, flat in zip(self.units, self.grad_buffers):
    reduce_scatter(flat, op="avg", group=self.group, out=flat[unit.lo:unit.hi])
### END YOUR CODE
### BEGIN YOUR CODE assignment=zero1_partition
for flat, shard in zip(self.param_buffers, self.optimizer.params):
    all_gather(shard, group=self.group, out=flat)
### END YOUR CODE
