"""Step time of one layout, predicted from the work it does (chapter 9).

The planner's memory is arithmetic (`predict.py`); its time is the same kind of arithmetic, done
at the level where time is actually spent:

* **Matrix multiplies** (GEMMs) run at a rate that depends on their size. A GEMM of W FLOPs costs
  (W + W½) / (e · peak): a fixed start (W½ / (e · peak): launching, filling the tiles, the tail
  wave) plus its FLOPs at the best fraction e of the device's peak — the alpha-beta model of
  chapter 7, applied to compute (`GemmCurve`). Big GEMMs approach e·peak; a larger tp or a smaller
  micro-batch makes them smaller and slower per FLOP. The roofline caps it: a GEMM never beats
  moving its operands at the memory's bandwidth.
* **Element-wise work** (LayerNorm, softmax, GeLU, dropout, residual adds) moves bytes and does
  almost no arithmetic: it runs at memory bandwidth. Each activation a layer stores for backward
  (Korthikanti et al. 2022's count, `predict.layer_activation_bytes`) is written once and read
  once forward, twice as much backward.
* **Tensor-parallel all-reduces** sit on the critical path (the next GEMM needs their result):
  two per layer forward, two backward, two more when recomputation repeats the forward.
* **The pipeline**: each stage's forward and backward per micro-batch are the sums above for its
  layers (the first adds the embedding, the last the head and the loss), each boundary sends one
  activation per micro-batch, and the step is the makespan of *simulating the schedule*
  (`schedules.simulate`) with those costs, so unequal stages show as bubble.
* **Data parallelism** overlaps what can overlap: stage 0's bucketed all-reduce runs during the
  last micro-batch's backward, except its last bucket (during every micro-batch's with
  `sync_every_microbatch`: PyTorch's DDP in Megatron-LM's pipelines); ZeRO-1 reduce-scatters after backward and
  all-gathers after the step, or with `overlap` (Megatron-LM's distributed optimizer with its
  overlap flags) reduce-scatters behind the last backward and all-gathers ahead of the next step's
  first forward, each but one bucket hidden; ZeRO-2 reduce-scatters during each micro-batch's backward; ZeRO-3
  gathers each layer's weights one layer ahead, so each gather hides behind one layer's compute
  and shows when that compute is shorter. `overlap=False` (Megatron-LM 2021) sends after backward.
* **The optimizer**: AdamW reads and writes every parameter's states once: memory bandwidth.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from minidist.comm import cost
from minidist.parallel import schedules as S
from minidist.plan.stage_memory import attention_core_bytes, layer_activation_bytes
from minidist.plan.workload import (ACTIVATION_BYTES, Cluster, Workload, block_weights, block_widths, bytes_per_param,
                                   chunk_layers, padded_vocab)
from minidist.training.layout import Layout


def flops_per_step(w: Workload, recompute: bool | None = None) -> float:
    """FLOPs of one training step (forward and backward) of the whole model on the global batch.

    Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", eq. 3): 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) with full activation recomputation:
    each layer's 24·B·s·h² + 4·B·s²·h four times (forward, backward twice, the forward again), the
    head's 2·B·s·h·V three times. Without recomputation the layers run three times (72·B·s·L·h²...),
    with selective recomputation plus the attention core's 4·B·s²·h once more per layer.
    `recompute` (default: the workload's) chooses; MFU counts the model's FLOPs, `recompute=False`."""
    c, B, s = w.config, w.global_batch, w.seq
    again = w.selective and not w.recompute and recompute is None  # selective recomputation: the core again
    passes = 4 if (w.recompute if recompute is None else recompute) else 3
    weights, _ = block_weights(c)  # 12h² (24·B·s·h² a forward); grouped-query attention and gated MLPs their own
    core = 4 * B * s * s * c.n_layer * c.n_embd  # the attention core's two batched GEMMs, a forward
    return passes * (2 * B * s * c.n_layer * weights + core) + again * core + 6 * B * s * c.n_embd * c.vocab_size


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
    all-reduce of the two-level model (`cost.predict_two_level`). With `cluster.rails` > 1 the flat
    ring runs as that many rings side by side (up to the group's members on a node), each on its
    own NIC with its share of the bytes: the link between nodes is that many times as fast."""
    size, per_node, nodes = group_span(axis, layout.dp, layout.tp, layout.pp, cluster.gpus_per_node)
    if size == 1 or nbytes == 0:
        return 0.0
    if nodes == 1:
        return cost.predict("all_reduce", "ring", size, nbytes, *cluster.link(True))
    inside, (alpha, beta) = cluster.link(True), cluster.link(False)
    rings = min(cluster.rails, per_node)
    return min(cost.predict_two_level("ring", per_node, nodes, nbytes, *inside, alpha, beta / rings),
               cost.predict_two_level("hierarchical", per_node, nodes, nbytes, *inside, alpha, beta))


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
    layers = sum(e - s for s, e in chunk_layers(w.config.n_layer, layout.pp, 0, layout.virtual_stages,
                                                w.ends_as_layers))
    per_layer = 6 if w.recompute else 4
    return layout.microbatches * (per_layer * layers + 1 + (layout.pp == 1))


def pp_messages(p: int, m: int, v: int = 1) -> int:
    """Activations and gradients the busiest rank of a pipeline sends per step: a middle stage
    sends each micro-batch's activation on and its gradient back (2·v·m); with p = 2 the first
    rank sends no gradient of its first chunk, the last no activation of its last: (2v - 1)·m."""
    return 0 if p == 1 else (2 * v if p > 2 else 2 * v - 1) * m


def layer_gemms(b: int, s: int, h: int, a: int, t: int, kv: int = 0, ffn: int = 0,
                gated: bool = False) -> list[tuple[int, int, int, int]]:
    """(count, M, N, K) of one transformer layer's forward GEMMs on one of t tensor-parallel ranks,
    for b sequences of s tokens: q/k/v, the scores and the weighted values per head, the
    projection, the MLP's two (gated: its gate and up as one, then down). kv key/value heads
    (0: a) and an MLP ffn wide (0: 4h) as `workload.block_widths` gives them. 2·count·M·N·K adds
    up to (24·b·s·h² + 4·b·s²·h) / t for minidist's GPT."""
    n, heads, d, kv, ffn = b * s, b * (a // t), h // a, kv or a, ffn or 4 * h
    return [(1, n, (h + 2 * kv * d) // t, h), (heads, s, s, d), (heads, s, d, s), (1, n, h, h // t),
            (1, n, (2 if gated else 1) * ffn // t, h), (1, n, h, ffn // t)]


def gemms_seconds(gemms, cluster, itemsize: int) -> tuple[float, float]:
    """(seconds, FLOPs) of a list of (count, M, N, K) GEMMs on one device. A count above one is
    one batched GEMM (every head's at once, as cuBLAS's strided batched GEMM runs them): one start."""
    seconds = flops = 0.0
    for count, m, n, k in gemms:
        f = 2.0 * m * n * k * count
        seconds += cluster.gemm.seconds(f, count * itemsize * (m * k + k * n + m * n), cluster.flops,
                                        cluster.memory_bandwidth)
        flops += f
    return seconds, flops


@dataclass(frozen=True)
class StageCost:
    """One pipeline chunk's cost per micro-batch (s): forward and backward, each split into
    matrix work, element-wise work and tensor-parallel all-reduces, plus the message each sends:
    its activation on after forward, its gradient back after backward (the pipeline's first chunk
    has no gradient to send back, its last no activation to send on), the message each takes in
    (the activation before forward, the gradient before backward: the same chunks but the other
    way round) and the engine's own time after each."""
    gemm: float         # the forward's GEMMs (backward: twice)
    elementwise: float  # the forward's element-wise work (backward: twice)
    tp: float           # all four all-reduces, two forward and two backward
    recompute: bool     # backward first runs the forward again
    message: float = 0.0
    sends_forward: bool = True   # False for the pipeline's last chunk
    sends_backward: bool = True  # False for its first
    engine: float = 0.0          # the pipeline engine's time after each forward and backward
    core: float = 0.0            # selective recomputation: the attention core's forward, run again in backward
    receive: float = 0.0         # taking in one message: an activation before forward, a gradient before backward

    @property
    def receives_forward(self) -> bool:  # an activation comes in: every chunk that sends a gradient back
        return self.sends_backward

    @property
    def receives_backward(self) -> bool:  # a gradient comes in: every chunk that sends an activation on
        return self.sends_forward

    @property
    def forward(self) -> float:
        return self.gemm + self.elementwise + self.tp / 2 + self.messages(forward=True) + self.engine

    @property
    def backward(self) -> float:
        again = (self.gemm + self.elementwise + self.tp / 2) if self.recompute else self.core
        return 2 * (self.gemm + self.elementwise) + self.tp / 2 + again + self.messages(forward=False) + self.engine

    def messages(self, forward: bool) -> float:
        """The forward's (or backward's) messages: the one it takes in and the one it sends."""
        if forward:
            return self.receive * self.receives_forward + self.message * self.sends_forward
        return self.receive * self.receives_backward + self.message * self.sends_backward

    def parts(self) -> dict:
        """Forward plus backward by kind: compute, tp, pp (the messages and the engine around them)
        and their total."""
        runs = 3 + self.recompute  # forward, backward (2), the recomputed forward
        return {"compute": runs * (self.gemm + self.elementwise) + (not self.recompute) * self.core,
                "tp": self.tp * (1 + self.recompute / 2),
                "pp": self.messages(True) + self.messages(False) + 2 * self.engine,
                "total": self.forward + self.backward}


@functools.lru_cache(maxsize=65536)
def pipeline_seconds(costs: tuple, schedule: str, p: int, m: int, v: int) -> float:
    """Makespan of `schedule` with each rank's chunks costing `costs[rank][chunk]` (StageCost),
    simulated (`schedules.simulate`). Once every stage is busy, each further micro-batch (GPipe,
    1F1B) or group of p (interleaved) adds the same time, so a long pipeline is simulated for its
    fill and a period or two and extended linearly (exact for GPipe and 1F1B; interleaved with
    unequal chunks settles more slowly: within 1 % after 4p, tests/test_plan_time.py)."""
    forward = [[c.forward for c in rank] for rank in costs]
    backward = [[c.backward for c in rank] for rank in costs]

    def makespan(micro: int) -> float:
        events = S.simulate(_schedules(schedule, p, micro, v), forward=lambda r, c: forward[r][c],
                            backward=lambda r, c: backward[r][c])
        return max(e[3] for rank in events for e in rank)

    return extended(makespan, schedule, p, m)


# Every rank's instruction list, kept: many layouts share a schedule, p, m and v (simulate only reads them)
_schedules = functools.lru_cache(maxsize=1024)(S.all_ranks)


def extended(makespan, schedule: str, p: int, m: int) -> float:
    """`makespan(m)` of a pipeline, simulated only for its fill and a period or two: once every stage
    is busy, each further micro-batch (GPipe, 1F1B) or group of p (interleaved) adds the same time."""
    period = p if schedule == "interleaved" else 1
    small = 4 * p if schedule == "interleaved" else p  # past the fill, a whole number of periods
    if m <= small + period:
        return makespan(m)
    first, second = makespan(small), makespan(small + period)
    return second + (m - small - period) / period * (second - first)


def pipeline_estimate(costs: tuple, p: int, m: int, v: int) -> float:
    """The makespan without simulating: the busiest rank's m micro-batches, plus one pass of every
    other stage's work to fill and drain (exact for equal stages: (m + p - 1)·W; interleaving
    fills in chunk slots: (p - 1)/v of a stage each)."""
    work = [sum(c.forward + c.backward for c in rank) for rank in costs]
    return m * max(work) + (sum(work) - max(work)) / v


def message_split(w, t: int) -> int:
    """Into how many pieces a pipeline message is cut, each sent by one tp rank: t when the activation
    is already split along the sequence (sequence parallelism) or is cut for the trip (Megatron-LM's
    scatter/gather, chapter 9), else 1 (every tp rank holds it whole and one copy travels)."""
    return t if w.sequence_parallel or w.scatter_gather else 1


def stage_costs(w, layout: Layout, cluster, b: int) -> tuple:
    """(StageCost per chunk) per pipeline rank, for one micro-batch of b sequences."""
    c, s, t, p, v = w.config, w.seq, layout.tp, layout.pp, layout.virtual_stages
    h, a = c.n_embd, c.n_head
    item = ACTIVATION_BYTES[w.precision]
    vocab = padded_vocab(c.vocab_size, t) if w.pad_vocab else c.vocab_size
    kv, ffn, inputs = block_widths(c)
    gemm, _ = gemms_seconds(layer_gemms(b, s, h, a, t, kv, ffn, inputs == 2), cluster, item)
    # each stored activation written and read once forward (Korthikanti et al.'s bytes are 16-bit); the
    # forward moves the attention core's tensors whether or not selective recomputation keeps them
    stored = layer_activation_bytes(replace(w, selective=False), b, t)
    moved = 2 * stored * (item / 2 if w.activations == "megatron" else 1)
    # fixed costs of a layer pass, a third forward and two thirds backward: every layer's, and the
    # tensor-parallel layers' own (their f and g functions, the vocabulary-parallel loss: chapter 6)
    elementwise = moved / cluster.memory_bandwidth + (cluster.layer_overhead + (t > 1) * cluster.overhead("tp")) / 3
    calls = 2 if t > 1 else 0
    tp = 2 * calls * all_reduce_seconds(b * s * h * item, "tp", layout, cluster)  # two forward, two backward
    head_gemm, _ = gemms_seconds([(1, b * s, vocab // t, h)], cluster, item)
    core = 0.0
    if w.selective:  # the core's two batched GEMMs, its s x s tensors written and read again
        core, _ = gemms_seconds(layer_gemms(b, s, h, a, t, kv, ffn, inputs == 2)[1:3], cluster, item)
        core += 2 * attention_core_bytes(w, b, t) / cluster.memory_bandwidth
    head_elementwise = 4 * b * s * vocab // t * 4 / cluster.memory_bandwidth  # fp32 logits: softmax, loss, grad
    message = engine = receive = 0.0
    if p > 1:
        _, _, nodes = group_span("pp", layout.dp, t, p, cluster.gpus_per_node)
        alpha, beta = cluster.link(nodes == 1)
        alpha = cluster.p2p_latency if cluster.p2p_latency is not None else alpha
        beta = cluster.p2p_byte_seconds if cluster.p2p_byte_seconds is not None else beta
        activation = b * s * h * item
        message = alpha + activation / message_split(w, t) * beta
        if w.scatter_gather and t > 1 and not w.sequence_parallel:  # the receivers put the pieces together
            message += cost.predict("all_gather", "ring", t, activation, *cluster.link(True))
        engine = cluster.engine_overhead  # the engine's own time after each pass, idle as a run measures it
        receive = cluster.receive_overhead + activation / message_split(w, t) * cluster.receive_byte_seconds
    per_rank = []
    for rank in range(p):
        chunks = []
        for chunk, (start, end) in enumerate(chunk_layers(c.n_layer, p, rank, v, w.ends_as_layers)):
            layers = end - start
            first, last = chunk * p + rank == 0, chunk * p + rank == p * v - 1
            chunks.append(StageCost(layers * gemm + last * head_gemm, layers * elementwise + last * head_elementwise,
                                    layers * tp, w.recompute, message, not last, not first, engine, layers * core,
                                    receive))
        per_rank.append(tuple(chunks))
    return tuple(per_rank)


def optimizer_seconds(parameters: float, zero: int, dp: int, cluster) -> float:
    """AdamW reads and writes weights, gradient, master and two moments: about 32 bytes a parameter
    (16-bit weights), for the parameters this rank updates (ZeRO: its 1/d)."""
    return 32 * parameters / (dp if zero else 1) / cluster.memory_bandwidth


def strategy_overhead_seconds(w, layout: Layout, cluster) -> float:
    """The step's share of a strategy's own bookkeeping that no split shrinks (`Cluster.strategy_overhead`;
    the tensor-parallel layers' share is in each layer pass, `stage_costs`): ZeRO-2 and 3 per unit
    (a layer, or the embeddings and head) and micro-batch: flattening each micro-batch's gradients
    into a bucket, and for ZeRO-3 gathering, viewing and releasing each unit's weights (chapter 8);
    the mesh engine per micro-batch where it runs a layout without a pipeline (tp with accumulation,
    dp x tp: a one-stage pipeline, chapter 9)."""
    d, t, p, z, m = layout.dp, layout.tp, layout.pp, layout.zero, layout.microbatches
    seconds = 0.0
    if z >= 2:
        seconds += m * (w.config.n_layer + 1) * cluster.overhead(f"zero{z}")
    elif p == 1 and t > 1 and (m > 1 or d > 1):
        seconds += m * cluster.overhead("mesh")
    return seconds


def gradient_passes_seconds(w, layout: Layout, cluster, params: float) -> float:
    """The memory passes over this rank's gradients that no link sees, at memory bandwidth (only with
    `w.gradient_passes`): each micro-batch after the first adds its gradients to the sum (read
    both, write one: 3 passes); ZeRO-2 and 3 instead copy every micro-batch's gradients into a flat
    bucket (2 passes) and add the reduced chunk to the rank's own (3 passes of 1/d), and ZeRO-3
    writes each gathered layer's weights (a pass per gather)."""
    if not w.gradient_passes:
        return 0.0
    d, z, m = layout.dp, layout.zero, layout.microbatches
    p_bytes, g_bytes, _ = bytes_per_param(w)
    grads = params * g_bytes
    if z >= 2:
        moved = m * (2 * grads + 3 * grads / d)
        if z == 3:
            moved += m * (3 if w.recompute else 2) * params * p_bytes
    else:
        moved = (m - 1) * 3 * grads
    return moved / cluster.memory_bandwidth


def data_parallel_seconds(w, layout: Layout, cluster: Cluster, params: float, last_backward: float,
                          layer_compute: tuple[float, float], bucket_bytes: float = 25e6,
                          first_forward: float = 0.0) -> tuple[float, float]:
    """(exposed seconds, bytes sent per rank) of the data-parallel traffic (module docstring).

    `params`: parameters of this rank's stage shard; `last_backward`: the last micro-batch's
    backward on this stage (what a bucketed all-reduce hides behind); `layer_compute`: one layer's
    (forward, backward) per micro-batch (what one ZeRO-3 gather hides behind); `first_forward`: the
    first micro-batch's forward (what an overlapped ZeRO-1 all-gather hides behind). Communication that
    hides is not free: the compute beside it loses `cluster.overlap_cost` of each hidden second."""
    d, z, m = layout.dp, layout.zero, layout.microbatches
    if d == 1:
        return 0.0, 0.0
    p_bytes, g_bytes, _ = bytes_per_param(w)
    grads, weights = params * g_bytes, params * p_bytes
    ring = (d - 1) / d
    ar = all_reduce_seconds(grads, "dp", layout, cluster)
    rs, ag = half_seconds(grads, "dp", layout, cluster), half_seconds(weights, "dp", layout, cluster)

    def shown(busy: float, behind: float) -> float:  # `busy` s of traffic beside `behind` s of compute
        exposed = max(0.0, busy - behind) if w.overlap else busy
        return exposed + cluster.overlap_cost * (busy - exposed)

    def bucketed(busy: float, nbytes: float, behind: float) -> float:  # the same in buckets of `bucket_bytes`:
        return max(shown(busy, behind), busy * min(1.0, bucket_bytes / nbytes))  # one shows (last ready, first needed)

    if z == 0:
        once = bucketed(ar, grads, last_backward)  # the last bucket is ready only when backward ends
        if w.sync_every_microbatch and layout.pp > 1:  # every micro-batch's backward all-reduces the stage's gradients
            return m * once, m * 2 * ring * grads
        return once, 2 * ring * grads
    if z == 1:
        if w.overlap:  # Megatron-LM's distributed optimizer overlapping both halves (and FSDP's ZeRO-2 in a pipeline):
            # the reduce-scatter in buckets behind the last backward, the next step's all-gather bucket by
            # bucket ahead of the first micro-batch's forward
            return bucketed(rs, grads, last_backward) + bucketed(ag, weights, first_forward), ring * (grads + weights)
        return rs + ag, ring * (grads + weights)
    if z == 2:
        return m * shown(rs, last_backward) + ag, ring * (m * grads + weights)
    # ZeRO-3 frees a layer's weights after each use: gathered for forward, again for backward, and
    # with recomputation a third time for the forward that backward repeats (DeepSpeed's hooks);
    # each gather runs one layer ahead, behind the compute of the layer before it
    gathers = 3 if w.recompute else 2
    layers = max(1, w.config.n_layer // layout.pp)
    ag_layer, rs_layer = ag / layers, rs / layers
    forward, backward = layer_compute
    per_layer = shown(ag_layer, forward) + shown((gathers - 1) * ag_layer + rs_layer, backward)
    return m * (layers * per_layer + 2 * ag_layer + rs_layer), m * ring * (gathers * weights + grads)
