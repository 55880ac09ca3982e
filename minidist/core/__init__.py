"""The engine a learner reads first (chapter 1): NumPy arrays with reverse-mode autograd, the
layers, the small GPT, the optimizers and the data. Nothing here knows of processes or messages:
every parallel strategy (`minidist/parallel/`) builds on this core and on `minidist/comm/`.

    tensor.py      Tensor and reverse-mode autograd (Function, backward, hooks, no_grad)
    functional.py  differentiable operations (and Tensor's operators, attached here)
    shape_ops.py   operations that move elements; operands.py how operations take their operands
    fused.py       the transformer's operations as their formulas; fused_fast.py the fast path;
                   kernels.py the switch between them
    nn.py          Module, Parameter, Linear, Embedding, LayerNorm, Dropout
    model.py       GPTConfig and GPT; recompute.py activation checkpointing (chapter 11)
    optim.py       SGD, AdamW, clipping, the learning-rate schedule
    data.py        the sorting task, text files, each rank's slice of a global batch
    gradcheck.py   finite-difference checks
"""
from minidist.core import functional  # noqa: F401  (gives Tensor its operators; registers the fast kernels)
