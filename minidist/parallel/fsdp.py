"""ZeRO stage 3, FSDP-style: parameters live as chunks and are gathered one unit at a time.

Chapter 8. Between steps each rank keeps only its chunk of every unit (see
`FlatUnit`, zero_partition.py): Ψ/N parameters. A unit's full weights exist only while they are used, and
`FullyShardedGPT._run_block` is the one place that decides when:

    forward   gather(unit) -> run the block -> release                 (one block at a time)
    backward  gather(unit) again -> the block's backward -> release    (stage 2's hooks
              reduce-scatter the block's gradients the moment they are complete)

Backward is driven by the autograd engine, which offers no hook on "a block's backward begins"
or "ends", so the forward brackets each block with an identity Function, `RunInBackward`, that
is handed what to do: on the block's output (the engine reaches it before any of the block's
operations) the unit's `gather_for_backward`, on the block's input (reached after all of them)
its `release`. It does only what it is handed; nothing calls back upwards.

The root unit (embeddings, final LayerNorm, the tied LM head) is used at both ends of the
model, so it is gathered once when forward starts and released when backward is over
(`finish_backward`), as PyTorch FSDP keeps its root unit. Communication per step is therefore
one all-gather of everything plus a second one of the blocks, plus the reduce-scatter: ~1.5x
data parallelism.

The one subtle part is *releasing*. Autograd keeps what backward needs: a Linear saves its
weight, a LayerNorm its gain. If those references stayed, the gathered weights would stay alive
until backward and nothing would be saved. PyTorch FSDP frees the storage behind them and
refills the same storage before backward. A NumPy array cannot be emptied under its views, so
this file does the equivalent by hand: after a block's forward it walks the block's part of the
graph and swaps every saved weight for a `Released` placeholder (and checks that nothing else
points into the gathered buffer); `gather_for_backward` puts the re-gathered weights back.
"""
from __future__ import annotations

import numpy as np

from minidist.comm import all_gather
from minidist.core.tensor import Function, Tensor, is_grad_enabled


class Released:
    """Stands in a Function's saved arrays for parameter `index` of a released unit."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"Released(param {self.index})"


class ShardedUnit:
    """One FSDP unit: this rank's chunk of a `FlatUnit` (the only copy of its weights kept between
    steps; the optimizer updates it in place) and, while gathered, the full weights.

    `counters` (zero.py's `LiveBytes`) count the bytes of gathered weights as they come and go.
    """

    def __init__(self, unit, shard: np.ndarray, group, counters):
        self.unit, self.shard, self.group, self.counters = unit, shard, group, counters
        self.full = None  # the gathered flat weights, while in use
        self.stashed = []  # contexts whose saved weights were swapped for Released
        for p in unit.params:
            p.data = np.empty(0, dtype=unit.dtype)  # the full model is gone: chunks only

    def gather(self) -> None:
        if self.full is not None:
            return
        self.full = np.empty(self.unit.padded, dtype=self.unit.dtype)
        all_gather(self.shard, group=self.group, out=self.full)
        for counter in self.counters:
            counter.add(self.full.nbytes)
        for p, view in zip(self.unit.params, self.unit.views(self.full)):
            p.data = view

    def release(self) -> None:
        if self.full is None:
            return
        for p in self.unit.params:
            p.data = np.empty(0, dtype=p.dtype)
        for counter in self.counters:
            counter.sub(self.full.nbytes)
        self.full = None

    def stash_saved_weights(self, output: Tensor, inp: Tensor) -> None:
        """Swap every saved reference to the gathered weights, in the graph from `inp` to
        `output`, for a Released placeholder; fail loudly if anything else still points into them."""
        index_of = {id(p.data): k for k, p in enumerate(self.unit.params)}
        self.stashed = []
        stack, seen = [output], {id(inp)}
        while stack:
            t = stack.pop()
            if id(t) in seen or t.is_leaf:
                continue
            seen.add(id(t))
            saved = tuple(Released(index_of[id(a)]) if id(a) in index_of else a for a in t._ctx.saved)
            leaks = [a for a in saved + (t.data,) if isinstance(a, np.ndarray) and np.may_share_memory(a, self.full)]
            if leaks:
                raise RuntimeError(f"FSDP: {t._fn.__name__} in {self.unit.name} keeps a view of the gathered "
                                   f"weights (shape {leaks[0].shape}) that cannot be released")
            t._ctx.saved = saved
            self.stashed.append(t._ctx)
            stack.extend(p for p in t._inputs if isinstance(p, Tensor))

    def gather_for_backward(self) -> None:
        """Gather again and put the weights back where the block's backward will look for them."""
        self.gather()
        params = self.unit.params
        for ctx in self.stashed:
            ctx.saved = tuple(params[a.index].data if isinstance(a, Released) else a for a in ctx.saved)
        self.stashed = []


class RunInBackward(Function):
    """Identity in forward; when backward reaches it, it first runs the `action` it was handed
    (a unit's gather or release: the engine has no hook on "a block's backward begins")."""

    autocast = "pass"  # chapter 10 (messages carry the tensor's own format)

    @staticmethod
    def forward(ctx, x, action):
        ctx.action = action
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.action()
        return grad, None


class FullyShardedGPT:
    """Runs a GPT whose parameters are sharded into `units` (unit 0 the root, unit i block i-1).

    `shards[i]` is this rank's chunk of unit i (see `ShardedUnit`); `counters` count the bytes of
    gathered weights.
    """

    def __init__(self, model, units, shards, group, counters):
        self.model, self.group = model, group
        self.units = [ShardedUnit(u, s, group, counters) for u, s in zip(units, shards)]
        self.root, self.blocks = self.units[0], self.units[1:]

    def __call__(self, idx, targets=None):
        self.root.gather()  # the embeddings now, the head at the end: kept until backward is over
        x = self.model.embed(idx)
        for unit, block in zip(self.blocks, self.model.h):
            x = self._run_block(unit, block, x)
        return self.model.head(x, targets)

    def _run_block(self, unit: ShardedUnit, block, x):
        """Gather, run, release; when autograd records, bracket the block so that its backward
        gathers the unit first and releases it last (chapter 8: one block whole at a time)."""
        unit.gather()
        recording = is_grad_enabled()
        if recording:
            x = RunInBackward.apply(x, unit.release)  # reached last of the block
        y = block(x)
        if recording:
            unit.stash_saved_weights(y, x)
            y = RunInBackward.apply(y, unit.gather_for_backward)  # reached first
        unit.release()
        return y

    def finish_backward(self) -> None:
        """Backward is over: release the root, and any unit whose backward did not run."""
        for unit in self.units:
            unit.stashed = []
            unit.release()

    def full_state_dict(self) -> dict:
        """Every parameter, gathered unit by unit, keyed like the serial model. Collective."""
        state = {}
        for sharded in self.units:
            unit = sharded.unit
            full = np.empty(unit.padded, dtype=unit.dtype)
            all_gather(sharded.shard, group=self.group, out=full)
            for name, view in zip(unit.names, unit.views(full)):
                state[name] = view.copy()
        return state
