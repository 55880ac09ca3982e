"""The engine: a `Tensor` over a NumPy array, and reverse-mode automatic differentiation.

Chapter 1 (and every chapter after it) runs on this file. The one idea: every operation that
produces a tensor remembers *how* it was made (a `Function` and the inputs it read); `backward()`
walks that record from the loss back to the parameters, applying the chain rule at each step.

- A `Function` has a `forward(ctx, *arrays)` that computes with NumPy and a `backward(ctx, grad)`
  that returns one gradient per input. This is also the public way to define a new differentiable
  operation (like `torch.autograd.Function`); tensor parallelism defines its communication ops
  this way.
- `backward()` sorts the graph iteratively (deep graphs never hit Python's recursion limit),
  accumulates into `.grad` across calls (micro-batching relies on it), and fires a parameter's
  hooks the moment its gradient is complete (data parallelism starts all-reduces from them).
- dtypes never change silently: float32 by default, float64 on request, and mixing them is an
  error rather than a quiet upcast.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import ml_dtypes
import numpy as np

# ----------------------------------------------------------------------------- dtypes

_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64))
_default_dtype = np.dtype(np.float32)


def set_default_dtype(dtype) -> None:
    """Set the dtype of new floating tensors and parameters (float32 or float64)."""
    global _default_dtype
    dtype = np.dtype(dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"default dtype must be a float dtype, got {dtype}")
    _default_dtype = dtype


def get_default_dtype() -> np.dtype:
    return _default_dtype


@contextlib.contextmanager
def default_dtype(dtype):
    """`with default_dtype(np.float64): ...` — a temporary default dtype."""
    previous = _default_dtype
    set_default_dtype(dtype)
    try:
        yield
    finally:
        set_default_dtype(previous)


def as_array(data, dtype=None) -> np.ndarray:
    """Turn Python numbers, lists and arrays into an ndarray.

    Python floats and lists become the default dtype; an ndarray keeps its own dtype unless a
    dtype is asked for (so float64 data stays float64, and integer token ids stay integers).
    """
    if isinstance(data, Tensor):
        data = data.data
    if isinstance(data, (np.ndarray, np.generic)):  # NumPy data keeps its own dtype
        data = np.asarray(data)
        return data if dtype is None or data.dtype == dtype else data.astype(dtype)
    array = np.asarray(data)
    if dtype is not None:
        return array.astype(dtype, copy=False)
    if array.dtype.kind == "f":  # Python floats arrive as float64: use the default instead
        return array.astype(_default_dtype, copy=False)
    return array


# ----------------------------------------------------------------------------- grad mode

_grad_enabled = True


@contextlib.contextmanager
def no_grad():
    """Inside `with no_grad():` operations record nothing (evaluation, optimizer updates)."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


def is_grad_enabled() -> bool:
    return _grad_enabled


# ----------------------------------------------------------------------------- profiling

_profile: dict | None = None
_autocast = None  # a precision.Policy while `precision.autocast(...)` is active (chapter 10)


def set_autocast(policy):
    """Install a low-precision policy (or None); returns the previous one. See precision.py."""
    global _autocast
    previous, _autocast = _autocast, policy
    return previous


def autocast_active() -> bool:
    return _autocast is not None


@contextlib.contextmanager
def profile():
    """Time every Function's forward and backward by name: `with profile() as times: ...`.

    `times[name]` is `[forward_seconds, backward_seconds, calls]`. Used by the step benchmark
    to show where a training step spends its time.
    """
    global _profile
    previous, _profile = _profile, defaultdict(lambda: [0.0, 0.0, 0])
    try:
        yield _profile
    finally:
        _profile = previous


_tracer = None  # while a trace records (minidist/trace/, chapter 5): told of every backward() and layer


def set_tracer(tracer):
    """Install the object that records a trace (or None); returns the previous one. The engine
    runs every `backward()` inside `tracer.backward()` and every module marked as a layer
    (`Module.layer_name`) through `tracer.layer(module, args, kwargs)`, as `profile()` times
    every Function: the recorder itself lives outside the core (minidist/trace/recorder.py)."""
    global _tracer
    previous, _tracer = _tracer, tracer
    return previous


# ----------------------------------------------------------------------------- Function


class Context:
    """What a Function's forward leaves for its backward.

    `save_for_backward(*arrays)` keeps arrays alive until backward; they are counted by the
    memory ledger as activation memory (`graph_bytes`). Other small facts (shapes, axes) can be
    set as plain attributes.
    """

    def __init__(self):
        self.saved: tuple = ()
        self.needs_input_grad: tuple = ()
        self.compute_dtype = None  # set under autocast: backward runs in it too (precision.py)

    def save_for_backward(self, *arrays) -> None:
        self.saved = arrays


