"""The layout planner's model: memory and step time of one layout (chapter 9).

One idea: every number a layout costs is a formula in the model's sizes, the devices and their
links, and the layout's degrees — so all layouts can be *predicted* and ranked before any is run
(`search.py` searches them). The pieces:

    workload.py      what is predicted: the Cluster (devices, links, speeds) and the Workload
    stage_memory.py  bytes per device: model states of its shard (ZeRO divides piles by d) and the
                     activations of the micro-batches its stage holds at once
    step_time.py     seconds per step: GEMMs at a size-dependent speed, element-wise work at memory
                     bandwidth, tp all-reduces on the critical path, the pipeline schedule
                     simulated with each stage's cost, the data-parallel traffic as it overlaps
    shared_cores.py  more ranks than CPU cores (this machine): the schedule run with the cores
                     shared among the ranks that compute, the waiting ones taking none

Notation: B global batch, b micro-batch (sequences), m micro-batches per step, s sequence, h
width, a heads, L layers, V vocabulary, p = pp stages, t = tp ranks, d = dp replicas, v model
chunks per stage (interleaved 1F1B), N = d·t·p devices.
"""
from __future__ import annotations

from minidist.plan.stage_memory import (extra_bytes, heaviest_stage, in_flight, interleaved_peak,  # noqa: F401
                                        layer_activation_bytes, rank_ledger, rank_parameter_count, rank_units,
                                        stage_activation_bytes, stage_ledger, state_bytes)
from minidist.plan.step_time import (all_reduce_seconds, data_parallel_seconds, flops_per_step,  # noqa: F401
                                     gradient_passes_seconds, group_span, half_seconds, message_split,
                                     optimizer_seconds, pipeline_estimate, pipeline_seconds, pp_messages,
                                     stage_costs, strategy_overhead_seconds, tp_calls)
from minidist.plan.shared_cores import all_at_once, overheads_only, shared_cores_seconds, without_latency
from minidist.plan.workload import (ACTIVATION_BYTES, STATE_BYTES, Cluster, GemmCurve, Workload,  # noqa: F401
                                    bytes_per_param, chunk_layers, config_for, padded_vocab)
from minidist.training.layout import Layout


BESIDE = ("embedding", "dp", "optimizer", "gradients", "machinery")  # a step's seconds outside its passes


