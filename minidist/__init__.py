"""minidist: distributed deep-learning training from scratch, in NumPy and mpi4py.

Read the book in `chapters/`; the code of each chapter is named there. The engine comes first:
importing the package loads `tensor` (and through it every operation in `functional`), so any
module of minidist can be imported on its own, in any order.
"""
from minidist import tensor  # noqa: F401  (loads tensor -> functional -> shape_ops, fused)
