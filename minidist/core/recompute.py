"""Activation checkpointing (重计算, recomputation): keep a block's input, not its graph.

Chapter 11. The forward pass keeps, for every operation, what its backward will need (chapter 1's
activation memory); for a transformer that is ~25 arrays of the hidden size per layer, and it
grows with depth. Checkpointing trades compute for that memory:

    forward    run f(x) under no_grad: nothing inside f is recorded; keep x (and f's output)
    backward   run f(x) again, this time recording, and backpropagate the incoming gradient
               through that fresh graph; it is freed as soon as it has been used

so only one block's graph exists at a time, at the price of running each forward twice
(about a third more compute: a backward costs about two forwards).

    y = checkpoint(block, x)                      # any function of tensors
    x = checkpoint_sequential(blocks, 2, x)       # 2 checkpointed runs of consecutive blocks

How the gradients come out. The engine reaches the checkpoint's node with the gradient of its
output; the node reruns `f` on *detached* copies of its inputs (leaves that share the arrays and
require grad as the originals did), runs a backward inside the backward through the recomputed
graph, and returns the gradients that landed on those leaves as its inputs' gradients. The
parameters used inside `f` are leaves of the recomputed graph, so that inner backward
accumulates their `.grad` and fires their hooks (data parallelism's all-reduces start from them)
exactly as the plain backward would. This is the scheme of PyTorch's *reentrant* checkpoint
(`use_reentrant=True`). PyTorch's default, non-reentrant variant records the graph in the first
forward and drops only the saved tensors (saved-tensor hooks), refilling them by recomputation
when backward unpacks them; its parameters get their gradients through that recorded graph.
minidist has no saved-tensor hooks, so it rebuilds the graph; the recomputed operations, their
inputs and their order are those of the first forward, so the gradients are the same numbers.

Random numbers. Dropout draws its masks from a generator held by its module (nn.Dropout's `rng`,
attention's `attn_rng`). The recomputation must draw the *same* masks, so `checkpoint` records
the generators' states before the forward, sets them back to those states for the
recomputation, and afterwards returns each generator to the state it had when backward began:
later draws are unaffected, even when other forwards (micro-batches) drew from the same
generators between this forward and its backward. (PyTorch saves and restores its global
generator's state the same way: `preserve_rng_state=True`.) The chapter 10 autocast policy and
the kernel path in force during the forward are restored for the recomputation too.

Selective recomputation (Korthikanti et al. 2022) checkpoints only the attention core,
softmax(QK^T)V and its dropout, whose arrays grow with the square of the sequence; full
recomputation checkpoints whole blocks. The GPT chooses with `GPT.set_recompute` (model.py);
`minidist/plan/recompute_cost.py` measures what each choice keeps and costs.
"""
from __future__ import annotations

import contextlib

import numpy as np

from minidist.core import kernels, tensor
from minidist.core.nn import Module
from minidist.core.tensor import Function, Tensor, graph_bytes, is_grad_enabled, no_grad, set_autocast

MODES = ("none", "full", "selective")


# ----------------------------------------------------------------------------- random generators


def generators_of(*modules) -> list[np.random.Generator]:
    """Every np.random.Generator in the modules' trees (Dropout's `rng`, attention's `attn_rng`), once each."""
    found = {}
    for module in modules:
        for _, sub in module.named_modules():
            for value in vars(sub).values():
                if isinstance(value, np.random.Generator):
                    found[id(value)] = value
    return list(found.values())


def _states(generators) -> list[dict]:
    return [g.bit_generator.state for g in generators]


def _set_states(generators, states) -> None:
    for g, state in zip(generators, states):
        g.bit_generator.state = state


@contextlib.contextmanager
def enable_grad():
    """Record operations again inside a `no_grad()` region (torch.enable_grad): the recomputation
    must build a graph even when backward itself was called with recording off."""
    previous, tensor._grad_enabled = tensor._grad_enabled, True
    try:
        yield
    finally:
        tensor._grad_enabled = previous


# ----------------------------------------------------------------------------- checkpoint


class Replay:
    """What backward needs to run the function again exactly as the forward did: the function,
    its non-tensor arguments, which inputs were tensors that required grad, the generators'
    states before and after the forward, and the autocast policy and kernel path in force."""

    def __init__(self, function, inputs, generators):
        self.function = function
        self.args = tuple(None if isinstance(x, Tensor) else x for x in inputs)
        self.is_tensor = tuple(isinstance(x, Tensor) for x in inputs)
        self.requires_grad = tuple(isinstance(x, Tensor) and x.requires_grad for x in inputs)
        self.generators = list(generators)
        self.rng_before = _states(self.generators)
        self.rng_after = None  # set once the forward has drawn its masks
        self.output = None  # the forward's result, on its way into the graph node
        self.autocast = tensor._autocast  # chapter 10's policy (None outside autocast)
        self.kernels = kernels.current()

    @contextlib.contextmanager
    def as_in_forward(self):
        """Recording on, the forward's policy and kernel path, the generators as the forward found
        them; afterwards the generators go back to where they are now (so later draws are unaffected)."""
        now = _states(self.generators)
        _set_states(self.generators, self.rng_before)
        previous_policy = set_autocast(self.autocast)
        try:
            with kernels.kernels(self.kernels), enable_grad():
                yield
            if _states(self.generators) != self.rng_after:
                raise RuntimeError("checkpoint: the recomputation drew a different amount of random numbers "
                                   "than the forward did; the function must draw the same way each time it runs")
        finally:
            set_autocast(previous_policy)
            _set_states(self.generators, now)


