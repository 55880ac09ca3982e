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

The work itself shares the cores at two rates (`Cluster.overhead_cores`): its Python-bound part
(the fixed costs per layer pass, step, engine and strategy: the interpreter running small
operations) loses only the switching, so it shares the physical cores; the rest (matmuls and
streaming passes over arrays) also fights the other ranks for the caches and the memory's
bandwidth, so it gets fewer (`Cluster.cores`). A pass mixing both runs at the blend of the two
speeds (`pace`); layouts heavy in fixed costs (many small passes: tp 4, many micro-batches) lose
less to the sharing than layouts heavy in arrays.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq

from minidist.parallel import schedules as S
from minidist.plan.step_time import extended, pipeline_estimate

_DONE = 1e-15  # seconds of work below which an operation is finished (floating-point dust)


def pace(light_share: float, computing: int, cores: float, light_cores: float | None = None) -> float:
    """Seconds of a core's work one rank gets done per second while `computing` ranks compute on
    `cores` cores, a `light_share` of its work Python-bound and sharing `light_cores` instead: the
    two parts at their own speeds, one after the other (1 with a core each)."""
    heavy = min(1.0, cores / computing)
    if light_cores is None or light_share <= 0.0:
        return heavy
    light = min(1.0, light_cores / computing)
    return 1.0 / (light_share / light + (1.0 - light_share) / heavy)


def simulate_shared(plans: list, work, wait, ranks_per_stage: int, cores: float, light=None,
                    light_cores: float | None = None) -> list[list[tuple]]:
    """Run each stage's instruction list (`schedules.all_ranks`) with `ranks_per_stage` ranks
    computing it in lockstep (the tp x dp ranks of one stage) on `cores` cores shared by all.
    `work(stage, instruction)` and `wait(stage, instruction)` give a forward's or backward's two
    parts in seconds at a core each, `light(stage, instruction)` how much of that work is
    Python-bound and shares `light_cores` instead (`pace`; None: none); a send is posted when its
    pass ends (waiting included), and a receive goes on once its send is posted. Returns per-stage
    events (name, kind, start, end) as `schedules.simulate` does, each pass's span including the
    time its work was slowed."""
    p = len(plans)
    pc = [0] * p
    now = 0.0
    posted: set = set()
    computing: dict[int, float] = {}  # stage -> seconds of work left (at a core's speed)
    share: dict[int, float] = {}      # stage -> the Python-bound share of its pass's work
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
                share[r] = light(r, ins) / computing[r] if light is not None and computing[r] > 0 else 0.0
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
        ranks = len(computing) * ranks_per_stage
        speed = {r: pace(share[r], ranks, cores, light_cores) for r in computing}
        ends = [left / speed[r] for r, left in computing.items()] + ([waking[0][0] - now] if waking else [])
        step = min(ends)
        now += step
        for r in computing:
            computing[r] -= step * speed[r]
        settle()
    stuck = [r for r in range(p) if pc[r] < len(plans[r])]
    if stuck:
        raise S.Deadlock("pipeline deadlock: " + "; ".join(f"stage {r} waits at {plans[r][pc[r]]!r}" for r in stuck))
    return events


def without_latency(cluster):
    """The cluster with every link's latency (alpha, and a pipeline message's wake-up) at zero: its
    stage costs are a rank's work alone; the full costs less these are its waiting."""
    return dataclasses.replace(cluster, intra_latency=0.0, inter_latency=0.0, p2p_latency=0.0)


def overheads_only(cluster):
    """The cluster with every array operation and message free: its stage costs are the Python-bound
    part of a rank's work alone (the fixed costs per layer pass, step, engine and strategy)."""
    free = 1e30
    return dataclasses.replace(without_latency(cluster), flops=free, memory_bandwidth=free, intra_bandwidth=free,
                               inter_bandwidth=free, receive_byte_seconds=0.0,
                               p2p_byte_seconds=None if cluster.p2p_byte_seconds is None else 0.0)


def shared_cores_seconds(layout, cluster, costs: tuple, busy: tuple, beside: float, beside_busy: float,
                         simulate: bool = True, light: tuple | None = None, beside_light: float = 0.0) -> float:
    """A step's seconds with `cluster.gpus` ranks on `cluster.cores` cores. `costs` and `busy`: each
    pipeline stage's chunk costs (`step_time.stage_costs`) in full and without latency; `beside`
    and `beside_busy`: the same of the step's time outside its passes (data-parallel traffic,
    update, bookkeeping), when every rank works at once. A layout without a pipeline has every
    rank computing at once too: its work takes N/C times as long, its waiting no longer. `light`
    and `beside_light`: the Python-bound part of the work (`overheads_only`), which shares
    `cluster.overhead_cores` where that is set.
    `simulate=False` (the planner's first pass over thousands of layouts): a pipeline's passes
    bounded from below instead, by the larger of its critical path and all its work over the cores."""
    m, p, v = layout.microbatches, layout.pp, layout.virtual_stages

    def per_stage(chunks):
        return m * sum(x.forward + x.backward for x in chunks)

    if p == 1:
        passes = all_at_once(per_stage(costs[0]), per_stage(busy[0]), cluster, per_stage(light[0]) if light else 0.0)
    elif simulate:
        passes = _shared_pipeline(costs, busy, light, layout.schedule or "1f1b", p, m, v, cluster.gpus // p,
                                  cluster.cores, cluster.overhead_cores)
    else:
        work = sum(per_stage(chunks) for chunks in busy)
        python = sum(per_stage(chunks) for chunks in light) if light else 0.0
        work_over_cores = spread(work, python, cluster.gpus, cluster) / p  # each stage's ranks at once
        passes = max(pipeline_estimate(costs, p, m, v), work_over_cores)
    return passes + all_at_once(beside, beside_busy, cluster, beside_light)


def spread(work: float, light: float, ranks: int, cluster) -> float:
    """Seconds that `work` seconds of a core's work take when `ranks` ranks compute at once, `light`
    of it Python-bound (at `cluster.overhead_cores`), the rest at `cluster.cores` (`pace`)."""
    return work / pace(light / work, ranks, cluster.cores, cluster.overhead_cores) if work else 0.0


def all_at_once(seconds: float, work: float, cluster, light: float = 0.0) -> float:
    """`seconds` that every rank spends at the same moment, `work` of them computing (`light` of it
    Python-bound): the work takes N/C times as long on C cores shared by N ranks, the waiting no
    longer."""
    return spread(work, light, cluster.gpus, cluster) + (seconds - work)


@functools.lru_cache(maxsize=4096)
def _shared_pipeline(costs: tuple, busy: tuple, light: tuple | None, schedule: str, p: int, m: int, v: int,
                     ranks_per_stage: int, cores: float, light_cores: float | None) -> float:
    def seconds(chunk, ins):
        return chunk.forward if ins.kind == S.FORWARD else chunk.backward

    def work(r, ins):
        return seconds(busy[r][ins.chunk], ins)

    def python(r, ins):
        return seconds(light[r][ins.chunk], ins)

    def wait(r, ins):
        return seconds(costs[r][ins.chunk], ins) - work(r, ins)

    def makespan(micro: int) -> float:
        events = simulate_shared(S.all_ranks(schedule, p, micro, v), work, wait, ranks_per_stage, cores,
                                 python if light else None, light_cores)
        return max(e[3] for stage in events for e in stage)

    return extended(makespan, schedule, p, m)
