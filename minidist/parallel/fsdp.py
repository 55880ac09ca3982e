"""ZeRO stage 3, FSDP-style: parameters live as chunks and are gathered one unit at a time.

Chapter 8. Between steps each rank keeps only its chunk of every unit (see zero.py's
`FlatUnit`): Ψ/N parameters. A unit's full weights exist only while they are used:

    forward   all_gather(unit) -> run the block -> release           (one block at a time)
    backward  all_gather(unit) again -> the block's backward -> reduce_scatter its gradients
              (zero.py's hooks) -> release

The root unit (embeddings, final LayerNorm, the tied LM head) is used at both ends of the
model, so it is gathered once when forward starts and released when its gradients are reduced,
as PyTorch FSDP keeps its root unit. Communication per step is therefore one all-gather of
everything plus a second one of the blocks, plus the reduce-scatter: ~1.5x data parallelism.

The one subtle part is *releasing*. Autograd keeps what backward needs: a Linear saves its
weight, a LayerNorm its gain. If those references stayed, the gathered weights would stay alive
until backward and nothing would be saved. PyTorch FSDP frees the storage behind them and
refills the same storage before backward. A NumPy array cannot be emptied under its views, so
this file does the equivalent by hand: after a block's forward it walks the block's part of the
graph and swaps every saved weight for a `Released` placeholder (and checks that nothing else
points into the gathered buffer); an identity Function on the block's output, `GatherForBackward`,
runs first in that block's backward, gathers the weights again and puts them back in place.
"""
from __future__ import annotations

import numpy as np

from minidist.comm import all_gather, unchecked
from minidist.tensor import Function, Tensor, is_grad_enabled


class Released:
    """Stands in a Function's saved arrays for parameter `index` of a released unit."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"Released(param {self.index})"


class GatherForBackward(Function):
    """Identity on a unit's output; its backward (the first of the unit's) re-gathers the unit."""

    @staticmethod
    def forward(ctx, x, owner, index):
        ctx.owner, ctx.index = owner, index
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.owner.before_backward(ctx.index)
        return grad, None, None


class FullyShardedGPT:
    """Runs a GPT whose parameters are sharded into `units` (unit 0 the root, unit i block i-1).

    `shards[i]` is this rank's chunk of unit i, the only persistent copy of its weights (the
    optimizer updates it in place). `live` counts the bytes of gathered units.
    """

    def __init__(self, model, units, shards, world, live):
        self.model, self.units, self.shards, self.world, self.live = model, units, shards, world, live
        self.full = [None] * len(units)  # unit i's gathered flat weights, while in use
        self.gathered_now = self.gathered_peak = 0  # bytes of gathered weights (the lesson's number)
        self.stashed = [[] for _ in units]  # contexts whose saved weights were swapped out
        for unit in units:
            for p in unit.params:
                p.data = np.empty(0, dtype=unit.dtype)  # the full model is gone: shards only

    # -- gather and release
    def gather(self, i: int) -> None:
        if self.full[i] is not None:
            return
        unit = self.units[i]
        full = np.empty(unit.padded, dtype=unit.dtype)
        with unchecked():
            all_gather(self.shards[i], group=self.world, out=full)
        self.live.add(full.nbytes)
        self.gathered_now += full.nbytes
        self.gathered_peak = max(self.gathered_peak, self.gathered_now)
        for p, view in zip(unit.params, unit.views(full)):
            p.data = view
        self.full[i] = full

    def release(self, i: int) -> None:
        if self.full[i] is None:
            return
        for p in self.units[i].params:
            p.data = np.empty(0, dtype=p.dtype)
        self.live.sub(self.full[i].nbytes)
        self.gathered_now -= self.full[i].nbytes
        self.full[i] = None

    # -- forward
    def __call__(self, idx, targets=None):
        self.gather(0)  # the root: embeddings now, the head at the end
        x = self.model.embed(idx)
        for i, block in enumerate(self.model.h, start=1):
            x = self._run_unit(i, block, x)
        return self.model.head(x, targets)

    def _run_unit(self, i: int, block, x):
        self.gather(i)
        y = block(x)
        if is_grad_enabled() and y.requires_grad:
            self._stash_saved_weights(i, y, x)
            y = GatherForBackward.apply(y, self, i)
        self.release(i)
        return y

    def _stash_saved_weights(self, i: int, output: Tensor, inp: Tensor) -> None:
        """Swap every saved reference to unit i's weights, in the graph from `inp` to `output`,
        for a Released placeholder; fail loudly if anything else still points into them."""
        unit, full = self.units[i], self.full[i]
        index_of = {id(p.data): k for k, p in enumerate(unit.params)}
        stack, seen = [output], {id(inp)}
        while stack:
            t = stack.pop()
            if id(t) in seen or t.is_leaf:
                continue
            seen.add(id(t))
            saved = tuple(Released(index_of[id(a)]) if id(a) in index_of else a for a in t._ctx.saved)
            leaks = [a for a in saved + (t.data,) if isinstance(a, np.ndarray) and np.may_share_memory(a, full)]
            if leaks:
                raise RuntimeError(f"FSDP: {t._fn.__name__} in {unit.name} keeps a view of the gathered weights "
                                   f"(shape {leaks[0].shape}) that cannot be released")
            t._ctx.saved = saved
            self.stashed[i].append(t._ctx)
            stack.extend(p for p in t._inputs if isinstance(p, Tensor))

    # -- backward (called by GatherForBackward and by zero.py's gradient hooks)
    def before_backward(self, i: int) -> None:
        self.gather(i)
        params = self.units[i].params
        for ctx in self.stashed[i]:
            ctx.saved = tuple(params[a.index].data if isinstance(a, Released) else a for a in ctx.saved)
        self.stashed[i] = []

    def after_backward(self, i: int) -> None:
        """Unit i's gradients are reduced: its gathered weights are needed no more."""
        self.stashed[i] = []
        self.release(i)

    # -- the full weights, for a consolidated state dict
    def full_state_dict(self) -> dict:
        """Every parameter, gathered unit by unit, keyed like the serial model. Collective."""
        state = {}
        for i, unit in enumerate(self.units):
            full = np.empty(unit.padded, dtype=unit.dtype)
            with unchecked():
                all_gather(self.shards[i], group=self.world, out=full)
            for name, view in zip(unit.names, unit.views(full)):
                state[name] = view.copy()
        return state
