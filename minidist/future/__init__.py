"""What comes after the book's strategies (chapter 11, sections 12-18), each idea small enough to
show in one process.

    overlap.py            a message hidden behind computation: exposed = max(0, comm - compute)
    fusion.py             the bytes a fused bias + GeLU + dropout does not move
    fault_tolerance.py    failures per day, Young/Daly's checkpoint interval, the work lost
    local_sgd.py          K replicas, H local steps each, then an average: local SGD and DiLoCo
    blocked_attention.py  FlashAttention's tiling: attention in blocks with the online softmax
    zero_bubble.py        zero-bubble pipelines: backward split into B and W, simulated

These are illustrations, not strategies: they model, simulate or replay in one process what
real systems do over many devices, so none of them starts MPI. Each is checked by a
tests/test_future_*.py that asserts its numbers.
"""
