"""Pipeline schedules as data: who does what, in which order (chapter 5).

One idea: a pipeline schedule is nothing but **one ordered list of instructions per rank** —
"receive the activation of micro-batch 3", "run forward 3", "send its output on", ..., "step the
optimizer". Write the lists down as data and three things become easy:

- one engine (`minidist/parallel/pipeline.py`) runs *any* schedule, reading its list top to bottom;
- the lists can be checked without MPI (`check`): every forward before its backward, every send
  matched by exactly one receive, and no deadlock;
- they can be simulated with ideal timings (`simulate`) to draw the schedule a textbook draws,
  beside the real run, and to compute its bubble: (p - 1) / (m + p - 1).

Three schedules, for p stages and m micro-batches:

- **GPipe** (`gpipe`): all m forwards, then all m backwards. Simple, but each stage holds the
  activations of all m micro-batches at once.
- **1F1B** (`one_f_one_b`, PipeDream-Flush / Megatron-LM): stage r first runs p - r - 1 warm-up
  forwards — exactly as many as it takes for micro-batch 0 to reach the last stage and its
  gradient to come back — then alternates one forward and one backward, then drains the
  remaining backwards (cool-down). Same bubble as GPipe, but stage r holds at most p - r
  micro-batches of activations instead of m.
- **Interleaved 1F1B** (`interleaved`, Megatron-LM's virtual pipeline stages): the model is cut
  into p * v chunks, rank r holding chunks r, r + p, ...; each instruction names its local chunk
  (0..v-1). The pipeline fills and drains in chunk-sized slots, so the bubble shrinks to
  (p - 1) / (v m + p - 1), for v times as many activation messages. m must be a multiple of p.

Naive model parallelism (chapter 4) is GPipe or 1F1B with m = 1.

A send is *posted* (`isend`): the engine does not wait for it to be received before going on.
That matters: with blocking (rendezvous) sends 1F1B deadlocks — stage r would sit in "send
forward i+1" while stage r+1 sits in "send backward i" — `simulate(..., blocking_sends=True)`
shows it. Megatron-LM avoids it the same way, by posting send and receive together.
"""
from __future__ import annotations

import functools

from typing import Iterator, NamedTuple

# instruction kinds
FORWARD, BACKWARD = "forward", "backward"
RECV_ACT, SEND_ACT = "recv_act", "send_act"      # activations travel forward: from rank r-1, to r+1
RECV_GRAD, SEND_GRAD = "recv_grad", "send_grad"  # their gradients travel backward: from r+1, to r-1
STEP = "step"                                    # clip, sync tied weights, optimizer update


class Instruction(NamedTuple):
    kind: str
    micro: int = -1  # micro-batch index (-1 for the optimizer step)
    chunk: int = 0   # which of this rank's model chunks (virtual stages); always 0 unless interleaved

    def __repr__(self):
        short = {FORWARD: "F", BACKWARD: "B", RECV_ACT: "recv_act ", SEND_ACT: "send_act ",
                 RECV_GRAD: "recv_grad ", SEND_GRAD: "send_grad "}
        if self.kind == STEP:
            return "step"
        # chunk 0 prints as before ("F3"); a later chunk as "F3.1" = micro-batch 3 on chunk 1
        return f"{short[self.kind]}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


class Deadlock(RuntimeError):
    """No rank can make progress, though some have instructions left."""


# ----------------------------------------------------------------------------- the two schedules


def _forward(rank: int, stages: int, i: int, chunk: int = 0, chunks: int = 1) -> Iterator[Instruction]:
    """Forward of micro-batch i on virtual stage chunk * p + rank: receive unless it is the very
    first of the p * v virtual stages, send on unless it is the very last."""
    virtual = chunk * stages + rank
    if virtual > 0:
        yield Instruction(RECV_ACT, i, chunk)
    yield Instruction(FORWARD, i, chunk)
    if virtual < stages * chunks - 1:
        yield Instruction(SEND_ACT, i, chunk)


def _backward(rank: int, stages: int, i: int, chunk: int = 0, chunks: int = 1) -> Iterator[Instruction]:
    virtual = chunk * stages + rank
    if virtual < stages * chunks - 1:
        yield Instruction(RECV_GRAD, i, chunk)
    yield Instruction(BACKWARD, i, chunk)
    if virtual > 0:
        yield Instruction(SEND_GRAD, i, chunk)


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
    ### BEGIN SOLUTION assignment=one_f_one_b
    warmup = min(stages - rank - 1 if warmup is None else max(0, warmup), microbatches)
    ### END SOLUTION
    for kind, i in in_1f1b_order(microbatches, warmup):
        yield from (_forward if kind == FORWARD else _backward)(rank, stages, i)
    yield Instruction(STEP)


