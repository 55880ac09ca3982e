"""Zero-bubble pipelines: backward split in two, its second half moved into the bubble (chapter 11).

A layer's backward computes two things: B, the gradient of its *input*, which the previous
stage is waiting for, and W, the gradient of its *weights*, which nobody waits for until the
optimizer step. 1F1B (chapter 5) runs them together, so every backward on the critical path
costs B + W. Qi et al. (2023, *Zero Bubble Pipeline Parallelism*) run W later, where the stage
would otherwise sit idle. Their ZB-H1 schedule is 1F1B with that one change: rank r lets up to r
of its W passes wait, and runs the rest right after the B that made one too many. With times
T_F, T_B, T_W per micro-batch and stage (and T_W <= T_B), the idle time of each rank falls from
1F1B's (p - 1)(T_F + T_B + T_W) to (p - 1)(T_F + T_B - T_W): a third of it when all three are
equal, for no more activation memory than 1F1B's first stage holds (p micro-batches).

The schedule is data, as in `minidist/parallel/schedules.py`, and runs on that file's simulator.
The simulator times a compute instruction by its kind and its chunk (`backward(rank, chunk)`);
a W pass is handed to it as a backward that sends nothing, tagged with chunk `WEIGHT`. This is
a simulation with ideal timings: minidist's pipeline engine runs B and W together.
"""
from __future__ import annotations

from minidist.parallel.schedules import BACKWARD, FORWARD, SEND_GRAD, STEP, Instruction, make_schedule, simulate

WEIGHT = -1  # the chunk tag of a weight-gradient pass (no real chunk is negative)


def weight_pass(micro: int) -> Instruction:
    return Instruction(BACKWARD, micro, WEIGHT)


def is_weight(ins: Instruction) -> bool:
    return ins.kind == BACKWARD and ins.chunk == WEIGHT


def zb_h1(rank: int, stages: int, microbatches: int) -> list[Instruction]:
    """Rank `rank`'s ZB-H1 list: 1F1B's, each backward now B only, and W passes put in.

    Rank r keeps at most r W passes waiting: after each B (and the send of its gradient, which
    the previous stage needs first) it runs the oldest waiting W passes until r are left, and
    the last ones before the optimizer step. The last rank, whose B gradients start the chain,
    therefore defers the most; the first rank, which nobody waits for, defers none."""
    out, waiting = [], []
    for ins in make_schedule("1f1b", rank, stages, microbatches):
        if ins.kind == STEP:
            out += [weight_pass(i) for i in waiting]
            waiting = []
        out.append(ins)
        if ins.kind == BACKWARD:
            waiting.append(ins.micro)
        # the B pass is done once its gradient is posted to rank - 1 (rank 0 sends nothing)
        if (ins.kind == SEND_GRAD) or (ins.kind == BACKWARD and rank == 0):
            while len(waiting) > rank:
                out.append(weight_pass(waiting.pop(0)))
    return out


def zb_h1_ranks(stages: int, microbatches: int) -> list[list[Instruction]]:
    return [zb_h1(r, stages, microbatches) for r in range(stages)]


def simulate_split(schedules: list[list[Instruction]], forward: float = 1.0, input_grad: float = 1.0,
                   weight_grad: float = 1.0) -> list[list[tuple]]:
    """`schedules.simulate` with B and W timed apart (T_F, T_B, T_W); events named "F i", "B i", "W i".
    A list without W passes (1F1B) runs each backward as B + W together."""
    split = any(is_weight(ins) for s in schedules for ins in s)
    backward = (lambda rank, chunk: weight_grad if chunk == WEIGHT else input_grad) if split \
        else input_grad + weight_grad
    events = simulate(schedules, forward=forward, backward=backward)
    letter = {FORWARD: "F", BACKWARD: "B"}
    renamed = []
    for per_rank in events:
        row = []
        for name, kind, start, end in per_rank:
            if kind in letter:
                micro = name.split()[1]
                label = "W" if micro.endswith(f".{WEIGHT}") else letter[kind]
                name = f"{label} {micro.split('.')[0]}"
            row.append((name, kind, start, end))
        renamed.append(row)
    return renamed


def span(events: list[list[tuple]]) -> float:
    """From the first compute to the last, over all ranks: the step's length."""
    work = [e for per_rank in events for e in per_rank if e[1] in (FORWARD, BACKWARD)]
    return max(e[3] for e in work) - min(e[2] for e in work)


def idle_per_rank(events: list[list[tuple]]) -> list[float]:
    """Each rank's idle time within the span: span minus its own compute."""
    length = span(events)
    return [length - sum(e[3] - e[2] for e in per_rank if e[1] in (FORWARD, BACKWARD)) for per_rank in events]


def idle_theory(stages: int, forward: float, input_grad: float, weight_grad: float, split: bool) -> float:
    """Idle time of every rank: 1F1B (p - 1)(T_F + T_B + T_W); ZB-H1 (p - 1)(T_F + T_B - T_W), for T_W <= T_B."""
    if split and weight_grad > input_grad:
        raise ValueError(f"the ZB-H1 formula assumes T_W <= T_B; got T_W={weight_grad}, T_B={input_grad}")
    sign = -1 if split else 1
    return (stages - 1) * (forward + input_grad + sign * weight_grad)


def in_flight(schedule: list[Instruction]) -> int:
    """Most micro-batches whose forward has run and whose W pass has not (W still needs their
    layers' inputs); in a list without W passes (1F1B), whose backward has not."""
    split = any(is_weight(ins) for ins in schedule)
    held = peak = 0
    for ins in schedule:
        held += (ins.kind == FORWARD) - (is_weight(ins) if split else ins.kind == BACKWARD)
        peak = max(peak, held)
    return peak


def describe(schedules: list[list[Instruction]]) -> str:
    """One line per rank, compute only: 'rank 0: F0 F1 B0 W0 F2 ...'."""
    def letter(ins):
        return ("W" if is_weight(ins) else "B" if ins.kind == BACKWARD else "F") + str(ins.micro)
    return "\n".join(f"rank {r}: " + " ".join(letter(i) for i in s if i.kind in (FORWARD, BACKWARD))
                     for r, s in enumerate(schedules))
