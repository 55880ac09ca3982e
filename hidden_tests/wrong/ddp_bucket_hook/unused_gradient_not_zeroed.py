"""Leaves the slot of a parameter without a gradient as it was: it sends the last step's averaged gradient again.
max share: 0.4
"""
### BEGIN YOUR CODE assignment=ddp_bucket_hook
bucket = self._bucket_of[id(p)]
bucket.ready += 1
if bucket.ready == len(bucket.params):
    self._launch(bucket)
### END YOUR CODE
### BEGIN YOUR CODE assignment=ddp_bucket_hook
for p, slot in zip(bucket.params, bucket.views):
    if p.grad is not None and p.grad is not slot:
        slot[...] = p.grad
bucket.started, bucket.finished = time.perf_counter(), None
bucket.work = all_reduce(bucket.buffer, op="avg", group=self.group, algorithm=self.algorithm, async_op=True)
### END YOUR CODE
