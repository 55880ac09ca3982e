"""Everything on every rank: the mean chunk is all-gathered back into the whole gradient buffer (an all-reduce).
max share: 0.4
"""
### BEGIN YOUR CODE assignment=zero1_partition
for unit, flat in zip(self.units, self.grad_buffers):
    chunk = reduce_scatter(flat, op="avg", group=self.group)
    all_gather(chunk, group=self.group, out=flat)  # every rank now holds the whole mean gradient
### END YOUR CODE
### BEGIN YOUR CODE assignment=zero1_partition
for flat, shard in zip(self.param_buffers, self.optimizer.params):
    all_gather(shard, group=self.group, out=flat)
### END YOUR CODE