_recorded: list | None = None  # sizes of recomputed graphs, while `record_recomputation()` is active


@contextlib.contextmanager
def record_recomputation():
    """`with record_recomputation() as sizes:` appends graph_bytes of each recomputed graph, as
    backward rebuilds it: the memory that exists only transiently, one checkpoint at a time."""
    global _recorded
    previous, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = previous


class Checkpoint(Function):
    """The graph node of a checkpointed function. Forward hands on the output that was computed
    under no_grad and saves only the inputs' arrays; backward recomputes and backpropagates."""

    autocast = "pass"  # chapter 10: the output keeps the format the function gave it

    @staticmethod
    def forward(ctx, replay, *arrays):
        ctx.replay = replay
        ctx.save_for_backward(*(a for a, t in zip(arrays, replay.is_tensor) if t))  # all it keeps
        output, replay.output = replay.output, None  # computed by `checkpoint` under no_grad
        return output

    @staticmethod
    def backward(ctx, grad):
        replay = ctx.replay
        saved = iter(ctx.saved)
        inputs = [Tensor(next(saved), requires_grad=r) if t else a  # detached: the recomputed graph ends here
                  for a, t, r in zip(replay.args, replay.is_tensor, replay.requires_grad)]
        with replay.as_in_forward():
            output = replay.function(*inputs)
        if _recorded is not None:
            _recorded.append(graph_bytes(output))
        if output.requires_grad:
            output.backward(grad)  # a backward inside the backward: parameters' .grad and hooks happen here
        return (None, *(x.grad if isinstance(x, Tensor) else None for x in inputs))


def checkpoint(function, *inputs, generators=None):
    """`function(*inputs)`, keeping for backward only the inputs; backward runs it again.

    `function` returns one Tensor. `generators`: the np.random.Generators it draws from (dropout);
    by default those of `function`'s module tree when it is a Module, else none. Outside
    recording (no_grad: evaluation, generation) it is simply `function(*inputs)`.
    """
    if generators is None:
        generators = generators_of(function) if isinstance(function, Module) else []
    if not is_grad_enabled():
        return function(*inputs)  # nothing would be kept for backward anyway
    tensors = [x for x in inputs if isinstance(x, Tensor)]
    if not any(x.requires_grad for x in tensors):
        raise ValueError(f"checkpoint: none of the {len(tensors)} tensor inputs requires grad, so backward would "
                         "never reach the recomputation (parameters inside would get no gradient)")
    replay = Replay(function, inputs, generators)
    with no_grad():
        output = function(*inputs)
    if not isinstance(output, Tensor):
        raise TypeError(f"checkpoint: the function must return one Tensor, got {type(output).__name__}")
    replay.rng_after = _states(replay.generators)
    replay.output = output.data
    return Checkpoint.apply(replay, *inputs)


# ----------------------------------------------------------------------------- runs of blocks


def check_recompute(mode: str, segments, n_layer: int) -> None:
    """The settings of `GPT.set_recompute`, checked in one line each."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {', '.join(MODES)}; got {mode!r}")
    if segments is None:
        return
    if mode != "full":
        raise ValueError(f"segments={segments} applies to recompute='full' only, not recompute={mode!r}")
    if not isinstance(segments, (int, np.integer)) or isinstance(segments, bool) or not 1 <= segments <= n_layer:
        raise ValueError(f"segments must be an integer from 1 to n_layer={n_layer}, got {segments!r}")


def segment_bounds(n: int, segments: int) -> list[tuple[int, int]]:
    """[start, end) of `segments` runs of consecutive blocks out of n; the first n % segments
    runs get one block more."""
    sizes = [n // segments + (r < n % segments) for r in range(segments)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(starts[r]), int(starts[r + 1])) for r in range(segments)]


def checkpoint_sequential(modules, segments: int, x):
    """Run `modules` one after another on x as `segments` checkpointed runs (torch's function of
    that name, except that the last run is checkpointed too). Chen et al. 2016: with n blocks,
    k runs keep k inputs plus, transiently, one run of n/k blocks: k ≈ sqrt(n) balances the two."""
    modules = list(modules)
    if not isinstance(segments, (int, np.integer)) or not 1 <= segments <= len(modules):
        raise ValueError(f"checkpoint_sequential: segments must be an integer from 1 to {len(modules)}, "
                         f"got {segments!r}")
    for start, end in segment_bounds(len(modules), segments):
        run = modules[start:end]
        x = checkpoint(_Sequence(run), x, generators=generators_of(*run))
    return x


class _Sequence:
    """Blocks applied one after another (a function, not a Module: the blocks stay the GPT's)."""

    def __init__(self, modules):
        self.modules = modules

    def __call__(self, x):
        for module in self.modules:
            x = module(x)
        return x
