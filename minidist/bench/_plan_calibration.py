"""`bench plan`'s calibration: what this machine is to the planner, measured in the same run (chapter 9).

`measure_yardsticks` takes every raw measurement (the GEMM curve's matmuls, three serial steps, the
all-reduce, a pipeline message, the pipeline engine, the cores four ranks get, each strategy's own
bookkeeping); `least_disturbed` merges several such measurements (before the layouts
and after each pass) into the least disturbed of each; `fit_cluster` turns them into the `Cluster` the
planner predicts with. The timed programs themselves are in `_yardsticks.py`.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from minidist.bench._yardsticks import (effective_cores, fit_gemm_curve, fit_serial_costs, layer_shapes,
                                       serial_yardsticks, strategy_overheads, time_all_reduce, time_gemms,
                                       time_pipeline_engine, time_pipeline_message, time_serial_steps,
                                       time_strategy_overheads)
from minidist.comm import cost
from minidist.comm.launch import run
from minidist.core.model import GPTConfig
from minidist.plan.hardware import measure_this_machine
from minidist.plan.predict import Cluster, Workload, predict
from minidist.plan.shared_cores import overheads_only
from minidist.runtime import cores_available
from minidist.training.layout import Layout


def demo_workload(config: GPTConfig, batch: int) -> Workload:
    """The demo's run as the planner sees it: float32, minidist's activations, no overlap (the
    collectives run on the training thread), and the gradients' own memory passes counted."""
    return Workload(config, batch, config.block_size, "fp32", "minidist", overlap=False, gradient_passes=True)


def measure_yardsticks(config: GPTConfig, args) -> dict:
    """Every yardstick's raw measurement (what `fit_cluster` turns into the planner's cluster).

    This CPU as a device (`hardware.measure_this_machine`: its best matmul FLOP/s and its memory
    bandwidth); NumPy matmuls of the shapes the model runs (for the GEMM curve); three serial steps
    (the global batch, one sequence, the batch in 8 micro-batches: the demo's trainers stepped in
    turn, `time_serial_steps`); minidist's all-reduce timed on
    `--ranks` ranks (each size's fastest of `ALL_REDUCE_JOBS` jobs); a pipeline message's delay as
    its receiver notices it; the pipeline engine's own time after each forward and backward in a
    short pipeline run, and that run's time from its drain to its step's end; with more ranks than cores, how many cores they effectively get; and each
    strategy's own bookkeeping on one rank. The yardsticks themselves are in `_yardsticks.py`."""
    model_flags = ["--n-layer", str(config.n_layer), "--n-embd", str(config.n_embd), "--n-head", str(config.n_head),
                   "--block-size", str(config.block_size), "--steps", str(SERIAL_ROUNDS)]
    k = math.gcd(args.batch_size, ACCUMULATED)
    flag_sets = {"batch": [*model_flags, "--batch-size", str(args.batch_size)],
                 "one": [*model_flags, "--batch-size", "1"],
                 "accumulated": [*model_flags, "--batch-size", str(args.batch_size), "--accumulation", str(k)]}
    serial = serial_yardsticks(run(time_serial_steps, 1, flag_sets, SERIAL_ROUNDS, timeout=args.timeout)[0])
    device = measure_this_machine()
    n, cores = args.ranks, cores_available()
    all_reduces = [run(time_all_reduce, n, ALL_REDUCE_SIZES, timeout=args.timeout)[0] for _ in range(ALL_REDUCE_JOBS)]
    noticed, taken_in = run(time_pipeline_message, n, message_sizes(config, args.batch_size), timeout=args.timeout)[0]
    engine, drain = run(time_pipeline_engine, min(n, config.n_layer), config, args.batch_size,
                        math.gcd(args.batch_size, ENGINE_MICROBATCHES), timeout=args.timeout)[0]
    return {"serial": serial, "accumulated": k, "peak": device.flops("fp32"), "streamed": device.memory_bandwidth,
            "gemms": time_gemms(layer_shapes(config, args.batch_size, n)), "cores": cores,
            "all_reduce": [min(times) for times in zip(*all_reduces)],
            "message": [float(np.median(delays)) for delays in noticed],
            "receive": [float(np.median(costs)) for costs in taken_in],
            "effective_cores": effective_cores(config, args.batch_size, n, args.timeout) if cores < n else None,
            "engine": engine, "drain": drain,
            "strategies": run(time_strategy_overheads, 1, config, k, timeout=args.timeout)[0]}


