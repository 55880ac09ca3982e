"""The mean chunk lands at the start of the buffer, not at the rank's own place: right on rank 0 only.
max share: 0.27
"""
### BEGIN YOUR CODE assignment=zero1_partition
for unit, flat in zip(self.units, self.grad_buffers):
    chunk = reduce_scatter(flat, op="avg", group=self.group)
    flat[:chunk.size] = chunk
### END YOUR CODE
### BEGIN YOUR CODE assignment=zero1_partition
for flat, shard in zip(self.param_buffers, self.optimizer.params):
    all_gather(shard, group=self.group, out=flat)
### END YOUR CODE