def predict(w: Workload, layout: Layout, cluster: Cluster, simulate: bool = True) -> dict:
    """Step time split into compute, tp, pp, bubble, exposed dp, optimizer, the gradients' own
    memory passes, a strategy's own bookkeeping (`machinery`) and, with more ranks than cores, what
    sharing them adds (`sharing`) — seconds, on the busiest rank —; the step's seconds outside its
    passes as the model counts them (`outside_passes`: with the cores shared, slowed as they are);
    the bytes each rank sends per step on each axis, the speed a user can check (TFLOP/s per
    device, MFU) and the heaviest stage's memory.
    `simulate=False`: the pipeline's time from `pipeline_estimate` instead of the simulated
    schedule ("simulated" says which)."""
    d, t, p, m, v = layout.dp, layout.tp, layout.pp, layout.microbatches, layout.virtual_stages
    b = w.global_batch // (d * m)
    costs = stage_costs(w, layout, cluster, b)
    if p == 1:
        pipeline = m * sum(c.forward + c.backward for c in costs[0])
    elif simulate:
        pipeline = pipeline_seconds(costs, layout.schedule or "1f1b", p, m, v)
    else:
        pipeline = pipeline_estimate(costs, p, m, v)
    per_chunk = [[c.parts() for c in rank] for rank in costs]
    parts = [{k: sum(chunk[k] for chunk in rank) for k in ("compute", "tp", "pp", "total")} for rank in per_chunk]
    work = max(parts, key=lambda part: part["total"])  # the busiest rank's own work per micro-batch
    bubble = max(0.0, pipeline - m * work["total"])
    beside = beside_pipeline(w, layout, cluster, costs)
    step = pipeline + sum(beside[k] for k in BESIDE)
    outside = step - pipeline
    shared = None
    if cluster.cores and cluster.cores < cluster.gpus:  # more ranks than cores: each waits at full speed,
        quiet = without_latency(cluster)                # works at the speed the shared cores allow
        busy = stage_costs(w, layout, quiet, b)
        outside_busy = sum(beside_pipeline(w, layout, quiet, busy)[k] for k in BESIDE)
        light, outside_light = None, 0.0
        if cluster.overhead_cores is not None:  # the Python-bound part of that work shares more cores
            python = overheads_only(cluster)
            light = stage_costs(w, layout, python, b)
            outside_light = sum(beside_pipeline(w, layout, python, light)[k] for k in BESIDE)
        shared = shared_cores_seconds(layout, cluster, costs, busy, outside, outside_busy, simulate, light,
                                      outside_light)
        outside = all_at_once(outside, outside_busy, cluster, outside_light)
    # after the drain, the step's collectives (tied embedding, gradient norm) wait for the stages
    # that went idle first and slept (Cluster.pipeline_sync)
    sync = cluster.pipeline_sync if p > 1 else 0.0
    sharing = max(0.0, shared - step) if shared is not None else 0.0  # what the shared cores add
    step += sharing + sync

    stage, ledger = heaviest_stage(w, layout)
    tokens = w.global_batch * w.seq
    flops = flops_per_step(w)
    tp_bytes = b * w.seq * w.config.n_embd * ACTIVATION_BYTES[w.precision]
    pp_bytes = tp_bytes / message_split(w, t)
    return {"step_seconds": step, "compute": m * work["compute"], "tp": m * work["tp"],
            "pp": m * work["pp"] + beside["embedding"] + sync, "bubble": bubble, "dp": beside["dp"],
            "optimizer": beside["optimizer"], "gradients": beside["gradients"], "machinery": beside["machinery"],
            "sharing": sharing,
            # idle share of all ranks, as a run measures it: time outside forward and backward (waits, messages)
            "bubble_fraction": 1 - m * sum(part["total"] - part["pp"] for part in parts) / (p * pipeline)
            if pipeline else 0.0,
            "embedding": beside["embedding"], "outside_passes": outside, "pipeline_sync": sync, "micro_batch": b,
            "tokens_per_second": tokens / step,
            "tflops_per_device": flops / (cluster.gpus * step) / 1e12,
            "mfu": flops_per_step(w, recompute=False) / (cluster.gpus * step * cluster.flops),
            "bytes_sent": {"tp": tp_calls(w, layout) * 2 * (t - 1) / t * tp_bytes, "pp": pp_messages(p, m, v) * pp_bytes,
                           "embedding": beside["embedding_bytes"], "dp": beside["dp_sent"]},
            "memory": ledger, "memory_stage": stage, "fits": ledger["peak"] <= cluster.memory,
            "simulated": simulate or p == 1, "shared_cores_seconds": shared}


def beside_pipeline(w: Workload, layout: Layout, cluster: Cluster, costs: tuple) -> dict:
    """What a step spends outside its forwards and backwards (seconds), on the busiest rank: the
    tied embedding's all-reduce between a pipeline's ends, the exposed data-parallel traffic (and
    the bytes it sends), the update, the gradients' own memory passes, a strategy's bookkeeping."""
    d, t, p = layout.dp, layout.tp, layout.pp
    embedding = 0
    if p > 1 and w.config.tie_weights:  # the tied embedding's two copies add their gradients once a step
        embedding = config_for(w, t).vocab_size * w.config.n_embd // t * bytes_per_param(w)[1]
    params = max(sum(rank_units(config_for(w, t), t, p, s, layout.virtual_stages, w.ends_as_layers))
                 for s in {0, p - 1})
    layers = max(1, w.config.n_layer // (p * layout.virtual_stages))
    first = costs[0][0]  # the first stage finishes its backward last
    dp_time, dp_sent = data_parallel_seconds(w, layout, cluster, params, first.backward,
                                             (first.forward / layers, first.backward / layers),
                                             first_forward=first.forward)
    return {"embedding": all_reduce_seconds(embedding, "embedding", layout, cluster) if embedding else 0.0,
            "embedding_bytes": embedding, "dp": dp_time, "dp_sent": dp_sent,
            "optimizer": optimizer_seconds(params, layout.zero, d, cluster) + cluster.step_overhead,
            "gradients": gradient_passes_seconds(w, layout, cluster, params),
            "machinery": strategy_overhead_seconds(w, layout, cluster)}