def least_disturbed(*measurements: dict) -> dict:
    """Several measurements of the yardsticks (before the layouts and after each pass) as one: each
    time the smallest, each speed the largest, as each layout's step is its fastest (the three serial
    steps too, each its own fastest); the strategies' own costs, differences of two times, their mean;
    the cores shared ranks get, a ratio of two times taken in turns (a disturbance moves it either
    way), the median."""
    first = measurements[0]
    merged = dict(first)
    merged["serial"] = {name: min(m["serial"][name] for m in measurements) for name in first["serial"]}
    merged["peak"] = max(m["peak"] for m in measurements)
    merged["streamed"] = max(m["streamed"] for m in measurements)
    merged["gemms"] = [(flops, min(m["gemms"][i][1] for m in measurements)) for i, (flops, _) in enumerate(first["gemms"])]
    merged["all_reduce"] = [min(times) for times in zip(*(m["all_reduce"] for m in measurements))]
    for name in ("message", "receive"):  # each size its own least
        merged[name] = [min(times) for times in zip(*(m[name] for m in measurements))]
    for name in ("engine", "drain"):
        merged[name] = min(m[name] for m in measurements)
    if first["effective_cores"] is not None:  # a ratio of two times taken in turns, not a time: the median
        merged["effective_cores"] = float(np.median([m["effective_cores"] for m in measurements]))
        merged["effective_cores_each"] = [m["effective_cores"] for m in measurements]
    merged["strategies"] = {name: sum(m["strategies"][name] for m in measurements) / len(measurements)
                            for name in first["strategies"]}
    merged["serial_each"] = [m["serial"]["batch"] for m in measurements]  # how still the machine kept
    return merged