def in_1f1b_order(count: int, warmup: int) -> Iterator[tuple[str, int]]:
    """The order of 1F1B on one stage, as (FORWARD or BACKWARD, micro-batch) pairs: `warmup`
    forwards, then one forward and one backward (forward warmup + j, backward j) while forwards
    are left, then the remaining backwards (the cool-down). Each of `count` micro-batches goes
    forward once and back once, in order. Interleaved 1F1B walks its virtual micro-batches in
    the same order."""
    ### BEGIN SOLUTION assignment=one_f_one_b
    for i in range(warmup):
        yield FORWARD, i
    for j in range(count - warmup):  # steady state: forward warmup + j, then backward j
        yield FORWARD, warmup + j
        yield BACKWARD, j
    for j in range(count - warmup, count):  # cool-down
        yield BACKWARD, j
    ### END SOLUTION


def check_interleaved(stages: int, microbatches: int, virtual_stages: int) -> None:
    """The interleaved schedule's own conditions (Megatron-LM's): v >= 1 and m a multiple of p."""
    if virtual_stages < 1:
        raise ValueError(f"interleaved schedule needs virtual_stages >= 1, got {virtual_stages}")
    if microbatches % stages:
        raise ValueError(f"interleaved schedule needs the micro-batches to be a multiple of the stages "
                         f"(as Megatron-LM's): m={microbatches} is not a multiple of pp={stages} "
                         f"({microbatches} % {stages} = {microbatches % stages})")


