"""The yardsticks `bench plan` measures before it predicts: what this machine is to the planner (chapter 9).

Each is a small timing that the planner's formulas need as a number and that no data sheet gives
for a CPU running NumPy: the GEMM curve of the model's own matmul shapes (`time_gemms`,
`fit_gemm_curve`), the three serial steps, stepped in turn, that fix a layer pass's, a step's and
the element-wise work's costs (`time_serial_steps`, `fit_serial_costs`), minidist's all-reduce on
the job's ranks (`time_all_reduce`), how late a pipeline's receiver notices a message of each
size a pipeline sends and what taking in one already there costs it (`time_pipeline_message`),
the pipeline engine's own time and how long a pipeline step takes from its drain to its end
(`time_pipeline_engine`), how many cores ranks that share them get
(`effective_cores`), and what each strategy's own bookkeeping adds to a micro-batch
(`time_strategy_overheads`). The functions named `time_*` whose docstring says "rank program" run
under `comm.launch.run`. A helper of `plan.py`, not a benchmark of its own: hence the underscore
(`python -m minidist.bench` lists the benchmarks).
"""
from __future__ import annotations

import time

import numpy as np

from minidist.comm.launch import run
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.plan.hardware import fit_gemm_line, time_matmul
from minidist.plan.predict import GemmCurve
from minidist.plan.step_time import layer_gemms


def time_all_reduce(sizes, reps: int = 20) -> list[float]:
    """Rank program: seconds per minidist all_reduce of each size (float32, the slowest rank's)."""
    from mpi4py import MPI

    from minidist.comm import all_reduce, get_world
    comm = get_world().comm
    seconds = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        all_reduce(x)  # warm-up
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(reps):
            all_reduce(x)
        mine = np.array([(time.perf_counter() - start) / reps])
        comm.Allreduce(MPI.IN_PLACE, mine, op=MPI.MAX)
        seconds.append(float(mine[0]))
    return seconds


