"""Pipeline schedules as data: who does what, in which order (chapter 5).

One idea: a pipeline schedule is nothing but **one ordered list of instructions per rank** —
"receive the activation of micro-batch 3", "run forward 3", "send its output on", ..., "step the
optimizer". Write the lists down as data and three things become easy:

- one engine (`minidist/parallel/pipeline.py`) runs *any* schedule, reading its list top to bottom;
- the lists can be checked without MPI (`check`): every forward before its backward, every send
  matched by exactly one receive, and no deadlock;
- they can be simulated with ideal timings (`simulate`) to draw the schedule a textbook draws,
  beside the real run, and to compute its bubble: (p - 1) / (m + p - 1).

Two schedules, for p stages and m micro-batches:

- **GPipe** (`gpipe`): all m forwards, then all m backwards. Simple, but each stage holds the
  activations of all m micro-batches at once.
- **1F1B** (`one_f_one_b`, PipeDream-Flush / Megatron-LM): stage r first runs p - r - 1 warm-up
  forwards — exactly as many as it takes for micro-batch 0 to reach the last stage and its
  gradient to come back — then alternates one forward and one backward, then drains the
  remaining backwards (cool-down). Same bubble as GPipe, but stage r holds at most p - r
  micro-batches of activations instead of m.

Naive model parallelism (chapter 4) is either schedule with m = 1.

A send is *posted* (`isend`): the engine does not wait for it to be received before going on.
That matters: with blocking (rendezvous) sends 1F1B deadlocks — stage r would sit in "send
forward i+1" while stage r+1 sits in "send backward i" — `simulate(..., blocking_sends=True)`
shows it. Megatron-LM avoids it the same way, by posting send and receive together.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

# instruction kinds
FORWARD, BACKWARD = "forward", "backward"
RECV_ACT, SEND_ACT = "recv_act", "send_act"      # activations travel forward: from rank r-1, to r+1
RECV_GRAD, SEND_GRAD = "recv_grad", "send_grad"  # their gradients travel backward: from r+1, to r-1
STEP = "step"                                    # clip, sync tied weights, optimizer update


class Instruction(NamedTuple):
    kind: str
    micro: int = -1  # micro-batch index (-1 for the optimizer step)

    def __repr__(self):
        short = {FORWARD: "F", BACKWARD: "B", RECV_ACT: "recv_act ", SEND_ACT: "send_act ",
                 RECV_GRAD: "recv_grad ", SEND_GRAD: "send_grad "}
        return "step" if self.kind == STEP else f"{short[self.kind]}{self.micro}"


class Deadlock(RuntimeError):
    """No rank can make progress, though some have instructions left."""


# ----------------------------------------------------------------------------- the two schedules


def _forward(rank: int, stages: int, i: int) -> Iterator[Instruction]:
    if rank > 0:
        yield Instruction(RECV_ACT, i)
    yield Instruction(FORWARD, i)
    if rank < stages - 1:
        yield Instruction(SEND_ACT, i)


def _backward(rank: int, stages: int, i: int) -> Iterator[Instruction]:
    if rank < stages - 1:
        yield Instruction(RECV_GRAD, i)
    yield Instruction(BACKWARD, i)
    if rank > 0:
        yield Instruction(SEND_GRAD, i)


def _check_args(rank: int, stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1 or not 0 <= rank < stages:
        raise ValueError(f"schedule needs stages >= 1, microbatches >= 1 and 0 <= rank < stages; "
                         f"got rank={rank}, stages={stages}, microbatches={microbatches}")


def gpipe(rank: int, stages: int, microbatches: int) -> Iterator[Instruction]:
    """GPipe: all forwards (F0 F1 ... F(m-1)), then all backwards (B0 ... B(m-1)), then step."""
    _check_args(rank, stages, microbatches)
    for i in range(microbatches):
        yield from _forward(rank, stages, i)
    for i in range(microbatches):
        yield from _backward(rank, stages, i)
    yield Instruction(STEP)


def one_f_one_b(rank: int, stages: int, microbatches: int, warmup: int | None = None) -> Iterator[Instruction]:
    """1F1B: p - rank - 1 warm-up forwards, then one forward / one backward, then the cool-down.

    Why p - rank - 1: backward 0 on this stage can start only after micro-batch 0 has gone
    forward through the p - rank - 1 stages after this one and its gradient has come back
    through them. Keeping busy until then takes exactly that many extra forwards; fewer leaves
    the stage idle, more only holds more activations without finishing sooner. (`warmup`
    overrides the count, to try exactly that: see tests/test_schedules.py and notebook 05.)
    """
    _check_args(rank, stages, microbatches)
    warmup = min(stages - rank - 1 if warmup is None else max(0, warmup), microbatches)
    for i in range(warmup):
        yield from _forward(rank, stages, i)
    for j in range(microbatches - warmup):  # steady state: forward warmup+j, then backward j
        yield from _forward(rank, stages, warmup + j)
        yield from _backward(rank, stages, j)
    for j in range(microbatches - warmup, microbatches):  # cool-down
        yield from _backward(rank, stages, j)
    yield Instruction(STEP)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, rank: int, stages: int, microbatches: int) -> list[Instruction]:
    """Rank `rank`'s instruction list of schedule `name` ("gpipe" or "1f1b")."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose from {sorted(SCHEDULES)}")
    return list(SCHEDULES[name](rank, stages, microbatches))