def fit_cluster(config: GPTConfig, args, measured: dict) -> tuple[Cluster, dict]:
    """The cluster this machine is to the planner, from `measure_yardsticks`' measurements: the GEMM
    curve fitted to the matmuls (`fit_gemm_curve`); the three serial steps fix the three costs a
    matmul timing cannot see (`fit_serial_costs`): the fixed cost of a layer pass that no split
    shrinks (Python's per-operation cost, `Cluster.layer_overhead`), the fixed cost of a step
    (`Cluster.step_overhead`) and the bandwidth minidist's element-wise work reaches; the
    all-reduce's times give alpha and beta (`comm.cost.fit_alpha_beta` on the ring's
    2(n-1)(alpha + S/n beta)); with more ranks than cores, `Cluster.cores` (the cores they share,
    `plan.shared_cores`); a pipeline message's alpha and beta, fitted as the all-reduce's are to its
    delays at the sizes the layouts send (`Cluster.p2p_latency`, `Cluster.p2p_byte_seconds`), and
    the same for what taking in one costs its receiver (`Cluster.receive_overhead`,
    `Cluster.receive_byte_seconds`); the engine's time (`Cluster.engine_overhead`) and
    the strategies' own costs (`Cluster.strategy_overhead`, net of the gradient passes the planner
    counts) as measured; the wait at a pipeline's end (`Cluster.pipeline_sync`): the engine
    yardstick's time from its drain to its step's end less what the model counts there. Returns it
    with the facts bench plan prints and writes."""
    k, peak, serial, n = measured["accumulated"], measured["peak"], measured["serial"], args.ranks
    curve = fit_gemm_curve(measured["gemms"], peak)

    def one_rank(overhead: float, per_step: float, bandwidth: float) -> Cluster:
        return Cluster(1, 1, float("inf"), 1e30, 0.0, 1e30, 0.0, peak, overhead, memory_bandwidth=bandwidth,
                       gemm=curve, step_overhead=per_step)

    def serial_prediction(batch: int, microbatches: int, overhead: float, per_step: float, bandwidth: float) -> float:
        return predict(demo_workload(config, batch), Layout(microbatches=microbatches),
                       one_rank(overhead, per_step, bandwidth))["step_seconds"]

    overhead, per_step, bandwidth = fit_serial_costs(serial_prediction, config.n_layer, args.batch_size, k, serial,
                                                     measured["streamed"])

    def gradient_passes(zero: int) -> float:  # per micro-batch, on one rank, beyond plain accumulation's
        return predict(demo_workload(config, k), Layout(zero=zero, microbatches=k),
                       one_rank(overhead, per_step, bandwidth))["gradients"] / k

    counted = {f"zero{z}": gradient_passes(z) - gradient_passes(0) for z in (2, 3)}
    strategies = strategy_overheads(measured["strategies"], config.n_layer, counted)
    seconds = measured["all_reduce"]
    alpha, beta = cost.fit_alpha_beta([s / n for s in ALL_REDUCE_SIZES], [t / (2 * (n - 1)) for t in seconds])
    link = 1 / max(beta, 1e-15)
    sizes = message_sizes(config, args.batch_size)  # a pipeline message: alpha and beta as the all-reduce's
    p2p_alpha, p2p_beta = cost.fit_alpha_beta(sizes, measured["message"])
    receive_alpha, receive_beta = cost.fit_alpha_beta(sizes, measured["receive"])
    cores = measured["cores"]
    shared = min(cores, measured["effective_cores"]) if measured["effective_cores"] is not None else None
    python_share = work_cores = None
    if shared is not None:  # the yardstick's step, Python-bound part at the physical cores, the rest at C_w
        step, alone = demo_workload(config, max(1, args.batch_size // n)), one_rank(overhead, per_step, bandwidth)
        python_share = (predict(step, Layout(), overheads_only(alone))["step_seconds"]
                        / predict(step, Layout(), alone)["step_seconds"])
        work_cores = cores_for_the_rest(shared, python_share, cores)
    cluster = Cluster(n, n, float("inf"), link, alpha, link, alpha, peak, overhead, memory_bandwidth=bandwidth,
                      step_overhead=per_step, gemm=curve, p2p_latency=p2p_alpha,
                      p2p_byte_seconds=p2p_beta, receive_overhead=receive_alpha, receive_byte_seconds=receive_beta,
                      engine_overhead=measured["engine"], cores=work_cores, strategy_overhead=tuple(strategies.items()),
                      overhead_cores=cores if shared is not None else None)
    # the engine yardstick's pipeline from its drain to the step's end, less what the model counts there
    engine_run = predict(demo_workload(config, args.batch_size),
                         Layout(pp=min(n, config.n_layer), microbatches=math.gcd(args.batch_size, ENGINE_MICROBATCHES)),
                         cluster)
    cluster = replace(cluster, pipeline_sync=max(0.0, measured["drain"] - engine_run["outside_passes"]))
    facts = {"serial_step_seconds": serial["batch"], "serial_one_sequence_seconds": serial["one"],
             "serial_step_each_seconds": measured.get("serial_each", [serial["batch"]]),
             "serial_accumulated_seconds": serial["accumulated"], "serial_accumulated_microbatches": k,
             "serial_step_predicted": serial_prediction(args.batch_size, 1, overhead, per_step, bandwidth),
             "device_flops": peak * curve.peak_fraction, "peak_flops": peak,
             "gemm_peak_fraction": curve.peak_fraction, "gemm_half_flops": curve.half_flops,
             "gemm_points": [{"flops": f, "seconds": s} for f, s in measured["gemms"]],
             "memory_bandwidth": bandwidth, "memory_bandwidth_measured": measured["streamed"],
             "layer_overhead": overhead, "step_overhead": per_step, "cores": cores, "ranks": n,
             "effective_cores": shared, "effective_cores_each": measured.get("effective_cores_each"),
             "yardstick_python_share": python_share, "work_cores": work_cores,
             "overhead_cores": cores if shared is not None else None,
             "alpha": alpha, "beta": beta,
             "pipeline_message_seconds": measured["message"][0],  # at the largest size
             "pipeline_message_alpha": p2p_alpha,
             "pipeline_message_beta": p2p_beta,
             "pipeline_message_each_size": {str(size): t for size, t in zip(sizes, measured["message"])},
             "pipeline_receive_alpha": receive_alpha, "pipeline_receive_beta": receive_beta,
             "pipeline_receive_each_size": {str(size): t for size, t in zip(sizes, measured["receive"])},
             "pipeline_engine_seconds": measured["engine"],
             "pipeline_drain_seconds": measured["drain"], "pipeline_sync_seconds": cluster.pipeline_sync,
             "all_reduce_seconds": {str(size): t for size, t in zip(ALL_REDUCE_SIZES, seconds)},
             "strategy_overhead": strategies, "strategy_overhead_per_microbatch": measured["strategies"]}
    return cluster, facts


def cores_for_the_rest(measured: float, python_share: float, cores: int) -> float:
    """The cores C_w the array work of shared ranks gets, when a step with `python_share` of its work
    Python-bound (which shares the `cores` physical cores) got `measured` cores as a whole: the
    step's time per core's work blends the two, 1/C = f/cores + (1 - f)/C_w (`plan.shared_cores`)."""
    return (1.0 - python_share) / (1.0 / measured - python_share / cores)


def calibrate(config: GPTConfig, args) -> tuple[Cluster, dict]:
    """The cluster this machine is to the planner, from yardsticks measured now (`measure_yardsticks`,
    `fit_cluster`)."""
    return fit_cluster(config, args, measure_yardsticks(config, args))


ALL_REDUCE_SIZES = [1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22]  # bytes
ALL_REDUCE_JOBS = 3  # jobs timing them, each size's fastest kept: with more ranks than cores, a job's back-to-back
                     # all-reduces settle into a slow pace or a fast one (here 4 KB: ~300 or ~130 us), the
                     # training steps' into the fast one
SERIAL_ROUNDS = 12  # rounds of the three serial steps in turn (`time_serial_steps`)
MESSAGE_SPLITS = (1, 2, 4, 8, 16)  # micro-batches per batch whose messages the message yardstick times
ENGINE_MICROBATCHES = 8  # of the pipeline that times the engine and a step's end after the drain
ACCUMULATED = 8  # micro-batches of the third serial yardstick (fewer where the batch does not divide):
                 # many, so that the passes they add stand well above a step's noise


def message_sizes(config: GPTConfig, batch: int) -> list[int]:
    """The sizes (bytes, largest first) of the messages the layouts' pipelines send: one micro-batch's
    float32 activation, for the batch cut into each of `MESSAGE_SPLITS` micro-batches (and a data-parallel
    rank's share of it: the same sizes)."""
    rows = sorted({batch // k for k in MESSAGE_SPLITS if batch // k >= 1}, reverse=True)
    return [r * config.block_size * config.n_embd * 4 for r in rows]


def print_yardsticks(facts: dict, ranks: int, when: str = "") -> None:
    """The calibration in one paragraph: what this machine is to the planner."""
    when = f" ({when})" if when else ""
    steps = facts.get("serial_step_each_seconds", [])
    each = f" (the fastest of {', '.join(f'{t * 1e3:.1f}' for t in steps)})" if len(steps) > 1 else ""
    measured = facts.get("effective_cores_each") or []
    median = f", the median of {', '.join(f'{c:.2f}' for c in measured)}" if len(measured) > 1 else ""
    split = (f": their Python-bound {facts['yardstick_python_share']:.0%} of the step at {facts['overhead_cores']}, "
             f"array work at {facts['work_cores']:.2f}" if facts.get("work_cores") else "")
    largest = max(map(int, facts["pipeline_message_each_size"]))
    shared = (f"{ranks} ranks share {facts['cores']} cores, as {facts['effective_cores']:.2f}{median}{split}"
              if facts["effective_cores"] else "a core per rank")
    print(f"yardsticks{when}: per core ({shared}) GEMMs at "
          f"{facts['gemm_peak_fraction']:.2f} x {facts['peak_flops'] / 1e9:.1f} GFLOP/s, half of that at "
          f"{facts['gemm_half_flops'] / 1e6:.2f} MFLOP (fitted to {len(facts['gemm_points'])} NumPy matmuls of the "
          f"model's shapes), element-wise work at {facts['memory_bandwidth'] / 1e9:.1f} GB/s (streamed: "
          f"{facts['memory_bandwidth_measured'] / 1e9:.1f}), {facts['layer_overhead'] * 1e3:.2f} ms "
          f"per layer pass and {facts['step_overhead'] * 1e3:.1f} ms per step; "
          f"serial step {facts['serial_step_seconds'] * 1e3:.1f} ms measured{each}, "
          f"{facts['serial_step_predicted'] * 1e3:.1f} ms predicted; all-reduce alpha {facts['alpha'] * 1e6:.1f} us, "
          f"beta {facts['beta'] * 1e9:.3f} ns/byte; a pipeline message noticed "
          f"{facts['pipeline_message_alpha'] * 1e6:.1f} us + {facts['pipeline_message_beta'] * 1e9:.3f} ns/byte after "
          f"its send ({facts['pipeline_message_seconds'] * 1e3:.2f} ms at {largest >> 10} KB), taking one in "
          f"{facts['pipeline_receive_alpha'] * 1e6:.1f} us + {facts['pipeline_receive_beta'] * 1e9:.3f} ns/byte, "
          f"the pipeline engine's {facts['pipeline_engine_seconds'] * 1e3:.2f} ms after each forward or backward; "
          f"from a pipeline's drain to its step's end {facts['pipeline_drain_seconds'] * 1e3:.1f} "
          f"ms, {facts['pipeline_sync_seconds'] * 1e3:.1f} ms of it waiting for idle ranks; a strategy's own "
          "bookkeeping (on one rank): "
          + ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in facts["strategy_overhead"].items())
          + " (tp per layer pass, ZeRO per unit and micro-batch, the mesh engine per micro-batch)")