def time_pipeline_message(sizes, reps: int = 20, busy: float = 0.005) -> tuple[list, list]:
    """Rank program (2 ranks at least): for each message size in bytes, `reps` times of (1) a message
    noticed (`_noticed`) and (2) a message taken in (`_taken_in`). Returns the two lists, one list of
    times per size. One machine: one clock."""
    from minidist.comm import get_world
    world = get_world()
    noticed = [_noticed(world, np.ones(nbytes // 4, np.float32), reps, busy) for nbytes in sizes]
    taken_in = [_taken_in(world, np.ones(nbytes // 4, np.float32), reps, busy / 5) for nbytes in sizes]
    return noticed, taken_in


def _noticed(world, x, reps: int, busy: float) -> list[float]:
    """Seconds from rank 1's send of `x` to rank 0 noticing it, as a pipeline's receiver notices an
    activation it waits for: rank 0 has been waiting a while (`busy` s of rank 1's compute), so
    minidist's polite wait is yielding the core."""
    from minidist.comm.p2p import irecv, isend
    from minidist.comm.waiting import wait
    comm, delays = world.comm, []
    for i in range(reps):
        comm.Barrier()
        if world.rank == 1:
            end = time.perf_counter() + busy
            while time.perf_counter() < end:  # compute, as the previous stage does
                pass
            sent = np.array([time.perf_counter()])
            wait(isend(x, 0, i, world))
            comm.Send(sent, dest=0, tag=10_000 + i)
        elif world.rank == 0:
            wait(irecv(x, 1, i, world))
            seen = time.perf_counter()
            sent = np.empty(1)
            comm.Recv(sent, source=1, tag=10_000 + i)
            delays.append(seen - sent[0])
    return delays


def _taken_in(world, x, reps: int, busy: float) -> list[float]:
    """Seconds rank 0 spends receiving a message like `x` that rank 1 posted `busy` s before (its
    buffer, the receive posted, found and copied out), as a pipeline's receiver that was busy with a
    pass when it came."""
    from minidist.comm.p2p import irecv, isend
    from minidist.comm.waiting import wait
    comm, costs = world.comm, []
    for i in range(reps):
        if world.rank == 1:
            posted = isend(x, 0, i, world)
            comm.Barrier()
            wait(posted)
        elif world.rank == 0:
            comm.Barrier()
            end = time.perf_counter() + busy
            while time.perf_counter() < end:  # busy with a pass while the message comes in
                pass
            start = time.perf_counter()
            buffer = np.empty_like(x)
            wait(irecv(buffer, 1, i, world))
            costs.append(time.perf_counter() - start)
        else:
            comm.Barrier()
    return costs


def time_pipeline_engine(config: GPTConfig, batch: int, microbatches: int, steps: int = 4) -> tuple[float, float]:
    """Rank program, in a pipeline of one stage per rank: (engine, drain-to-end) seconds.

    engine: the median time minidist's pipeline engine spends after a forward or backward (posting
    sends, polling, bookkeeping: the gap to the rank's next event, `PipelineTrainer`'s
    explain_bubble). drain-to-end: the median time from the first stage's last backward (the last
    of the step in 1F1B) to the end of the step, measured as the demo runs (without explain_bubble,
    whose own all-reduce would lengthen it): the tied embedding's exchange, the gradient norm's
    all-reduce, the update and the step's report, with ranks that went idle during the drain."""
    from minidist import timeline
    from minidist.comm import get_world
    from minidist.core.tensor import default_dtype
    from minidist.parallel.pipeline import PipelineTrainer
    from minidist.training.train import OptimSettings
    with default_dtype("float32"):
        trainer = PipelineTrainer(config, OptimSettings(lr=1e-3, steps=2 * steps), make_task("sort", config.block_size),
                                  batch, group=get_world(), microbatches=microbatches, schedule="1f1b",
                                  explain_bubble=True)
        seconds, tails = [], []
        for step in range(steps):
            trainer.step(step)
            seconds.append(trainer.engine_seconds)
        trainer.explain_bubble = False
        for step in range(steps, 2 * steps):
            mark = len(trainer.timeline.events)
            trainer.step(step)
            end = timeline.now()
            tails.append(end - max(e[3] for e in trainer.timeline.events[mark:] if e[1] == "backward"))
    return float(np.median(seconds[1:])), float(np.median(tails))


def time_shared_steps(config: GPTConfig, batch: int, rounds: int = 20) -> list[tuple[float, float]]:
    """Rank program: in each of `rounds` rounds, a serial training step of `batch` sequences on rank 0
    alone (the other ranks asleep at a barrier), then one on every rank at once, timed until the last
    rank has finished (the others asleep at a barrier again). Returns (alone, together) seconds per
    round, rank 0's clock.

    Together, the ranks share the cores, and a step that waits for every rank (a data-parallel
    step, a ZeRO gather) lasts as long as the rank the sharing served worst. Alone and together
    take turns in one job so that a machine that changes speed moves both alike."""
    from minidist import comm as dist
    from minidist.bench.step import minidist_step
    step = minidist_step(config, batch, "float32")[0]
    world = dist.get_world()
    step()  # warm-up
    times = []
    with dist.waiting_as(spin=0.001):  # a waiting rank sleeps soon: it lends its core (chapter 2)
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            if world.rank == 0:
                step()
            alone = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times.append((alone, time.perf_counter() - start))
    return times


def time_serial_steps(flag_sets: dict, rounds: int = 10) -> dict:
    """Rank program (one rank): the demo's serial step under each set of demo flags (`flag_sets`:
    name -> flags), each trainer built as the demo builds it (`strategies.make_trainer`) and all of
    them stepped in turn, `rounds` times: seconds per step, a list per name. In turn, so that each
    gets as many chances as the others to find the machine quiet (`serial_yardsticks` keeps the
    fastest of each)."""
    from minidist.comm import get_world
    from minidist.core.kernels import kernels
    from minidist.core.tensor import set_default_dtype
    from minidist.demo_flags import build_parser, check_args
    from minidist.runtime import tune_malloc
    from minidist.training.strategies import make_trainer
    tune_malloc()  # as the demo does: the heap is kept, not returned and faulted in again
    trainers = {}
    for name, flags in flag_sets.items():
        args = build_parser().parse_args(flags)
        config, task, layout = check_args(args, 1)
        set_default_dtype(args.dtype)
        kernels(args.kernels)
        trainers[name] = make_trainer(layout, args, config, task, get_world())
    return steps_in_turn(trainers, rounds)


def steps_in_turn(trainers: dict, rounds: int) -> dict:
    """Step every trainer once per round, in turn, `rounds` times: seconds per step, a list per name.
    A machine that changes speed during the rounds moves every trainer's steps alike."""
    seconds = {name: [] for name in trainers}
    for step in range(rounds):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(step)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def serial_yardsticks(seconds: dict) -> dict:
    """`time_serial_steps`' rounds as one time per name: its fastest step after the first (the least
    disturbed, as every other yardstick is kept). Not a baseline's fastest plus the median of each
    round's differences from it: a machine's slow phase slows every step by a share, not by the same
    milliseconds, so a 10 ms step's difference from a 90 ms one shrinks by the share of 90 ms, and
    the three fits (`fit_serial_costs`) disagree."""
    return {name: float(min(times[1:] or times)) for name, times in seconds.items()}


def effective_cores(config: GPTConfig, batch: int, ranks: int, timeout: float) -> float:
    """How many cores `ranks` ranks get when they share fewer: ranks x (a step alone) / (the same
    step on every rank at once, until the last one ends), the median over rounds of
    `time_shared_steps`. Two ranks on one core would give 1 if switching between them were free and
    even; the caches they share, the switches and an uneven share make it less."""
    return cores_from_rounds(run(time_shared_steps, ranks, config, max(1, batch // ranks), timeout=timeout)[0], ranks)


def cores_from_rounds(rounds: list[tuple[float, float]], ranks: int) -> float:
    """The cores `ranks` ranks got, from `time_shared_steps`' (alone, together) rounds: each round's
    ranks x alone / together, the median over the rounds."""
    return float(np.median([ranks * alone / together for alone, together in rounds]))


def time_strategy_overheads(config: GPTConfig, microbatches: int = 4, rounds: int = 20) -> dict:
    """Rank program (one rank): seconds per micro-batch of one sequence that each strategy's trainer
    takes beyond plain training where every message is free (on one rank a collective is a copy), for
    `Cluster.strategy_overhead` (chapter 9; `strategy_overheads` turns them into its units):

        "tp"     TensorParallelTrainer against SerialTrainer (the f and g functions, the
                 vocabulary-parallel loss)
        "zero2"  Zero2Trainer against DataParallelTrainer, `microbatches` micro-batches (buckets)
        "zero3"  Zero3Trainer likewise (buckets, and each unit's gathers, views and releases)
        "mesh"   MeshTrainer likewise (a one-stage pipeline of micro-batches)

    The trainers step in turn, `rounds` times, and each difference is the median of the rounds' own
    differences: a trainer is set against its baseline's step just before, so that a machine that
    changes speed during the yardstick moves both alike."""
    from minidist.comm import get_world
    from minidist.core.tensor import default_dtype
    from minidist.parallel.composed import MeshTrainer
    from minidist.parallel.data_parallel import DataParallelTrainer
    from minidist.parallel.tensor_parallel import TensorParallelTrainer
    from minidist.parallel.zero import ZeroTrainer
    from minidist.training.train import OptimSettings, SerialTrainer

    world, k = get_world(), microbatches
    task, settings = make_task("sort", config.block_size), OptimSettings(lr=1e-3, steps=rounds + 2)
    with default_dtype("float32"):
        trainers = {"serial": SerialTrainer(config, settings, task, 1),
                    "tp": TensorParallelTrainer(config, settings, task, 1, group=world),
                    "plain": DataParallelTrainer(config, settings, task, k, group=world, accumulation=k),
                    "zero2": ZeroTrainer(config, settings, task, k, group=world, stage=2, accumulation=k),
                    "zero3": ZeroTrainer(config, settings, task, k, group=world, stage=3, accumulation=k),
                    "mesh": MeshTrainer(config, settings, task, k, group=world, microbatches=k)}
    seconds = steps_in_turn(trainers, rounds + 2)

    def beyond(name: str, baseline: str) -> float:  # the first two steps allocate and warm the caches
        return float(np.median(np.subtract(seconds[name], seconds[baseline])[2:]))

    return {"tp": beyond("tp", "serial"), "zero2": beyond("zero2", "plain") / k,
            "zero3": beyond("zero3", "plain") / k, "mesh": beyond("mesh", "plain") / k}


def strategy_overheads(measured: dict, n_layer: int, counted: dict) -> dict:
    """`Cluster.strategy_overhead` from `time_strategy_overheads`' seconds per micro-batch: tp per
    layer pass, ZeRO per unit (n_layer + 1: the layers, and the embeddings with the head) net of the
    gradients' memory passes the planner already counts (`counted`, per micro-batch), the mesh per
    micro-batch; never below zero (a difference within the noise)."""
    units = n_layer + 1
    return {"tp": max(0.0, measured["tp"]) / n_layer,
            "zero2": max(0.0, measured["zero2"] - counted["zero2"]) / units,
            "zero3": max(0.0, measured["zero3"] - counted["zero3"]) / units,
            "mesh": max(0.0, measured["mesh"])}


def time_gemms(shapes, dtype=np.float32, seconds: float = 0.02) -> list[tuple[float, float]]:
    """(FLOPs, seconds) of a NumPy matmul of each (M, N, K), one BLAS thread (a rank's share), the
    fastest of repeats lasting about `seconds` (`hardware.time_matmul`)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        return [time_matmul(m, n, k, dtype, seconds) for m, n, k in shapes]


def fit_gemm_curve(points, peak: float) -> GemmCurve:
    """The GEMM curve t = (W + W½)/(e·peak) through measured (W, t) (`hardware.fit_gemm_line`)."""
    return GemmCurve(*fit_gemm_line(points, peak))


def layer_shapes(config: GPTConfig, batch: int, ranks: int) -> list[tuple[int, int, int]]:
    """The GEMMs the demo's layouts run: one layer's, for micro-batches of 1..batch rows and tp 1..ranks."""
    shapes = set()
    for b in sorted({1, 2, 4, batch}):
        for t in (d for d in range(1, ranks + 1) if config.n_head % d == 0):
            for count, m, n, k in layer_gemms(b, config.block_size, config.n_embd, config.n_head, t):
                shapes.add((m * (count if count > 1 else 1), n, k))  # a batched GEMM as one of the same FLOPs
    return sorted(shapes)


def fit_serial_costs(predict_serial, n_layer: int, batch: int, k: int, measured: dict,
                     bandwidth: float) -> tuple[float, float, float]:
    """(layer overhead, step overhead, element-wise bandwidth) that make the serial predictions
    equal to three measured steps: `measured["batch"]` (the batch at once), `measured["one"]` (one
    sequence) and `measured["accumulated"]` (the batch in k micro-batches).

    The batch and one sequence pay the same fixed costs, so their difference is work alone: it
    fixes the bandwidth of element-wise work (bisected between 1/20 and 20 times the streamed
    `bandwidth`: small arrays stay in cache). The k micro-batches pay k - 1 more layer passes per
    layer, which fixes the overhead of a pass; what the batch's step has beyond its work and its
    passes is the step's own overhead (the optimizer's Python, per parameter tensor)."""
    def work(b: int, m: int, bw: float) -> float:
        return predict_serial(b, m, 0.0, 0.0, bw)

    low, high = bandwidth / 20, bandwidth * 20
    for _ in range(40):
        middle = (low * high) ** 0.5
        if work(batch, 1, middle) - work(1, 1, middle) > measured["batch"] - measured["one"]:
            low = middle   # too slow: more bandwidth
        else:
            high = middle
    bw = (low * high) ** 0.5
    if k > 1:
        extra_passes = (k - 1) * n_layer
        more_work = work(batch, k, bw) - work(batch, 1, bw)
        overhead = (measured["accumulated"] - measured["batch"] - more_work) / extra_passes
    else:
        overhead = (measured["one"] - work(1, 1, bw)) / n_layer
    overhead = max(0.0, overhead)
    per_step = max(0.0, measured["batch"] - predict_serial(batch, 1, overhead, 0.0, bw))
    return overhead, per_step, bw
