"""minidist: distributed deep-learning training from scratch, in NumPy and mpi4py.

Read the book in `chapters/`; the code of each chapter is named there. The folders show the
layers, each importing only from those before it: `core/` (the autograd engine, the layers, the
GPT, the optimizers: chapter 1), `comm/` (processes and messages: chapters 2 and 7), `parallel/`
(one file per strategy: chapters 3-9 and 11), and beside them the precision, planning and running
modules. Importing the package loads the core's `functional`, which attaches every operation to
`Tensor` as its operators, so any module can be imported on its own, in any order.
"""
from minidist.core import functional  # noqa: F401  (loads the engine; gives Tensor its operators)
