"""Memory of one rank of a layout, predicted: its parameters, gradients, optimizer states and
activations (chapter 9's planner; the piles are chapter 1's, the activations Korthikanti et al.'s).

Each formula sits in the function that uses it, with its source; `python -m minidist.bench plan`
runs minidist's own layouts beside the prediction.
"""
from __future__ import annotations

from minidist.parallel.mesh import coordinates
from minidist.plan.memory import layer_activation_elements
from minidist.plan.workload import (ACTIVATION_BYTES, Workload, block_weights, block_widths, bytes_per_param,
                                   chunk_layers, config_for, padded_vocab)
from minidist.training.layout import Layout


# ----------------------------------------------------------------------------- parameters


def rank_units(config, tp: int, pp: int, stage: int, virtual_stages: int = 1,
               ends_as_layers: bool = False) -> list[int]:
    """Parameters one rank of pipeline stage `stage` holds, as minidist's ZeRO units: the "root"
    (everything outside the blocks), then one entry per block (`parallel/zero.py` make_units).

    A stage holds the blocks `chunk_layers` gives it (`pipeline.partition`). Per block its tp
    shard is (12C² + 7C)/t + 6C: q, k, v, c_proj, c_fc, the MLP's c_proj weights and the q, k, v,
    c_fc biases are split; the two LayerNorms and the two row-parallel c_proj biases replicated
    (`memory.tensor_parallel_parameter_counts`). Stage 0 holds wte (V·C/t) and wpe (T·C); the last
    stage ln_f (2C) and, tied with p > 1, its own copy of wte (V·C/t), or untied lm_head (V·C/t)."""
    V, T, C = config.vocab_size, config.block_size, config.n_embd
    blocks = sum(end - start for start, end in chunk_layers(config.n_layer, pp, stage, virtual_stages, ends_as_layers))
    root = 0
    if stage == 0:
        root += V * C // tp + T * C
    if stage == pp - 1:
        root += 2 * C + (V * C // tp if (not config.tie_weights or pp > 1) else 0)
    weights, biases = block_weights(config)  # 12C² and 7C for minidist's GPT
    return [root] + [(weights + biases) // tp + 6 * C] * blocks


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


def megatron_layer_terms(w: Workload) -> tuple[float, float, float]:
    """Korthikanti et al.'s count of one layer's stored activations, by the tensors they count, for
    the workload's block: (replicated, split, scores), the first two in units of s·b·h bytes (the
    part every tp rank keeps whole without sequence parallelism, and the part split over t), the
    last in units of a·s²·b bytes (per query head; split over t).

    Replicated: the two LayerNorms' inputs (4), the attention's and the MLP's inputs (2 + 2), and a
    1-byte dropout mask after each (1 + 1). Split: q (2), k and v (2 each, times kv/a with
    grouped-query attention), the attention's output projection's input (2), and the MLP's
    intermediates, 2 bytes per element: GPT's GeLU input and output (2 x 4h wide); a gated MLP's gate
    and up outputs and their product (3 x ffn wide). Scores: softmax's output (2), its dropout
    mask (1) and the dropped-out weights (2); FlashAttention keeps none of them, only each query
    head's fp32 log-sum-exp per token (4 bytes, counted in the split part); selective recomputation
    keeps none of them and no log-sum-exp (backward runs the core again). GPT's block: 10, 24, 5."""
    c, h, a = w.config, w.config.n_embd, w.config.n_head
    kv, ffn, inputs = block_widths(c)
    masks = 1 if w.dropout else 0
    replicated = 4 + 2 + 2 + 2 * masks
    split = 2 + 4 * kv / a + 2 + (2 * inputs + 2) * ffn / h
    if w.flash_attention:
        return replicated, split + 4 * a / h, 0.0
    if w.selective:  # the attention core runs again in backward: none of its s x s tensors kept
        return replicated, split, 0.0
    return replicated, split, 2 + 3 * masks


def layer_activation_bytes(w: Workload, b: int, tp: int) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch of b sequences, on one rank.

    "megatron" (Korthikanti et al. 2022, "Reducing Activation Recomputation", Table 2, 16-bit
    activations, 1-byte dropout masks): s·b·h·(10 + 24/t + 5·a·s/(h·t)); with sequence
    parallelism s·b·h·(34/t + 5·a·s/(h·t)); t = 1 is `memory.megatron_activation_bytes`. Their
    count is for GPT's block; `megatron_layer_terms` counts the same tensors for the block the
    workload has (grouped-query attention, a gated MLP, no dropout, FlashAttention).
    "minidist" (this implementation, elements x bytes, measured by graph_bytes): serially
    25·n·h + 2n + a·b·s² with n = b·s (`memory.layer_activation_elements`); with t > 1 the split
    part (q, k, v, attention, MLP: 17·n·h + a·b·s²) is divided by t, and the replicated part grows
    from 8 to 12 n·h (the row-parallel layers' partial sums before g, and g's output). Merging
    heads copies (n·h/t) unless a rank holds one head, when it is a view. With sequence
    parallelism the replicated region (10·n·h + 2n) is divided by t and each column-parallel
    layer keeps its gathered input (2·n·h): `memory.sequence_parallel_activation_bytes`."""
    c, s, h, a = w.config, w.seq, w.config.n_embd, w.config.n_head
    if w.activations == "megatron":
        replicated, split, scores = megatron_layer_terms(w)
        return s * b * h * ((replicated + split) / tp if w.sequence_parallel else replicated + split / tp) + \
            s * b * h * scores * a * s / (h * tp)
    n = b * s
    if w.selective:  # minidist's selective recomputation keeps no softmax (nor its dropout mask)
        scores = (1 + (c.dropout > 0)) * (a // tp) * b * s * s
    else:
        scores = 0
    if tp == 1:
        elements = layer_activation_elements(b, s, h, a, dropout=c.dropout > 0) - (n * h if a == 1 else 0) - scores
    else:
        elements = 12 * n * h + 17 * n * h // tp + 2 * n + (a // tp) * b * s * s - (n * h // tp if a == tp else 0)
        elements -= scores
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


def attention_core_bytes(w: Workload, b: int, tp: int) -> float:
    """The s x s tensors of one layer's attention core on one of tp ranks, which selective
    recomputation rebuilds in backward: Korthikanti et al.'s 5·a·s²·b bytes (softmax output, its
    dropout mask and the dropped-out weights; 2 without dropout), minidist's softmax (and mask)."""
    c, s, a = w.config, w.seq, w.config.n_head
    if w.activations == "megatron":
        return (2 + 3 * w.dropout) * a * s * s * b / tp
    return (1 + (c.dropout > 0)) * (a // tp) * b * s * s * ACTIVATION_BYTES[w.precision]


def stage_activation_bytes(w: Workload, layout: Layout, stage: int) -> float:
    """Activations stage `stage` holds at its peak: `in_flight` micro-batches, each holding its
    layers and what lies outside them (interleaved: `interleaved_peak`, chunk by chunk). With
    recomputation a micro-batch keeps only each layer's input (2s·b·h, or n·h elements), and one
    layer's full activations exist while its backward runs; with selective recomputation each layer
    keeps all but its attention core's s x s tensors, and one core is rebuilt at a time."""
    p, v = layout.pp, layout.virtual_stages
    b = w.global_batch // (layout.dp * layout.microbatches)
    full = layer_activation_bytes(w, b, layout.tp)
    kept, working = full, 0
    if w.recompute:
        kept = b * w.seq * w.config.n_embd * ACTIVATION_BYTES[w.precision] / (layout.tp if w.sequence_parallel else 1)
        working = full
    elif w.selective:  # one layer's attention core rebuilt at a time in backward
        working = attention_core_bytes(w, b, layout.tp)
    chunks = [(end - start) * kept + extra_bytes(w, b, layout.tp, c * p + stage == 0, c * p + stage == p * v - 1, p > 1)
              for c, (start, end) in enumerate(chunk_layers(w.config.n_layer, p, stage, v, w.ends_as_layers))]
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
    units = rank_units(config_for(w, layout.tp), layout.tp, layout.pp, stage, layout.virtual_stages, w.ends_as_layers)
    ledger = state_bytes(units, layout.dp, layout.zero, bytes_per_param(w))
    ledger["grads"] *= w.gradient_copies
    p, g, _ = bytes_per_param(w)
    ledger["activations"] = stage_activation_bytes(w, layout, stage)
    largest = max(units)
    ledger["transient"] = (2 * g * largest if layout.zero >= 2 else 0) + \
        (p * (units[0] + max(units[1:], default=0)) if layout.zero >= 3 else 0)
    ledger["peak"] = sum(ledger.values())
    return ledger


def rank_ledger(w: Workload, layout: Layout, rank: int) -> dict:
    """Predicted bytes of world rank `rank`: its stage's ledger (`mesh.coordinates`, tp fastest)."""
    return stage_ledger(w, layout, coordinates(rank, dp_size=layout.dp, tp_size=layout.tp)[0])


def heaviest_stage(w: Workload, layout: Layout) -> tuple[int, dict]:
    """(stage, ledger) of the stage with the largest peak. Stage 0 holds at least as much as any
    middle stage (most blocks, the embeddings, the most micro-batches in flight); the last stage
    can exceed it with a big vocabulary: both are computed."""
    stages = {0, layout.pp - 1}
    return max(((s, stage_ledger(w, layout, s)) for s in stages), key=lambda item: (item[1]["peak"], -item[0]))
