"""Where a measured pipeline bubble comes from: the schedule re-run with the step's own costs (chapter 5).

The formula (p - 1) / (m + p - 1) assumes equal stages and free messages. A real step breaks both,
and each departure can be put back into the ideal simulation (`schedules.simulate`) one at a time,
from numbers the step itself recorded (`PipelineTrainer` keeps them per instruction):

1. `stage_bubble`: every forward and backward of a stage takes that stage's mean measured time
   (the embedding and the head inside the first and last), messages free: what *unequal stages*
   cost.
2. `replayed_bubble`: every forward and backward takes its own measured time plus the engine's
   time after it (posting sends, polling, bookkeeping: the gap to the rank's next event), and every
   receive ends the step's median receive cost after both its message was posted and the receiver
   reached it (`receive_seconds`, from the recorded post and arrival times): *jitter, the engine
   and the messages* put back. Its bubble is measured as the real one is, busy = the compute alone.

What the measured bubble has beyond the replay is what no recorded number explains (the clock, the
operating system); `bench pipeline` prints the four side by side.
"""
from __future__ import annotations

import numpy as np

from minidist.parallel import schedules as S

COMPUTE, ENGINE = 0, 1  # the last axis of the cost table


def instruction_costs(events: list[tuple], work: list[tuple], rank: int, shape: tuple) -> np.ndarray:
    """This rank's slice of the cost table `shape` = (p, v, 2, m, 2): for each of its forwards and
    backwards (`work`: (chunk, 0 forward | 1 backward, micro-batch, index of its event in
    `events`)) the compute seconds and the engine's seconds until the rank's next event (none after
    its last: the span ends there). Zeros elsewhere, so that a sum over ranks fills the table."""
    table = np.zeros(shape)
    last = max(index for *_, index in work) if work else -1
    for chunk, kind, micro, index in work:
        _, _, start, end = events[index]
        table[rank, chunk, kind, micro, COMPUTE] = end - start
        if index != last and index + 1 < len(events):
            table[rank, chunk, kind, micro, ENGINE] = max(0.0, events[index + 1][2] - end)
    return table


def message_times(posted: dict, received: dict, tags: int) -> np.ndarray:
    """This rank's rows of the message table (tags, 3): when each message it sent was posted, and
    when each it received was waited for and arrived (zeros elsewhere: a sum over ranks fills it;
    the clock is shared by the ranks of a machine, timeline.py)."""
    table = np.zeros((tags, 3))
    for tag, when in posted.items():
        table[tag, 0] = when
    for tag, (start, end) in received.items():
        table[tag, 1:] = start, end
    return table


def receive_seconds(table: np.ndarray) -> float:
    """What a receive costs beyond waiting for its sender: the median over the step's messages of
    (arrival - the later of the post and the start of the wait); 0 without messages."""
    sent = table[(table[:, 0] > 0) & (table[:, 2] > 0)]
    if not len(sent):
        return 0.0
    return float(np.median(sent[:, 2] - np.maximum(sent[:, 0], sent[:, 1])))


def stage_bubble(schedules: list[list[S.Instruction]], table: np.ndarray) -> float:
    """The bubble with each stage's mean compute time per chunk and direction, messages free."""
    mean = table[..., COMPUTE].mean(axis=3)  # (p, v, 2)
    events = S.simulate(schedules, forward=lambda r, c: mean[r, c, 0], backward=lambda r, c: mean[r, c, 1])
    return S.bubble_fraction(events)


def replayed_bubble(schedules: list[list[S.Instruction]], table: np.ndarray, receive: float,
                    each: bool = True) -> float:
    """The bubble of the step replayed: each instruction its own compute + engine time (`each`;
    else its stage's mean of them), every receive `receive` seconds; busy counts the compute
    alone, as the measurement does."""
    cost = table.sum(axis=-1)  # (p, v, 2, m): compute + engine
    if not each:
        cost = np.broadcast_to(cost.mean(axis=3, keepdims=True), cost.shape)

    def duration(r, ins):
        return cost[r, ins.chunk, int(ins.kind == S.BACKWARD), ins.micro]

    events = S.simulate(schedules, duration=duration, latency=receive)
    work = [e for rank in events for e in rank if e[1] in (S.FORWARD, S.BACKWARD)]
    span = max(e[3] for e in work) - min(e[2] for e in work)
    return 1.0 - table[..., COMPUTE].sum() / (len(schedules) * span)