class Function:
    """A differentiable operation: subclass it and write two static methods.

        class Square(Function):
            @staticmethod
            def forward(ctx, x):            # NumPy arrays in, one NumPy array out
                ctx.save_for_backward(x)
                return x * x

            @staticmethod
            def backward(ctx, grad):        # gradient of the loss w.r.t. the output
                (x,) = ctx.saved
                return (2.0 * x * grad,)    # one gradient (or None) per forward input

        y = Square.apply(t)

    Tensor arguments of `apply` arrive in `forward` as arrays; any other argument (ints, axes,
    a communicator) passes through unchanged and gets `None` as its gradient.
    """

    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kwargs) -> "Tensor":
        arrays = [a.data if isinstance(a, Tensor) else a for a in args]
        ctx = Context()
        track = _grad_enabled and any(isinstance(a, Tensor) and a.requires_grad for a in args)
        ctx.needs_input_grad = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        out_dtype = None
        if _autocast is not None:  # chapter 10: compute in fp32, store in the policy's format
            arrays, out_dtype = _autocast.prepare(cls, arrays)
            ctx.compute_dtype = None if out_dtype is None else np.dtype(np.float32)
        if _profile is None:
            out = cls.forward(ctx, *arrays, **kwargs)
        else:
            start = time.perf_counter()
            out = cls.forward(ctx, *arrays, **kwargs)
            entry = _profile[cls.__name__]
            entry[0] += time.perf_counter() - start
            entry[2] += 1
        if out_dtype is not None and out.dtype != out_dtype:
            with np.errstate(over="ignore"):  # fp16 overflows to inf, as the hardware does (chapter 10)
                out = out.astype(out_dtype)
        result = Tensor(out)
        if track:
            result.requires_grad = True
            result._fn = cls
            result._ctx = ctx
            result._inputs = tuple(args)
        return result


# ----------------------------------------------------------------------------- Tensor


class Tensor:
    """An ndarray (`.data`) plus, when it requires grad, a gradient (`.grad`) and its history."""

    __array_priority__ = 100  # so that `ndarray * Tensor` defers to Tensor.__rmul__

    def __init__(self, data, requires_grad: bool = False, dtype=None):
        self.data = as_array(data, dtype)
        if requires_grad and self.data.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"only float tensors can require grad, got {self.data.dtype}")
        self.requires_grad = requires_grad
        self.grad: np.ndarray | None = None
        # where backward puts a fresh gradient (None: a new array). Data parallelism points it
        # into a bucket, so the gradient is born where the all-reduce reads it (no copy).
        self.grad_buffer: np.ndarray | None = None
        self._fn = None  # the Function that made this tensor (None for a leaf)
        self._ctx: Context | None = None
        self._inputs: tuple = ()
        self._hooks: list = []
        self._freed = False  # set when backward has consumed (and freed) the graph that made it

    # -- basic facts
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    is_leaf = property(lambda self: self._fn is None)

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{grad})"

    def numpy(self) -> np.ndarray:
        return self.data

    def item(self) -> float:
        return self.data.item()

    def detach(self) -> "Tensor":
        return Tensor(self.data)

    # -- hooks
    def register_post_accumulate_grad_hook(self, hook) -> None:
        """Call `hook(tensor)` each time backward has finished accumulating into `.grad`.

        Same name as PyTorch's. It fires during backward, as soon as every use of this tensor in
        the graph has contributed, so data parallelism can start communicating a gradient
        while the rest of backward is still running.
        """
        if not self.is_leaf:
            raise RuntimeError("gradient hooks can only be registered on leaf tensors (parameters)")
        self._hooks.append(hook)

    # -- backward
    def backward(self, grad=None) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's `.grad` that requires grad.

        `grad` is the gradient flowing into this tensor; it may be omitted only for a
        one-element tensor (a loss), where it is 1.
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad (was it made under no_grad()?)")
        if self._freed:
            raise RuntimeError("backward() through a graph that an earlier backward() already freed; "
                               "run the forward again (gradients accumulate across backward calls)")
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(
                    f"backward() of a non-scalar tensor of shape {self.shape} needs a gradient "
                    "argument of that shape (implicit 1.0 only works for a single-element loss)"
                )
            grad = np.ones_like(self.data)
        else:
            grad = as_array(grad, self.dtype)
            if grad.shape != self.shape:
                raise ValueError(f"backward(): gradient of shape {grad.shape} for a tensor of shape {self.shape}")
        if _tracer is None:
            _run_backward(self, grad)
        else:
            with _tracer.backward():  # a span in the trace, and each layer's part of it (chapter 5)
                _run_backward(self, grad)

    # -- operators: `a + b`, `a @ w`, `x.sum()`, `x.reshape(...)`, `x.T`, `x.astype(...)` are the
    #    operations of functional.py, and functional.py attaches them to this class (see the end
    #    of that file). Every operation there is a `Function` of this file, so this file comes
    #    first and cannot import them; `import minidist` loads both.