def interleaved(rank: int, stages: int, microbatches: int, virtual_stages: int = 2,
                warmup: int | None = None) -> Iterator[Instruction]:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline stages): the model is cut into p * v
    chunks; rank r holds chunks r, r + p, r + 2p, ... (its local chunks 0..v-1).

    Each rank walks through m * v "virtual micro-batches" k = 0, 1, ...: in groups of p
    micro-batches, first chunk 0 of the group, then chunk 1, ..., then the next group. So
    forward k is micro-batch (k // (p v)) * p + k % p on chunk (k % (p v)) // p; backwards go
    through the chunks in reverse (the last chunk's gradient comes first). That grouping is why
    m must be a multiple of p. Warm-up: (v - 1) * p forwards to get micro-batch 0 into the last
    chunk, plus 2 * (p - r - 1) to cover its way to the last rank and its gradient's way back;
    then one forward / one backward; then the cool-down. (With free messages one warm-up forward
    fewer on every rank but the last keeps the same bubble — tests/test_schedules.py shows it;
    we keep Megatron-LM's count, the one its code uses. `warmup` overrides it.)
    """
    _check_args(rank, stages, microbatches)
    check_interleaved(stages, microbatches, virtual_stages)
    p, v = stages, virtual_stages
    total = microbatches * v

    def micro_chunk(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        return group * p + within % p, (chunk if forward else v - 1 - chunk)

    if warmup is None:
        warmup = 2 * (p - rank - 1) + (v - 1) * p
    warmup = min(max(0, warmup), total)

    for kind, k in in_1f1b_order(total, warmup):
        i, c = micro_chunk(k, kind == FORWARD)
        yield from (_forward if kind == FORWARD else _backward)(rank, p, i, c, v)
    yield Instruction(STEP)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def make_schedule(name: str, rank: int, stages: int, microbatches: int, virtual_stages: int = 1) -> list[Instruction]:
    """Rank `rank`'s instruction list of schedule `name` ("gpipe", "1f1b" or "interleaved" with
    `virtual_stages` chunks per rank; the other two have one chunk per rank)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose from {sorted(SCHEDULES)}")
    if name == "interleaved":
        return list(interleaved(rank, stages, microbatches, virtual_stages))
    if virtual_stages != 1:
        raise ValueError(f"schedule {name!r} holds one chunk per rank; virtual_stages={virtual_stages} "
                         "needs schedule 'interleaved'")
    return list(SCHEDULES[name](rank, stages, microbatches))


@functools.lru_cache(maxsize=256)
def all_ranks(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Instruction]]:
    return [make_schedule(name, r, stages, microbatches, virtual_stages) for r in range(stages)]


def bubble_theory(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction of a pipeline: (p - 1) / (v m + p - 1); v = 1 for GPipe and 1F1B.

    Interleaved: each chunk's forward and backward take 1/v of a whole stage's, and the schedule
    fills and drains the pipeline in p - 1 *chunk* slots instead of p - 1 stage slots."""
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def peak_in_flight(schedule: list[Instruction]) -> int:
    """Most micro-batches whose forward is done and backward is not: activations held at once."""
    held = peak = 0
    for ins in schedule:
        held += (ins.kind == FORWARD) - (ins.kind == BACKWARD)
        peak = max(peak, held)
    return peak


# ----------------------------------------------------------------------------- checking

# a message's direction in virtual stages, and the instruction that meets it at the other end
_TRAVEL = {SEND_ACT: (1, RECV_ACT), RECV_ACT: (-1, SEND_ACT), SEND_GRAD: (-1, RECV_GRAD), RECV_GRAD: (1, SEND_GRAD)}


def peer_of(ins: Instruction, rank: int, stages: int) -> tuple[int, Instruction]:
    """Where a message goes (or comes from), and the instruction that matches it there.

    Counted in virtual stages s = chunk * p + rank: activations go from s to s + 1, gradients from
    s to s - 1. With one chunk per rank that is rank r + 1 or r - 1; interleaved, the last rank's
    chunk c sends on to rank 0's chunk c + 1 (the pipeline wraps around)."""
    step, match = _TRAVEL[ins.kind]
    chunk, peer = divmod(ins.chunk * stages + rank + step, stages)
    return peer, Instruction(match, ins.micro, chunk)


def _which(ins: Instruction) -> str:
    return f"{ins.micro}" + (f" (chunk {ins.chunk})" if ins.chunk else "")


def check(schedules: list[list[Instruction]]) -> None:
    """Raise ValueError (or Deadlock) unless the per-rank lists form a correct pipeline step.

    Each rank runs forward and backward of every micro-batch exactly once, forward first, and
    ends with one optimizer step; each send has exactly one matching receive on the neighbour
    (and vice versa); and the lists run to the end without deadlock (posted sends).
    """
    p = len(schedules)
    # the work: every (micro-batch, chunk) pair any rank runs; each rank must run each once
    micro = sorted({(ins.micro, ins.chunk) for s in schedules for ins in s if ins.kind == FORWARD})
    for r, schedule in enumerate(schedules):
        done_forward = set()
        for ins in schedule:
            if ins.kind == FORWARD:
                if (ins.micro, ins.chunk) in done_forward:
                    raise ValueError(f"rank {r}: forward {_which(ins)} twice")
                done_forward.add((ins.micro, ins.chunk))
            elif ins.kind == BACKWARD and (ins.micro, ins.chunk) not in done_forward:
                raise ValueError(f"rank {r}: backward {_which(ins)} before its forward")
        backwards = sorted((ins.micro, ins.chunk) for ins in schedule if ins.kind == BACKWARD)
        if sorted(done_forward) != micro or backwards != micro:
            raise ValueError(f"rank {r}: forwards {sorted(done_forward)} and backwards {backwards} "
                             f"(micro-batch, chunk), expected each of {micro} once")
        if [ins.kind for ins in schedule].count(STEP) != 1 or schedule[-1].kind != STEP:
            raise ValueError(f"rank {r}: must end with exactly one optimizer step")
        for ins in schedule:
            if ins.kind in (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD):
                peer, match = peer_of(ins, r, p)
                if match.chunk < 0:
                    raise ValueError(f"rank {r}: {ins!r} has no neighbour (it is the first stage)")
                if schedules[peer].count(match) != 1 or schedule.count(ins) != 1:
                    raise ValueError(f"rank {r}: {ins!r} is not matched by exactly one {match!r} on rank {peer}")
    simulate(schedules)  # raises Deadlock if the lists cannot run to the end


# ----------------------------------------------------------------------------- ideal timings


def simulate(schedules: list[list[Instruction]], forward=1.0, backward=2.0,
             blocking_sends: bool = False, duration=None, latency: float = 0.0) -> list[list[tuple]]:
    """Run the lists with ideal timings: forward and backward take fixed times, messages are free.
    `forward` and `backward` are seconds, or functions of (rank, chunk) giving each stage its own
    (the planner's predicted costs, chapter 9: unequal stages show as bubble). `duration`, a
    function of (rank, instruction), gives each forward and backward its own time instead (a real
    step replayed with its measured times); with `latency` every receive ends that long after both
    the receiver reached it and the message was posted (what a receive costs).

    Returns per-rank events (name, kind, start, end) like `minidist.timeline.Timeline`, so the
    ideal schedule draws with `plot_gantt` beside a real run. Waiting for a message shows as a
    "wait" event. With `blocking_sends=True` a send also waits until the receiver reaches the
    matching receive (MPI's rendezvous protocol for large messages). Raises `Deadlock`, naming
    each stuck rank's next instruction, when no rank can move.
    """
    p = len(schedules)
    pc, clock = [0] * p, [0.0] * p
    posted: dict[tuple, float] = {}  # (sender, send instruction) -> time the send was posted
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
                    seconds = forward if ins.kind == FORWARD else backward
                    if duration is not None:
                        seconds = duration(r, ins)
                    elif callable(seconds):
                        seconds = seconds(r, ins.chunk)
                    name = f"{ins.kind} {ins.micro}" + (f".{ins.chunk}" if ins.chunk else "")  # as the engine's
                    events[r].append((name, ins.kind, clock[r], clock[r] + seconds))
                    clock[r] += seconds
                elif ins.kind == STEP:
                    pass
                elif ins.kind in (SEND_ACT, SEND_GRAD):
                    peer, match = peer_of(ins, r, p)
                    if blocking_sends:
                        if next_of(peer) != match:
                            break  # rendezvous: wait until the receiver is there
                        t = max(clock[r], clock[peer])
                        wait_until(r, t)
                        wait_until(peer, t)
                        pc[peer] += 1
                    else:
                        posted[(r, ins)] = clock[r]
                else:  # a receive: possible once the matching send was posted
                    peer, match = peer_of(ins, r, p)
                    key = (peer, match)
                    if key not in posted:
                        break
                    wait_until(r, max(posted.pop(key), clock[r]) + latency)
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
