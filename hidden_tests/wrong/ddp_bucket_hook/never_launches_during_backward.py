"""Counts the gradients but never launches: every bucket waits for finish_gradient_synchronization, no overlap.
max share: 0.2
"""
### BEGIN YOUR CODE assignment=ddp_bucket_hook
bucket = self._bucket_of[id(p)]
bucket.ready += 1
### END YOUR CODE
### BEGIN YOUR CODE assignment=ddp_bucket_hook
for p, slot in zip(bucket.params, bucket.views):
    if p.grad is None:
        slot[...] = 0.0
    elif p.grad is not slot:
        slot[...] = p.grad
bucket.started, bucket.finished = time.perf_counter(), None
bucket.work = all_reduce(bucket.buffer, op="avg", group=self.group, algorithm=self.algorithm, async_op=True)
### END YOUR CODE
