"""Every rank gathers every rank's whole gradient buffer and averages them: N copies held, N-1 sent.
max share: 0.4
"""
### BEGIN YOUR CODE assignment=zero1_partition
for flat in self.grad_buffers:
    everyone = all_gather(flat, group=self.group).reshape(self.group.size, -1)
    flat[...] = everyone.mean(axis=0)
### END YOUR CODE
### BEGIN YOUR CODE assignment=zero1_partition
for flat, shard in zip(self.param_buffers, self.optimizer.params):
    all_gather(shard, group=self.group, out=flat)
### END YOUR CODE
