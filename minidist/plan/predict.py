"""The layout planner's model: memory and step time of one DP x TP x PP layout (chapter 9).

One idea: every number a layout costs is a short formula in the model's sizes, the cluster's
links and the layout's degrees — so all layouts can be *predicted* and ranked before any is run
(`minidist/plan/search.py` searches them). Each formula sits in the function that uses it, with its
source; `python -m minidist.bench plan` runs minidist's own layouts beside the prediction.

Notation: B global batch, b micro-batch (sequences), m micro-batches per step, s sequence, h
width, a heads, L layers, V vocabulary, p = pp stages, t = tp ranks, d = dp replicas, v model
chunks per stage (interleaved 1F1B), N = d·t·p devices.

    memory   per device, of the heaviest pipeline stage (the first, or the last with a big head):
             model states of its tp shard (ZeRO divides piles by d) + activations of the
             micro-batches it holds at once (GPipe m, 1F1B min(p - stage, m), interleaved its warm-up)
    time     compute (FLOPs / (N x FLOP/s), plus a fixed cost per layer pass if the cluster has
             one) + bubble + the exposed tensor-, pipeline- and data-parallel communication, each
             collective priced by the alpha-beta model of chapter 7 (`comm/cost.py`)

What the model leaves out, on purpose: kernel efficiency (smaller matrices run slower), the
unequal work of the first and last stage, and overlap of tensor- and pipeline-parallel messages
with compute (Megatron-LM 2021 overlaps neither; only the data-parallel communication hides
behind compute here, with `overlap=True`, and then as if perfectly).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from minidist.comm import cost
from minidist.training.layout import Layout
from minidist.plan.memory import PRECISIONS, layer_activation_elements, megatron_activation_bytes
from minidist.parallel.mesh import coordinates
from minidist.parallel.pipeline_stage import chunk_layers as _chunk_layers

ACTIVATION_BYTES = {"fp32": 4, "fp64": 8, "mixed": 2}  # bytes per activation element
STATE_BYTES = {**PRECISIONS, "fp64": (8, 8, 16)}        # (params, grads, optimizer) bytes per parameter


@dataclass(frozen=True)
class Cluster:
    """N devices, `gpus_per_node` to a node; bandwidths in bytes/s, latencies in s, memory in bytes."""
    gpus: int
    gpus_per_node: int = 8
    memory: float = 80e9
    intra_bandwidth: float = 300e9  # NVLink-class, inside a node
    intra_latency: float = 2e-6
    inter_bandwidth: float = 25e9   # per device, between nodes (one 200 Gb/s NIC per GPU)
    inter_latency: float = 5e-6
    flops: float = 150e12           # achieved FLOP/s of one device on the model's matrix multiplies
    layer_overhead: float = 0.0     # s per layer and micro-batch (forward + backward) that no split shrinks:
                                    # kernel launches on a GPU, Python's per-operation cost in minidist

    def link(self, inside: bool) -> tuple[float, float]:
        """(alpha, beta) of a message inside a node or between nodes."""
        return (self.intra_latency, 1 / self.intra_bandwidth) if inside else \
            (self.inter_latency, 1 / self.inter_bandwidth)


@dataclass(frozen=True)
class Workload:
    """What is trained: a GPTConfig, the global batch of sequences of length `seq`, and how."""
    config: object                 # minidist.core.model.GPTConfig
    global_batch: int
    seq: int
    precision: str = "mixed"       # "fp32" (4+4+8 bytes per parameter, as minidist runs), "fp64", "mixed" (2+2+12)
    activations: str = "megatron"  # "minidist": this implementation's count; "megatron": Korthikanti et al.
    recompute: bool = False        # full activation recomputation (keep each layer's input only)
    sequence_parallel: bool = False
    overlap: bool = True           # data-parallel communication hides behind backward where it can
    pad_vocab: bool = False        # Megatron-LM pads V to a multiple of 128·t


@functools.lru_cache(maxsize=4096)
def chunk_layers(n_layer: int, pp: int, stage: int, virtual_stages: int = 1) -> tuple:
    """`pipeline.chunk_layers`, remembered: the search asks for the same few partitions many times."""
    return tuple(_chunk_layers(n_layer, pp, stage, virtual_stages))


def padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM's vocabulary padding (`--make-vocab-size-divisible-by 128`, times t): the
    embedding gets dummy rows so that each tp rank holds an equal slice. 50257 -> 50304 (t = 1)."""
    step = multiple * tp
    return -(-vocab // step) * step


# ----------------------------------------------------------------------------- parameters


def rank_units(config, tp: int, pp: int, stage: int, virtual_stages: int = 1) -> list[int]:
    """Parameters one rank of pipeline stage `stage` holds, as minidist's ZeRO units: the "root"
    (everything outside the blocks), then one entry per block (`parallel/zero.py` make_units).

    A stage holds the blocks `chunk_layers` gives it (`pipeline.partition`). Per block its tp
    shard is (12C² + 7C)/t + 6C: q, k, v, c_proj, c_fc, the MLP's c_proj weights and the q, k, v,
    c_fc biases are split; the two LayerNorms and the two row-parallel c_proj biases replicated
    (`memory.tensor_parallel_parameter_counts`). Stage 0 holds wte (V·C/t) and wpe (T·C); the last
    stage ln_f (2C) and, tied with p > 1, its own copy of wte (V·C/t), or untied lm_head (V·C/t)."""
    V, T, C = config.vocab_size, config.block_size, config.n_embd
    blocks = sum(end - start for start, end in chunk_layers(config.n_layer, pp, stage, virtual_stages))
    root = 0
    if stage == 0:
        root += V * C // tp + T * C
    if stage == pp - 1:
        root += 2 * C + (V * C // tp if (not config.tie_weights or pp > 1) else 0)
    return [root] + [(12 * C * C + 7 * C) // tp + 6 * C] * blocks


def rank_parameter_count(config, dp: int, tp: int, pp: int, rank: int, virtual_stages: int = 1) -> int:
    """Parameters world rank `rank` holds in the pp x dp x tp mesh (tp fastest, `mesh.coordinates`)."""
    stage, _, _ = coordinates(rank, dp_size=dp, tp_size=tp)
    return sum(rank_units(config, tp, pp, stage, virtual_stages))


def state_bytes(units: list[int], dp: int, zero: int, bytes_per_param: tuple[int, int, int]) -> dict:
    """Params, grads and optimizer bytes of one rank under ZeRO stage `zero` over dp replicas.

    As `memory.model_state_bytes` (stage 1 divides the optimizer by d, 2 also the gradients, 3
    also the parameters), counted the way minidist's ZeRO stores them: each unit is padded to a
    multiple of d and a rank keeps ceil(unit / d) of a partitioned pile; an unpartitioned pile is
    the padded flat buffer (stages 1-2) or the plain parameters (stage 0)."""
    p, g, k = bytes_per_param
    whole = sum(units)
    padded = sum(-(-u // dp) * dp for u in units) if zero else whole
    shard = sum(-(-u // dp) for u in units)
    return {"params": p * (shard if zero >= 3 else padded),
            "grads": g * (shard if zero >= 2 else padded),
            "optimizer": k * (shard if zero >= 1 else whole)}


# ----------------------------------------------------------------------------- activations


def layer_activation_bytes(w: Workload, b: int, tp: int) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch of b sequences, on one rank.

    "megatron" (Korthikanti et al. 2022, "Reducing Activation Recomputation", Table 2, 16-bit
    activations, 1-byte dropout masks): s·b·h·(10 + 24/t + 5·a·s/(h·t)); with sequence
    parallelism s·b·h·(34/t + 5·a·s/(h·t)); t = 1 is `memory.megatron_activation_bytes`.
    "minidist" (this implementation, elements x bytes, measured by graph_bytes): serially
    25·n·h + 2n + a·b·s² with n = b·s (`memory.layer_activation_elements`); with t > 1 the split
    part (q, k, v, attention, MLP: 17·n·h + a·b·s²) is divided by t, and the replicated part grows
    from 8 to 12 n·h (the row-parallel layers' partial sums before g, and g's output). Merging
    heads copies (n·h/t) unless a rank holds one head, when it is a view. With sequence
    parallelism the replicated region (10·n·h + 2n) is divided by t and each column-parallel
    layer keeps its gathered input (2·n·h): `memory.sequence_parallel_activation_bytes`."""
    c, s, h, a = w.config, w.seq, w.config.n_embd, w.config.n_head
    if w.activations == "megatron":
        base = 34 / tp if w.sequence_parallel else 10 + 24 / tp
        return s * b * h * (base + 5 * a * s / (h * tp)) if tp > 1 else megatron_activation_bytes(b, s, h, a)
    n = b * s
    if tp == 1:
        elements = layer_activation_elements(b, s, h, a, dropout=c.dropout > 0) - (n * h if a == 1 else 0)
    else:
        elements = 12 * n * h + 17 * n * h // tp + 2 * n + (a // tp) * b * s * s - (n * h // tp if a == tp else 0)
        if w.sequence_parallel:
            region = 10 * n * h + 2 * n
            elements += region // tp - region + 2 * n * h
    return elements * ACTIVATION_BYTES[w.precision]


def extra_bytes(w: Workload, b: int, tp: int, first: bool, last: bool, pipelined: bool) -> float:
    """Activations of one micro-batch outside the blocks, on the model's first chunk (`first`: the
    embeddings), on any other (it keeps the activation it received), and on the last (`last`: the head).

    minidist: the embeddings 2n·h + s·h (with t > 1 the vocabulary-parallel lookup, its mask fill
    and g add 2n·h); the received activation n·h; the final LayerNorm (2n·h + n), logits and
    probabilities (2n·V/t), the loss, and when `pipelined` the loss scaled by 1/m
    (`memory.activation_bytes`, `PipelineTrainer._forward`). With sequence parallelism g's output,
    the add of wpe, the position rows, ln_f and the received activation are split by t, and the
    head keeps its gathered input n·h (`memory.sequence_parallel_activation_bytes`).
    megatron (Korthikanti et al. 2022, section 4.3): the embedding dropout mask s·b·h; the received
    input 2s·b·h; the LayerNorm, head and fp32 cross-entropy 4s·b·h·(1 + V/h); divided by t with
    sequence parallelism, the head's always."""
    s, h, V = w.seq, w.config.n_embd, padded_vocab(w.config.vocab_size, tp) if w.pad_vocab else w.config.vocab_size
    n = b * s
    if w.activations == "megatron":
        split = tp if w.sequence_parallel else 1
        return (first * n * h / split + (not first) * 2 * n * h / split + last * 4 * n * h * (1 + V / h) / tp)
    if tp > 1 and w.sequence_parallel:
        embed, received, norm = 2 * n * h + (2 * n * h + s * h) // tp, n * h // tp, (2 * n * h + n) // tp + n * h
    else:
        embed, received, norm = (2 if tp == 1 else 4) * n * h + s * h, n * h, 2 * n * h + n
    elements = first * embed + (not first) * received + last * (norm + 2 * n * V // tp + 1 + pipelined)
    return elements * ACTIVATION_BYTES[w.precision]


def in_flight(schedule: str | None, pp: int, stage: int, m: int, v: int = 1) -> int:
    """Micro-batches whose activations stage `stage` holds at once (of its chunks, interleaved).

    GPipe: all m. 1F1B: min(p - stage, m). Interleaved 1F1B: its warm-up forwards and one more,
    min(2(p - stage - 1) + (v - 1)p + 1, m·v) chunk passes (`schedules.interleaved`, as Megatron-LM).
    No pipeline: one micro-batch (gradient accumulation frees each before the next)."""
    if pp == 1 or schedule is None:
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(pp - stage, m)
    return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)


def stage_activation_bytes(w: Workload, layout: Layout, stage: int) -> float:
    """Activations stage `stage` holds at its peak: `in_flight` micro-batches, each holding its
    layers and what lies outside them (interleaved: `interleaved_peak`, chunk by chunk). With
    recomputation a micro-batch keeps only each layer's input (2s·b·h, or n·h elements), and one
    layer's full activations exist while its backward runs."""
    p, v = layout.pp, layout.virtual_stages
    b = w.global_batch // (layout.dp * layout.microbatches)
    full = layer_activation_bytes(w, b, layout.tp)
    kept, working = full, 0
    if w.recompute:
        kept = b * w.seq * w.config.n_embd * ACTIVATION_BYTES[w.precision] / (layout.tp if w.sequence_parallel else 1)
        working = full
    chunks = [(end - start) * kept + extra_bytes(w, b, layout.tp, c * p + stage == 0, c * p + stage == p * v - 1, p > 1)
              for c, (start, end) in enumerate(chunk_layers(w.config.n_layer, p, stage, v))]
    if layout.schedule == "interleaved":
        return interleaved_peak(chunks, p, stage, layout.microbatches) + working
    return in_flight(layout.schedule, p, stage, layout.microbatches) * chunks[0] + working


def interleaved_peak(chunks: list[float], p: int, stage: int, m: int) -> float:
    """Most bytes stage `stage` of interleaved 1F1B holds, its v chunks holding `chunks` bytes per
    micro-batch. Forward k runs chunk (k mod p·v) // p, backward k the reverse, v - 1 - that
    (`schedules.interleaved`): W warm-up forwards, then forward W + j and backward j. The bytes held
    after step j repeat with period p·v (each period adds and frees every chunk p times), so one
    period of the steady state is walked."""
    v = len(chunks)
    total, warmup = m * v, min(2 * (p - stage - 1) + (v - 1) * p, m * v)
    held = sum(chunks[(k % (p * v)) // p] for k in range(warmup))
    peak = held
    for j in range(min(p * v, total - warmup)):
        held += chunks[((warmup + j) % (p * v)) // p]
        peak = max(peak, held)
        held -= chunks[v - 1 - (j % (p * v)) // p]
    return peak


def stage_ledger(w: Workload, layout: Layout, stage: int) -> dict:
    """Predicted bytes of one rank of pipeline stage `stage`: params, grads, optimizer, activations,
    transient (ZeRO-2: a unit's full gradients and its flat bucket; ZeRO-3 also the gathered root
    and block), and peak, their sum (as `memory.ledger` adds them)."""
    units = rank_units(_config_for(w, layout.tp), layout.tp, layout.pp, stage, layout.virtual_stages)
    ledger = state_bytes(units, layout.dp, layout.zero, STATE_BYTES[w.precision])
    p, g, _ = STATE_BYTES[w.precision]
    ledger["activations"] = stage_activation_bytes(w, layout, stage)
    largest = max(units)
    ledger["transient"] = (2 * g * largest if layout.zero >= 2 else 0) + \
        (p * (units[0] + max(units[1:], default=0)) if layout.zero >= 3 else 0)
    ledger["peak"] = sum(ledger.values())
    return ledger


def rank_ledger(w: Workload, layout: Layout, rank: int) -> dict:
    """Predicted bytes of world rank `rank`: its stage's ledger (`mesh.coordinates`, tp fastest)."""
    return stage_ledger(w, layout, coordinates(rank, dp_size=layout.dp, tp_size=layout.tp)[0])


def _config_for(w: Workload, tp: int):
    """The model as the tp ranks hold it: with pad_vocab, V padded as Megatron-LM pads it."""
    return replace(w.config, vocab_size=padded_vocab(w.config.vocab_size, tp)) if w.pad_vocab else w.config


def heaviest_stage(w: Workload, layout: Layout) -> tuple[int, dict]:
    """(stage, ledger) of the stage with the largest peak. Stage 0 holds at least as much as any
    middle stage (most blocks, the embeddings, the most micro-batches in flight); the last stage
    can exceed it with a big vocabulary: both are computed."""
    stages = {0, layout.pp - 1}
    return max(((s, stage_ledger(w, layout, s)) for s in stages), key=lambda item: (item[1]["peak"], -item[0]))


# ----------------------------------------------------------------------------- time


def flops_per_step(w: Workload) -> float:
    """FLOPs of one training step (forward and backward) of the whole model on the global batch.

    Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", eq. 3): 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) with full activation recomputation
    (the forward runs twice); without it 72·B·s·L·h²·(...) (forward 1 + backward 2 = 3 of 4 parts).
    minidist does not recompute: workload.recompute selects 96."""
    c = w.config
    factor = 96 if w.recompute else 72
    return factor * w.global_batch * w.seq * c.n_layer * c.n_embd ** 2 * \
        (1 + w.seq / (6 * c.n_embd) + c.vocab_size / (16 * c.n_layer * c.n_embd))


@functools.lru_cache(maxsize=4096)
def group_span(axis: str, dp: int, tp: int, pp: int, gpus_per_node: int) -> tuple[int, int, int]:
    """(size, ranks per node, nodes) of the most spread group along `axis` ("tp", "dp", "pp" or
    "embedding": the first and last stage) of the pp x dp x tp mesh, ranks numbered node by node.
    Members are `stride` ranks apart — tp 1, dp t, pp d·t (`mesh.layout`) — so a tp group spans
    nodes only when t > gpus_per_node, a dp group when t·d does. All groups of an axis work at
    once, and the step waits for the slowest: the one over most nodes counts."""
    world = dp * tp * pp
    size, stride, starts = {
        "tp": (tp, 1, range(0, world, tp)),
        "dp": (dp, tp, [s * dp * tp + r for s in range(pp) for r in range(tp)]),
        "pp": (pp, dp * tp, range(dp * tp)),
        "embedding": (min(pp, 2), (pp - 1) * dp * tp, range(dp * tp)),
    }[axis]
    nodes = max(len({(first + k * stride) // gpus_per_node for k in range(size)}) for first in starts)
    return size, -(-size // nodes), nodes


def all_reduce_seconds(nbytes: float, axis: str, layout: Layout, cluster: Cluster) -> float:
    """One all-reduce of `nbytes` in each group along `axis`: the ring's 2(n-1)α + 2(n-1)/n·S·β
    inside a node (`cost.predict`); across nodes the better of the flat ring and the hierarchical
    all-reduce of the two-level model (`cost.predict_two_level`)."""
    size, per_node, nodes = group_span(axis, layout.dp, layout.tp, layout.pp, cluster.gpus_per_node)
    if size == 1 or nbytes == 0:
        return 0.0
    if nodes == 1:
        return cost.predict("all_reduce", "ring", size, nbytes, *cluster.link(True))
    inside, between = cluster.link(True), cluster.link(False)
    return min(cost.predict_two_level(algorithm, per_node, nodes, nbytes, *inside, *between)
               for algorithm in ("ring", "hierarchical"))


def half_seconds(nbytes: float, axis: str, layout: Layout, cluster: Cluster) -> float:
    """A reduce-scatter or an all-gather: half an all-reduce (the ring's two halves, chapter 7)."""
    return all_reduce_seconds(nbytes, axis, layout, cluster) / 2


def tp_calls(w: Workload, layout: Layout) -> int:
    """Activation all-reduces of the busiest (first) stage per step: 4 per layer and micro-batch
    (g after attention and MLP forward, f before them backward; Megatron-LM section 3.2), 2 more
    per layer when recomputation repeats the forward, plus the embedding's g (and, with p = 1, the
    head's f): `cost.tensor_parallel_traffic_per_step` counts 4L + 2. Sequence parallelism turns
    each into a reduce-scatter and an all-gather: the same bytes."""
    if layout.tp == 1:
        return 0
    layers = sum(e - s for s, e in chunk_layers(w.config.n_layer, layout.pp, 0, layout.virtual_stages))
    per_layer = 6 if w.recompute else 4
    return layout.microbatches * (per_layer * layers + 1 + (layout.pp == 1))


def predict(w: Workload, layout: Layout, cluster: Cluster) -> dict:
    """Step time split into compute, bubble and the exposed tp / pp / dp communication (seconds),
    the bytes each rank sends per step on each axis, and the heaviest stage's memory."""
    d, t, p, m, v = layout.dp, layout.tp, layout.pp, layout.microbatches, layout.virtual_stages
    b = w.global_batch // (d * m)
    act = ACTIVATION_BYTES[w.precision]
    layers = sum(e - s for s, e in chunk_layers(w.config.n_layer, p, 0, v))  # the first stage's, the most
    # ideal: every device busy, plus the fixed cost of each layer pass of each micro-batch
    compute = flops_per_step(w) / (cluster.gpus * cluster.flops) + m * layers * cluster.layer_overhead
    bubble = (p - 1) / (v * m) * compute  # Megatron-LM: (p-1)/m of ideal time, /v interleaved

    tp_bytes = b * w.seq * w.config.n_embd * act
    calls = tp_calls(w, layout)
    tp_time = calls * all_reduce_seconds(tp_bytes, "tp", layout, cluster)

    # one activation per micro-batch and boundary each way (split by t with sequence parallelism);
    # the critical path waits for one message per slot: v·m + p - 1 forward, as many backward.
    # A tied embedding's two copies (first and last stage) also all-reduce their gradients
    # once per step (Megatron-LM's embedding group).
    pp_bytes = tp_bytes / (t if w.sequence_parallel else 1)
    pp_time = embedding = 0.0
    if p > 1:
        _, _, nodes = group_span("pp", d, t, p, cluster.gpus_per_node)
        alpha, beta = cluster.link(nodes == 1)
        pp_time = 2 * (v * m + p - 1) * (alpha + pp_bytes * beta)
        if w.config.tie_weights:
            embedding = _config_for(w, t).vocab_size * w.config.n_embd // t * STATE_BYTES[w.precision][1]
            pp_time += all_reduce_seconds(embedding, "embedding", layout, cluster)

    dp_time, dp_sent = _data_parallel(w, layout, cluster, compute)
    stage, ledger = heaviest_stage(w, layout)
    step = compute + bubble + tp_time + pp_time + dp_time
    tokens = w.global_batch * w.seq
    return {"step_seconds": step, "compute": compute, "bubble": bubble, "tp": tp_time, "pp": pp_time,
            "dp": dp_time, "bubble_fraction": bubble / (compute + bubble),
            "micro_batch": b, "tokens_per_second": tokens / step,
            "bytes_sent": {"tp": calls * 2 * (t - 1) / t * tp_bytes, "pp": pp_messages(p, m, v) * pp_bytes,
                           "embedding": embedding, "dp": dp_sent},
            "memory": ledger, "memory_stage": stage, "fits": ledger["peak"] <= cluster.memory}


def pp_messages(p: int, m: int, v: int = 1) -> int:
    """Activations and gradients the busiest rank of a pipeline sends per step: a middle stage
    sends each micro-batch's activation on and its gradient back (2·v·m); with p = 2 the first
    rank sends no gradient of its first chunk, the last no activation of its last: (2v - 1)·m."""
    return 0 if p == 1 else (2 * v if p > 2 else 2 * v - 1) * m


def _data_parallel(w: Workload, layout: Layout, cluster: Cluster, compute: float) -> tuple[float, float]:
    """(exposed seconds, bytes sent per rank) of the data-parallel gradients and weights.

    Stage 0: all-reduce the gradients (ring: 2(d-1)/d of them). Stage 1: reduce-scatter them and
    all-gather the updated weights (the same bytes). Stage 2: a reduce-scatter per micro-batch (the
    gradients cannot persist, which is also why stages 2-3 do not combine with p > 1), then the
    all-gather. Stage 3: per micro-batch all-gather the weights for forward and again for backward,
    and reduce-scatter the gradients: about 1.5x stage 0 (`cost.zero_bytes_sent`).
    overlap: stage 0's buckets hide behind the last micro-batch's backward (DDP); stage 2's
    reduce-scatters behind their micro-batch's backward; stage 3's gathers behind the forward
    and backward they prefetch for; stage 1 (after backward) and the final all-gathers do not hide."""
    d, z, m, v = layout.dp, layout.zero, layout.microbatches, layout.virtual_stages
    if d == 1:
        return 0.0, 0.0
    p_bytes, g_bytes, _ = STATE_BYTES[w.precision]
    config = _config_for(w, layout.tp)
    params = max(sum(rank_units(config, layout.tp, layout.pp, s, v)) for s in {0, layout.pp - 1})
    grads, weights = params * g_bytes, params * p_bytes
    ar = all_reduce_seconds(grads, "dp", layout, cluster)
    rs, ag = half_seconds(grads, "dp", layout, cluster), half_seconds(weights, "dp", layout, cluster)
    ring = (d - 1) / d
    backward = compute * (3 / 4 if w.recompute else 2 / 3)  # the backward's share of the FLOPs
    forward = compute - backward
    hide = w.overlap
    if z == 0:
        return (max(0.0, ar - backward / (m * v)) if hide else ar), 2 * ring * grads
    if z == 1:
        return rs + ag, ring * (grads + weights)
    if z == 2:
        exposed = m * max(0.0, rs - backward / m) if hide else m * rs
        return exposed + ag, ring * (m * grads + weights)
    if hide:
        exposed = m * (max(0.0, ag - forward / m) + max(0.0, ag + rs - backward / m))
    else:
        exposed = m * (2 * ag + rs)
    return exposed, m * ring * (2 * weights + grads)