def all_ranks(name: str, stages: int, microbatches: int) -> list[list[Instruction]]:
    return [make_schedule(name, r, stages, microbatches) for r in range(stages)]


def bubble_theory(stages: int, microbatches: int) -> float:
    """The idle fraction of a GPipe or 1F1B pipeline: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def peak_in_flight(schedule: list[Instruction]) -> int:
    """Most micro-batches whose forward is done and backward is not: activations held at once."""
    held = peak = 0
    for ins in schedule:
        held += (ins.kind == FORWARD) - (ins.kind == BACKWARD)
        peak = max(peak, held)
    return peak


# ----------------------------------------------------------------------------- checking


def _peer_of(kind: str, rank: int) -> tuple[int, str]:
    """Where a message goes (or comes from), and the instruction that matches it there."""
    return {SEND_ACT: (rank + 1, RECV_ACT), RECV_ACT: (rank - 1, SEND_ACT),
            SEND_GRAD: (rank - 1, RECV_GRAD), RECV_GRAD: (rank + 1, SEND_GRAD)}[kind]


def check(schedules: list[list[Instruction]]) -> None:
    """Raise ValueError (or Deadlock) unless the per-rank lists form a correct pipeline step.

    Each rank runs forward and backward of every micro-batch exactly once, forward first, and
    ends with one optimizer step; each send has exactly one matching receive on the neighbour
    (and vice versa); and the lists run to the end without deadlock (posted sends).
    """
    p = len(schedules)
    micro = sorted({ins.micro for s in schedules for ins in s if ins.kind == FORWARD})
    for r, schedule in enumerate(schedules):
        done_forward = set()
        for ins in schedule:
            if ins.kind == FORWARD:
                if ins.micro in done_forward:
                    raise ValueError(f"rank {r}: forward {ins.micro} twice")
                done_forward.add(ins.micro)
            elif ins.kind == BACKWARD and ins.micro not in done_forward:
                raise ValueError(f"rank {r}: backward {ins.micro} before its forward")
        backwards = sorted(ins.micro for ins in schedule if ins.kind == BACKWARD)
        if sorted(done_forward) != micro or backwards != micro:
            raise ValueError(f"rank {r}: forwards {sorted(done_forward)} and backwards {backwards}, "
                             f"expected each of {micro} once")
        if [ins.kind for ins in schedule].count(STEP) != 1 or schedule[-1].kind != STEP:
            raise ValueError(f"rank {r}: must end with exactly one optimizer step")
        for ins in schedule:
            if ins.kind in (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD):
                peer, match = _peer_of(ins.kind, r)
                if not 0 <= peer < p:
                    raise ValueError(f"rank {r}: {ins!r} has no neighbour rank {peer}")
                if schedules[peer].count(Instruction(match, ins.micro)) != 1 or schedule.count(ins) != 1:
                    raise ValueError(f"rank {r}: {ins!r} is not matched by exactly one {match} {ins.micro} "
                                     f"on rank {peer}")
    simulate(schedules)  # raises Deadlock if the lists cannot run to the end


# ----------------------------------------------------------------------------- ideal timings


def simulate(schedules: list[list[Instruction]], forward: float = 1.0, backward: float = 2.0,
             blocking_sends: bool = False) -> list[list[tuple]]:
    """Run the lists with ideal timings: forward and backward take fixed times, messages are free.

    Returns per-rank events (name, kind, start, end) like `minidist.timeline.Timeline`, so the
    ideal schedule draws with `plot_gantt` beside a real run. Waiting for a message shows as a
    "wait" event. With `blocking_sends=True` a send also waits until the receiver reaches the
    matching receive (MPI's rendezvous protocol for large messages). Raises `Deadlock`, naming
    each stuck rank's next instruction, when no rank can move.
    """
    p = len(schedules)
    pc, clock = [0] * p, [0.0] * p
    posted: dict[tuple, float] = {}  # (sender, kind, micro) -> time the send was posted
    events: list[list[tuple]] = [[] for _ in range(p)]

    def next_of(r):
        return schedules[r][pc[r]] if pc[r] < len(schedules[r]) else None

    def wait_until(r, t):
        if t > clock[r]:
            events[r].append(("wait", "wait", clock[r], t))
            clock[r] = t

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while (ins := next_of(r)) is not None:
                if ins.kind in (FORWARD, BACKWARD):
                    duration = forward if ins.kind == FORWARD else backward
                    events[r].append((f"{ins.kind} {ins.micro}", ins.kind, clock[r], clock[r] + duration))
                    clock[r] += duration
                elif ins.kind == STEP:
                    pass
                elif ins.kind in (SEND_ACT, SEND_GRAD):
                    peer, match = _peer_of(ins.kind, r)
                    if blocking_sends:
                        if next_of(peer) != Instruction(match, ins.micro):
                            break  # rendezvous: wait until the receiver is there
                        t = max(clock[r], clock[peer])
                        wait_until(r, t)
                        wait_until(peer, t)
                        pc[peer] += 1
                    else:
                        posted[(r, ins.kind, ins.micro)] = clock[r]
                else:  # a receive: possible once the matching send was posted
                    peer, match = _peer_of(ins.kind, r)
                    key = (peer, match, ins.micro)
                    if key not in posted:
                        break
                    wait_until(r, posted.pop(key))
                pc[r] += 1
                progress = True
    stuck = {r: next_of(r) for r in range(p) if next_of(r) is not None}
    if stuck:
        raise Deadlock("pipeline deadlock: " + "; ".join(f"rank {r} waits at {ins!r}" for r, ins in stuck.items()))
    return events


def bubble_fraction(per_rank_events: list[list[tuple]]) -> float:
    """Idle share of the pipeline: 1 - (sum of forward and backward time) / (p x span), where the
    span runs from the first forward to the last backward on any rank. The same formula measures
    the real run (from its timeline) and the ideal one (from `simulate`)."""
    work = [e for events in per_rank_events for e in events if e[1] in (FORWARD, BACKWARD)]
    if not work:
        return 0.0
    span = max(e[3] for e in work) - min(e[2] for e in work)
    busy = sum(e[3] - e[2] for e in work)
    return 1.0 - busy / (len(per_rank_events) * span)


def describe(schedules: list[list[Instruction]]) -> str:
    """One line per rank, compute only: 'rank 0: F0 F1 F2 B0 F3 B1 ...' (sends/receives left out)."""
    return "\n".join(f"rank {r}: " + " ".join(repr(i) for i in s if i.kind in (FORWARD, BACKWARD))
                     for r, s in enumerate(schedules))
