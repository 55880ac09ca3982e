"""What one rank did, recorded for the trace of the whole job (chapter 5: where the time goes).

One idea: a trace is chapter 3's timeline with everything in it. A `Recorder` is a `Timeline`
(minidist/timeline.py: events (name, kind, start, end) on the clock every process of a machine
shares) that also keeps each event's details (`args`), the two ends of every point-to-point
message (`flows`) and the memory ledger after every step (`counters`). While it is installed
(`timeline.RECORDER`, `tensor.set_tracer`) four places report to it:

    the engine         every backward() (core/tensor.py) and every layer's forward (core/nn.py);
                       a layer's backward is the stretch from when backward reaches its output
                       (an identity node, `_EnterBackward`, as FSDP's `RunInBackward`) to the next
    the strategies     their own Timeline spans ("forward 0", a pipeline's waits) and the optimizer
    the collectives    every call, from its start to when it is seen complete, with its bytes
    the messages       each send as it is posted, each receive when it is seen complete

Event kinds: "step", "forward", "backward" (per micro-batch), "layer" (a layer's forward or
backward), "optimizer", "wait" (a wait the engine names: a pipeline stage idle for its neighbour),
"comm" (a collective), "p2p" (a message), "comm wait" (blocked on a message).
"""
from __future__ import annotations

import contextlib

from minidist import timeline
from minidist.comm import traffic
from minidist.core.tensor import Context, Function, Tensor
from minidist.timeline import Timeline, now


class Recorder(Timeline):
    """One rank's recording: a Timeline plus args, flows and counters."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.clock = {"offset": 0.0}  # this clock against rank 0's (clock.align)
        self.args: dict[int, dict] = {}  # event index -> its details
        self.flows: list[tuple] = []  # ("s" | "f", event index, message key)
        self.counters: list[tuple] = []  # (name, time, {series: value})
        self.open: list[str] = []  # kinds of the spans open now, innermost last
        self.frames: list[list] = []  # backward() calls in progress: [layer whose backward runs, since]
        self.sent: dict[tuple, int] = {}  # messages so far per (group, source, destination, tag)
        self.received: dict[tuple, int] = {}
        self.steps_open = 0
        self.microbatch = {"forward": 0, "backward": 0}  # generic spans so far in this step

    # -- spans
    def add(self, name: str, kind: str, start: float, end: float, args: dict | None = None) -> int:
        self.events.append((name, kind, start, end))
        if args:
            self.args[len(self.events) - 1] = args
        return len(self.events) - 1

    @contextlib.contextmanager
    def span(self, name: str, kind: str, generic: bool = False, args: dict | None = None):
        """A span of this rank's main thread. A `generic` one (from code that does not know the
        strategy) is left out inside a span of its kind, and a forward or backward is numbered."""
        if generic and kind in self.open:
            yield
            return
        if generic and kind in self.microbatch:
            name = self._numbered(kind)
        self.open.append(kind)
        if kind == "step":
            self.steps_open += 1
            self.microbatch = {"forward": 0, "backward": 0}
        start = now()
        try:
            yield
        finally:
            end = now()
            self.open.pop()
            self.steps_open -= kind == "step"
            self.add(name, kind, start, end, args)

    def counter(self, name: str, values: dict) -> None:
        self.counters.append((name, now(), {k: v for k, v in values.items() if isinstance(v, (int, float))}))

    # -- the engine (tensor.set_tracer)
    def layer(self, module, args, kwargs):
        """Run a marked module's forward as a span; mark its output so its backward is one too."""
        if not self.steps_open:  # sampling between steps, checks: not the training's time
            return module.forward(*args, **kwargs)
        self._end_layer_backward()  # a forward inside backward (recomputation) ends that layer's stretch
        root = getattr(module, "layer_root", False)
        start = now()
        out = module.forward(*args, **kwargs)
        end = now()
        if root:  # the whole model (or stage): one micro-batch's forward, unless the strategy named it
            if "forward" not in self.open:
                self.add(self._numbered("forward"), "forward", start, end, {"module": module.layer_name})
            return out
        self.add(f"forward {module.layer_name}", "layer", start, end)
        if isinstance(out, Tensor) and out.requires_grad:
            out = _enter_backward(out, module.layer_name, self)
        return out

    @contextlib.contextmanager
    def backward(self):
        """One backward() call: a span (unless the strategy names its own), and its layers' stretches."""
        self._end_layer_backward()  # a backward inside backward (recomputation) interrupts the outer one
        outer = not self.frames
        self.frames.append([None, 0.0])
        start = now()
        try:
            yield
        finally:
            self._end_layer_backward()
            self.frames.pop()
            if outer and self.steps_open and "backward" not in self.open:
                self.add(self._numbered("backward"), "backward", start, now())

    def _numbered(self, kind: str) -> str:
        """"forward 2": the step's third forward (a micro-batch) the strategy did not name itself."""
        self.microbatch[kind] += 1
        return f"{kind} {self.microbatch[kind] - 1}"

    def entered_backward(self, name: str) -> None:
        """Backward has reached layer `name`'s output: its stretch begins, the previous one ends."""
        if self.frames:
            self._end_layer_backward()
            self.frames[-1][:] = [name, now()]

    def _end_layer_backward(self) -> None:
        if self.frames and self.frames[-1][0] is not None:
            name, start = self.frames[-1]
            self.add(f"backward {name}", "layer", start, now())
            self.frames[-1][0] = None

    # -- the collectives (comm/collectives.py)
    def begin_collective(self, ctx, async_op: bool) -> None:
        """A collective starts: count its messages apart (`CallCounter`) and note when."""
        ctx.counts = CallCounter(ctx.counts)
        ctx.call = (now(), self, async_op)

    def end_collective(self, ctx, result) -> None:
        start, _, async_op = ctx.call
        kind, counts = ctx.kind, ctx.counts.own
        name, _, rest = kind.partition(".")
        algorithm, _, label = rest.partition("@")
        self.add(name, "comm", start, now(), {
            "algorithm": algorithm, "kind": kind, "group": world_ranks(ctx.world), "label": label or None,
            "bytes": counts.bytes_sent, "bytes_received": counts.bytes_received, "messages": counts.messages,
            "payload_bytes": int(getattr(result, "nbytes", 0)), "async": async_op})

    # -- the messages (comm/p2p.py, comm/waiting.py)
    def posted(self, request, start: float, private: bool) -> None:
        """A send or a receive was posted at `start` (on the group's own communicator, or its
        `private` one). A send is one short span and the start of its arrow; a receive is
        remembered until it is seen complete (`completed`)."""
        ranks = world_ranks(request.world)
        me, peer, sending = ranks[request.world.rank], ranks[request.peer], request.op == "send"
        group = (tuple(ranks), request.world.label, private)
        channel = (group, me, peer, request.tag) if sending else (group, peer, me, request.tag)
        seen = self.sent if sending else self.received
        key = (*channel, seen.get(channel, 0))  # MPI keeps one channel's messages in order: the n-th meets the n-th
        seen[channel] = key[-1] + 1
        if sending:
            index = self.add(f"send to {peer}", "p2p", start, now(), _message_args(request, peer))
            self.flows.append(("s", index, key))
        else:
            request.trace = (key, start, peer)

    def completed(self, requests, blocked_since: float | None) -> None:
        """`requests` are complete; if the rank waited for them from `blocked_since`, that wait is a span."""
        end = now()
        for r in requests:
            if r.trace is not None:
                key, start, peer = r.trace
                r.trace = None
                index = self.add(f"recv from {peer}", "p2p", start, end, _message_args(r, peer))
                self.flows.append(("f", index, key))
        if blocked_since is not None:
            self.add(f"wait {requests[0].describe()}", "comm wait", blocked_since, end)

    # -- what goes into the file
    def export(self) -> dict:
        return {"rank": self.rank, "events": self.events, "args": self.args, "flows": self.flows,
                "counters": self.counters}


