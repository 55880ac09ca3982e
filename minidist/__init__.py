"""minidist: distributed deep-learning training from scratch, in NumPy and mpi4py.

Read the book in `chapters/`; the code of each chapter is named there. The engine comes first:
importing the package loads `functional` (and through it the engine in `tensor` and every
operation, which `functional` attaches to `Tensor` as its operators), so any module of minidist
can be imported on its own, in any order.
"""
from minidist import functional  # noqa: F401  (loads tensor, shape_ops, fused, fused_fast; gives Tensor its operators)