def _run_backward(root: Tensor, grad: np.ndarray) -> None:
    # 1. Every tensor reachable from the root that needs a gradient, in topological order
    #    (inputs before outputs), found with an explicit stack instead of recursion.
    #    A tensor is marked when it is expanded, not when it is pushed: a tensor reached again
    #    through a longer path (a residual connection) must still come before all its consumers.
    order, seen, stack = [], set(), [(root, False)]
    uses: dict[int, int] = defaultdict(int)  # how many graph nodes consume each tensor
    while stack:
        tensor, expanded = stack.pop()
        if expanded:
            order.append(tensor)
            continue
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        stack.append((tensor, True))
        for parent in tensor._inputs:
            if isinstance(parent, Tensor) and parent.requires_grad:
                uses[id(parent)] += 1
                if id(parent) not in seen:
                    stack.append((parent, False))

    # 2. Walk outputs-to-inputs. A tensor's gradient is complete once all its consumers have
    #    been processed; leaves are then accumulated into .grad and their hooks fired at once.
    grads = {id(root): grad}
    for tensor in reversed(order):
        if tensor.is_leaf:
            continue  # delivered below, the moment its last consumer finishes
        g = grads.pop(id(tensor), None)
        fn, ctx, inputs = tensor._fn, tensor._ctx, tensor._inputs
        # the graph is used once: free it (and its saved activations) as we go
        tensor._fn, tensor._ctx, tensor._inputs, tensor._freed = None, None, (), True
        if g is not None and ctx.compute_dtype is not None and g.dtype != ctx.compute_dtype:
            g = g.astype(ctx.compute_dtype)  # backward computes as forward did; _accumulate rounds back
        if g is None:  # no gradient reached this tensor: its inputs get none from it either
            input_grads = (None,) * len(inputs)
        elif _profile is None:
            input_grads = fn.backward(ctx, g)
        else:
            start = time.perf_counter()
            input_grads = fn.backward(ctx, g)
            _profile[fn.__name__][1] += time.perf_counter() - start
        if not isinstance(input_grads, tuple):
            input_grads = (input_grads,)
        for parent, parent_grad in zip(inputs, input_grads):
            if not (isinstance(parent, Tensor) and parent.requires_grad):
                continue
            if parent_grad is not None:
                _accumulate(grads, parent, parent_grad)
            uses[id(parent)] -= 1
            if parent.is_leaf and uses[id(parent)] == 0:
                _deliver(parent, grads.pop(id(parent), None))
    if root.is_leaf:  # backward() called on a parameter itself
        _deliver(root, grads.pop(id(root), None))


def _accumulate(grads: dict, tensor: Tensor, g: np.ndarray) -> None:
    if g.shape != tensor.shape:
        raise RuntimeError(f"internal error: gradient of shape {g.shape} for a tensor of shape {tensor.shape}")
    if g.dtype != tensor.dtype:
        with np.errstate(over="ignore"):  # a 16-bit gradient may overflow to inf: the loss scaler's signal
            g = g.astype(tensor.dtype)
    previous = grads.get(id(tensor))
    # the first contribution may be a view of someone else's buffer: copy before adding to it
    grads[id(tensor)] = g if previous is None else previous + g


def _deliver(leaf: Tensor, g: np.ndarray | None) -> None:
    if g is None:
        return
    if leaf.grad is None and leaf.grad_buffer is not None:
        np.copyto(leaf.grad_buffer, g)
        leaf.grad = leaf.grad_buffer
    elif leaf.grad is None:
        leaf.grad = np.array(g, dtype=leaf.dtype, copy=True)
    else:
        leaf.grad += g
    for hook in leaf._hooks:
        hook(leaf)


# ----------------------------------------------------------------------------- memory


def graph_bytes(*outputs: Tensor) -> int:
    """Bytes of activation memory the autograd graph behind `outputs` keeps alive.

    Counts every intermediate tensor's array and every array a Function saved for backward
    (each distinct buffer once; parameters and inputs are not counted, even where a Function
    saved them, e.g. the weight a linear layer keeps for its backward). This is the activation
    memory of chapter 1, measured rather than estimated.
    """
    def buffer(array):
        return array if array.base is None else array.base

    seen_buffers, seen_tensors, nodes = set(), set(), []
    stack = list(outputs)
    while stack:  # find the graph first: its leaves' buffers belong to the model, not to it
        tensor = stack.pop()
        if id(tensor) in seen_tensors:
            continue
        seen_tensors.add(id(tensor))
        if tensor.is_leaf:
            seen_buffers.add(id(buffer(tensor.data)))
            continue
        nodes.append(tensor)
        stack.extend(p for p in tensor._inputs if isinstance(p, Tensor))
    total = 0
    for tensor in nodes:
        for array in [tensor.data] + [a for a in tensor._ctx.saved if isinstance(a, np.ndarray)]:
            base = buffer(array)
            if id(base) not in seen_buffers:
                seen_buffers.add(id(base))
                total += base.nbytes
    return total
