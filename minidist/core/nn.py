"""Modules: parameters with names, and the layers a GPT is made of.

Chapter 1. A `Module` owns `Parameter`s and sub-modules as plain attributes; `named_parameters()`
walks them in the order they were assigned, giving stable dotted names such as
`h.0.attn.q_proj.weight`. Those names are the contract every later chapter relies on:
`state_dict()` keys, checkpoint files, and the rule that decides which rank owns which slice.

Layers are created with zeros; the model fills them from its seed (see `minidist/core/model.py`),
so that initial weights depend only on the seed and the parameter's name, never on how the
model is later split across ranks.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from minidist.core import functional as F
from minidist.core import tensor as engine
from minidist.core.tensor import Tensor, get_default_dtype


class Parameter(Tensor):
    """A leaf tensor that the optimizer updates (requires_grad is always on)."""

    def __init__(self, data, dtype=None):
        super().__init__(np.array(data, dtype=dtype or get_default_dtype(), copy=True), requires_grad=True)

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


class Module:
    """Base class: subclasses assign Parameters, Modules and ModuleLists as attributes."""

    training = True
    layer_name = None  # set on the layers a trace records ("h.0", minidist/trace/, chapter 5)

    def __call__(self, *args, **kwargs):
        if self.layer_name is not None and engine._tracer is not None:
            return engine._tracer.layer(self, args, kwargs)  # its forward and backward become spans
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    # -- walking the tree
    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen = set()
        for module_name, module in self.named_modules(prefix):
            for name, value in vars(module).items():
                if isinstance(value, Parameter) and id(value) not in seen:
                    seen.add(id(value))  # a shared (tied) parameter appears once, under its first name
                    yield (f"{module_name}.{name}" if module_name else name), value

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    # -- modes and gradients
    def train(self, mode: bool = True) -> "Module":
        for _, module in self.named_modules():
            module.training = mode
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    # -- saving and loading
    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of every parameter, keyed by its dotted name."""
        return {name: p.data.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy arrays into the parameters (cast to each parameter's dtype).

        With strict=True, missing or unexpected keys are an error; a shape mismatch always is.
        """
        params = dict(self.named_parameters())
        missing = [k for k in params if k not in state]
        unexpected = [k for k in state if k not in params]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, value in state.items():
            if name not in params:
                continue
            value = np.asarray(value)
            if value.shape != params[name].shape:
                raise ValueError(f"load_state_dict: {name} has shape {params[name].shape} in the model "
                                 f"but {value.shape} in the state dict")
        for name, value in state.items():
            if name in params:
                params[name].data[...] = value


class ModuleList(Module):
    """A list of modules, named by position: `h.0`, `h.1`, ..."""

    def __init__(self, modules=()):
        self._items = list(modules)
        for i, module in enumerate(self._items):
            setattr(self, str(i), module)

    def __getitem__(self, i):
        return self._items[i]

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        return iter(self._items)


class Linear(Module):
    """y = x W^T + b with W of shape (out_features, in_features), as in PyTorch."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None):
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(np.zeros((out_features, in_features)), dtype)
        self.bias = Parameter(np.zeros(out_features), dtype) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=None):
        self.weight = Parameter(np.zeros((num_embeddings, embedding_dim)), dtype)

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5, dtype=None):
        self.eps = eps
        self.weight = Parameter(np.ones(dim), dtype)
        self.bias = Parameter(np.zeros(dim), dtype)

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)


class Dropout(Module):
    """Dropout with its own seeded generator, so runs repeat exactly."""

    def __init__(self, p: float = 0.0, seed: int = 0):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.rng = np.random.default_rng(seed)

    def forward(self, x):
        return F.dropout(x, self.p, self.training, self.rng)