def _message_args(request, peer: int) -> dict:
    return {"bytes": request.nbytes, "peer": peer, "tag": request.tag, "kind": request.kind}


def world_ranks(world) -> list[int]:
    """The world ranks of a group's members, in group order (made once per group)."""
    ranks = world.cache.get("world ranks")
    if ranks is None:
        from mpi4py import MPI

        ranks = world.cache["world ranks"] = list(MPI.Group.Translate_ranks(
            world.comm.Get_group(), list(range(world.size)), MPI.COMM_WORLD.Get_group()))
    return ranks


class CallCounter:
    """The counts of one collective call, added to its kind's `traffic.Counter` as they come, so a
    trace gives each call its own bytes even while several calls of one kind are in flight."""

    __slots__ = ("total", "own")

    def __init__(self, total):
        self.total, self.own = total, traffic.Counter()


def _tee(field: str):
    def get(self):
        return getattr(self.own, field)

    def set(self, value):
        setattr(self.total, field, getattr(self.total, field) + value - getattr(self.own, field))
        setattr(self.own, field, value)

    return property(get, set)


for _field in ("bytes_sent", "bytes_received", "messages", "messages_received", "calls"):
    setattr(CallCounter, _field, _tee(_field))


class _EnterBackward(Function):
    """Identity; when backward reaches it, the layer whose output it marks begins its backward."""

    @staticmethod
    def backward(ctx, grad):
        ctx.recorder.entered_backward(ctx.name)
        return (grad,)


def _enter_backward(out: Tensor, name: str, recorder: Recorder) -> Tensor:
    """`out` behind an `_EnterBackward` node. Built by hand rather than by `apply`, so that no
    autocast (chapter 10) copies it: the node shares `out`'s array, and the memory ledger's
    activation bytes do not change."""
    ctx = Context()
    ctx.name, ctx.recorder = name, recorder
    marked = Tensor(out.data)
    marked.requires_grad, marked._fn, marked._ctx, marked._inputs = True, _EnterBackward, ctx, (out,)
    return marked


def install(recorder: Recorder | None) -> None:
    """Make `recorder` the job's recording (None: stop recording)."""
    from minidist.core import tensor

    timeline.RECORDER = recorder
    tensor.set_tracer(recorder)
