"""More ranks than cores (chapter 9, on this machine): a step's time with the cores shared.

Four ranks on a 2-core laptop are not four devices. The operating system shares the cores among
the ranks that are computing, as evenly as it can (processor sharing): with k ranks computing on
C < k cores, each runs at C/k of its speed, and a rank that waits — for a message, for a peer in a
collective, idle in a pipeline's bubble — sleeps in minidist's polite wait (chapter 2) and takes no
share. So what a rank does splits in two:

* work (matmuls, element-wise passes, copying a message's bytes, the engine's bookkeeping), which
  slows down when more ranks compute than there are cores;
* waiting (each collective's and message's latency, the alpha of the cost model, measured with
  the ranks already sharing the cores), which does not.

`simulate_shared` runs a pipeline schedule so, event by event: the stage costs' work at the speed
the cores allow at that moment, their waiting at full speed. A pipeline of four stages with one
micro-batch, where one stage computes at a time, keeps its core-per-rank time; data parallelism,
every rank computing at once, takes N/C times as long; a pipeline with a few micro-batches, where
two or three stages overlap, lands between, which neither bound alone could say.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq

from minidist.parallel import schedules as S
from minidist.plan.step_time import extended, pipeline_estimate

_DONE = 1e-15  # seconds of work below which an operation is finished (floating-point dust)


def simulate_shared(plans: list, work, wait, ranks_per_stage: int, cores: float) -> list[list[tuple]]:
    """Run each stage's instruction list (`schedules.all_ranks`) with `ranks_per_stage` ranks
    computing it in lockstep (the tp x dp ranks of one stage) on `cores` cores shared by all.
    `work(stage, instruction)` and `wait(stage, instruction)` give a forward's or backward's two
    parts in seconds at a core each; a send is posted when its pass ends (waiting included), and a
    receive goes on once its send is posted. Returns per-stage events (name, kind, start, end) as
    `schedules.simulate` does, each pass's span including the time its work was slowed."""
    p = len(plans)
    pc = [0] * p
    now = 0.0
    posted: set = set()
    computing: dict[int, float] = {}  # stage -> seconds of work left (at a core's speed)
    waking: list = []                 # heap of (when its wait ends, stage)
    running: dict[int, tuple] = {}    # stage -> (name, kind, start, wait) of its pass
    events: list[list[tuple]] = [[] for _ in range(p)]

    def advance(r: int) -> bool:
        """Go through stage r's instructions until it starts a pass, blocks on a receive, or ends;
        True if it moved."""
        moved = False
        while pc[r] < len(plans[r]):
            ins = plans[r][pc[r]]
            if ins.kind in (S.FORWARD, S.BACKWARD):
                name = f"{ins.kind} {ins.micro}" + (f".{ins.chunk}" if ins.chunk else "")
                running[r] = (name, ins.kind, now, wait(r, ins))
                computing[r] = work(r, ins)
                pc[r] += 1
                return True
            if ins.kind in (S.SEND_ACT, S.SEND_GRAD):
                posted.add((r, ins))
            elif ins.kind != S.STEP:  # a receive: on once its send is posted
                key = S.peer_of(ins, r, p)
                if key not in posted:
                    return moved
                posted.discard(key)
            pc[r] += 1
            moved = True
        return moved

    def settle() -> None:
        """Passes whose work is done start waiting; waits that are over end their pass; stages
        that are free go on (a pass that ended posts sends that may free another's receive)."""
        moved = True
        while moved:
            for r in [r for r, left in computing.items() if left <= _DONE]:
                del computing[r]
                heapq.heappush(waking, (now + running[r][3], r))
            while waking and waking[0][0] <= now + _DONE:
                r = heapq.heappop(waking)[1]
                name, kind, start, _ = running.pop(r)
                events[r].append((name, kind, start, now))
            moved = False
            for r in range(p):
                if r not in running and advance(r):
                    moved = True

    settle()
    while running:
        speed = min(1.0, cores / (len(computing) * ranks_per_stage)) if computing else 1.0
        ends = [left / speed for left in computing.values()] + ([waking[0][0] - now] if waking else [])
        step = min(ends)
        now += step
        for r in computing:
            computing[r] -= step * speed
        settle()
    stuck = [r for r in range(p) if pc[r] < len(plans[r])]
    if stuck:
        raise S.Deadlock("pipeline deadlock: " + "; ".join(f"stage {r} waits at {plans[r][pc[r]]!r}" for r in stuck))
    return events


def without_latency(cluster):
    """The cluster with every link's latency (alpha, and a pipeline message's wake-up) at zero: its
    stage costs are a rank's work alone; the full costs less these are its waiting."""
    return dataclasses.replace(cluster, intra_latency=0.0, inter_latency=0.0, p2p_latency=0.0)


def shared_cores_seconds(layout, cluster, costs: tuple, busy: tuple, beside: float, beside_busy: float,
                         simulate: bool = True) -> float:
    """A step's seconds with `cluster.gpus` ranks on `cluster.cores` cores. `costs` and `busy`: each
    pipeline stage's chunk costs (`step_time.stage_costs`) in full and without latency; `beside`
    and `beside_busy`: the same of the step's time outside its passes (data-parallel traffic,
    update, bookkeeping), when every rank works at once. A layout without a pipeline has every
    rank computing at once too: its work takes N/C times as long, its waiting no longer.
    `simulate=False` (the planner's first pass over thousands of layouts): a pipeline's passes
    bounded from below instead, by the larger of its critical path and all its work over the cores."""
    m, p, v = layout.microbatches, layout.pp, layout.virtual_stages

    def per_stage(chunks):
        return m * sum(x.forward + x.backward for x in chunks)

    if p == 1:
        passes = all_at_once(per_stage(costs[0]), per_stage(busy[0]), cluster)
    elif simulate:
        passes = _shared_pipeline(costs, busy, layout.schedule or "1f1b", p, m, v, cluster.gpus // p, cluster.cores)
    else:
        work_over_cores = sum(per_stage(work) for work in busy) * (cluster.gpus // p) / cluster.cores
        passes = max(pipeline_estimate(costs, p, m, v), work_over_cores)
    return passes + all_at_once(beside, beside_busy, cluster)


def all_at_once(seconds: float, work: float, cluster) -> float:
    """`seconds` that every rank spends at the same moment, `work` of them computing: the work takes
    N/C times as long on C cores shared by N ranks, the waiting no longer."""
    return work * max(1.0, cluster.gpus / cluster.cores) + (seconds - work)


@functools.lru_cache(maxsize=4096)
def _shared_pipeline(costs: tuple, busy: tuple, schedule: str, p: int, m: int, v: int, ranks_per_stage: int,
                     cores: float) -> float:
    def seconds(chunk, ins):
        return chunk.forward if ins.kind == S.FORWARD else chunk.backward

    def work(r, ins):
        return seconds(busy[r][ins.chunk], ins)

    def wait(r, ins):
        return seconds(costs[r][ins.chunk], ins) - work(r, ins)

    def makespan(micro: int) -> float:
        events = simulate_shared(S.all_ranks(schedule, p, micro, v), work, wait, ranks_per_stage, cores)
        return max(e[3] for stage in events for e in stage)

    return extended(makespan, schedule, p, m)
