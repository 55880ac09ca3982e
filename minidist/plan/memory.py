"""Memory arithmetic: what training a model keeps in memory, measured and predicted.

Chapters 1 and 8. The one idea: **training memory is four piles** — parameters, gradients,
optimizer states (Adam's two moments) and activations (what the forward pass keeps for the
backward) — and each pile is a simple formula in the model's size. The first three ("model
states") scale with the parameter count Ψ; activations scale with batch × sequence × width.

Three kinds of function live here, side by side, so a learner can check one against another:

- measured from a live model: `param_bytes`, `grad_bytes`, `optimizer_bytes`, `ledger`;
- predicted for *this* implementation: `param_count(config)`, `activation_bytes(config, ...)`
  (tests check both against the real GPT to the byte);
- predicted per rank under tensor parallelism (chapter 6): `tensor_parallel_parameter_counts`,
  `sequence_parallel_activation_bytes` (tests check them against every rank's ledger);
- the textbook estimates for any size: `model_state_bytes(Ψ, dp, zero)` (the ZeRO paper's
  2 + 2 + 12 bytes per parameter, divided among data-parallel ranks by stage) and
  `megatron_activation_bytes` (the Megatron-LM paper's per-layer formula).

    python -m minidist.plan.memory --params 7.5B --dp 64 --zero 3          # 1.88 GB per device
    python -m minidist.plan.memory --params 175e9 --json

Sizes are in decimal units (1 GB = 1e9 bytes), as in the ZeRO paper.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys

import numpy as np

from minidist import cli

# ----------------------------------------------------------------------------- measured


def param_bytes(model) -> int:
    """Bytes of every parameter array of a live model (a tied weight counts once)."""
    return sum(p.data.nbytes for p in model.parameters())


def grad_bytes(model) -> int:
    """Bytes of the gradients that exist right now (None before the first backward, after zero_grad)."""
    return sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)


def _array_bytes(obj) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_array_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_array_bytes(v) for v in obj)
    return 0  # step counters and hyper-parameters are a few bytes: not memory worth counting


def optimizer_bytes(optimizer) -> int:
    """Bytes of all arrays in the optimizer's state (Adam: exp_avg and exp_avg_sq per parameter).
    Read in place (`state_dict()` would copy them all: a trace reads the ledger every step)."""
    state = getattr(optimizer, "state", None)
    return _array_bytes(state if isinstance(state, list) else optimizer.state_dict()["state"])


def ledger(model, optimizer=None, activation_bytes: int = 0) -> dict:
    """The four piles of training memory in bytes, and `peak`, their sum.

    Measure `activation_bytes` with `minidist.core.tensor.graph_bytes(loss)` right after the forward
    pass: that is when the autograd graph is largest (backward frees it as it goes). `peak` adds
    the four piles as if all were alive at once — the usual, slightly pessimistic, way to count:
    in one step the gradients grow during backward while the graph shrinks, but with gradient
    accumulation (chapter 3) the previous micro-batch's gradients do coexist with the full graph.
    Gradients count only if they exist now: measure after `backward()` to see them.
    """
    piles = {
        "params": param_bytes(model),
        "grads": grad_bytes(model),
        "optimizer": optimizer_bytes(optimizer) if optimizer is not None else 0,
        "activations": int(activation_bytes),
    }
    piles["peak"] = sum(piles.values())
    return with_masters_apart(piles, master_bytes(optimizer) if optimizer is not None else 0)


def master_bytes(optimizer) -> int:
    """Bytes of the fp32 master weights a 16-bit optimizer keeps in its state (chapter 10)."""
    return sum(state["master"].nbytes for state in optimizer.state if "master" in state)


def with_masters_apart(piles: dict, masters: int) -> dict:
    """With 16-bit training, the `optimizer` pile shown in its two parts as well: `master_weights`
    (4 bytes per parameter) and Adam's `moments` (8): 2 + 2 + 4 + 8 = the ZeRO paper's 2 + 2 + 12."""
    if masters:
        piles["master_weights"], piles["moments"] = masters, piles["optimizer"] - masters
    return piles


# ----------------------------------------------------------------------------- this GPT, predicted


def param_count(config) -> int:
    """Parameters of minidist's GPT for a GPTConfig.

    Per block: q, k, v, c_proj are h×h weights + h biases (4h² + 4h); the MLP is h×4h + 4h and
    4h×h + h (8h² + 5h); two LayerNorms 2h each (4h). Total 12h² + 13h per layer. Around the blocks:
    token and position embeddings V·h + T·h, the final LayerNorm 2h, and an untied LM head V·h.
    """
    V, T, L, h = config.vocab_size, config.block_size, config.n_layer, config.n_embd
    head = 0 if config.tie_weights else V * h
    return V * h + T * h + L * (12 * h * h + 13 * h) + 2 * h + head


def moe_param_count(config) -> int:
    """Parameters of the MoE GPT: the dense GPT's, with each block's MLP (8h² + 5h) counted E
    times, plus the router's h x E weight."""
    h, E = config.n_embd, config.num_experts
    return param_count(config) + config.n_layer * ((E - 1) * (8 * h * h + 5 * h) + h * E)


def layer_activation_elements(batch: int, seq: int, hidden: int, heads: int, dropout: bool = False) -> int:
    """Array elements one transformer block of minidist keeps for backward: 25bsh + 2bs + abs².

    Walking `Block.forward` with N = b·s tokens (see fused.py for what each op saves):
      ln_1        xhat (Nh), rstd (N), output (Nh)                     2Nh + N
      q, k, v     three linear outputs (heads are views of them)       3Nh
      attention   softmax weights (a·b·s²) and the output (Nh)         Nh + a·b·s²
      merge heads permute+reshape must copy (non-contiguous)           Nh
      c_proj      output; residual add output                          2Nh
      ln_2                                                             2Nh + N
      c_fc        output (4Nh); GELU saves tanh (4Nh) + output (4Nh)   12Nh
      c_proj      output; residual add output                          2Nh
    Each linear also saves its input, but that is the previous op's output, counted once.
    With dropout > 0, each of the two residual dropouts keeps a mask and an output (4Nh) and
    attention keeps its dropout mask (a·b·s²).
    """
    n = batch * seq
    elements = 25 * n * hidden + 2 * n + heads * batch * seq * seq
    if dropout:
        elements += 4 * n * hidden + heads * batch * seq * seq
    return elements


def activation_bytes(config, batch: int, seq: int | None = None, bytes_per_element: int = 4) -> dict:
    """Activation bytes of minidist's GPT at the end of forward (what `graph_bytes(loss)` measures).

    Returns {"per_layer", "layers", "outside", "total"}. Outside the blocks: token + position
    embeddings and their sum (2Nh + s·h), embedding dropout (2Nh if dropout), ln_f (2Nh + N), the
    logits and the softmax probabilities cross-entropy saves (2NV), and the loss itself (1).
    """
    seq = config.block_size if seq is None else seq
    if seq > config.block_size:
        raise ValueError(f"sequence length {seq} is longer than block_size {config.block_size}")
    n, h, V = batch * seq, config.n_embd, config.vocab_size
    dropout = config.dropout > 0
    per_layer = layer_activation_elements(batch, seq, h, config.n_head, dropout) * bytes_per_element
    outside = (4 * n * h + seq * h + n + 2 * n * V + 1 + (2 * n * h if dropout else 0)) * bytes_per_element
    layers = config.n_layer * per_layer
    return {"per_layer": per_layer, "layers": layers, "outside": outside, "total": layers + outside}


def megatron_activation_bytes(batch: int, seq: int, hidden: int, heads: int) -> float:
    """Megatron-LM's estimate per transformer layer, fp16 with dropout: s·b·h·(34 + 5·a·s/h) bytes.

    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models".)
    It counts 2-byte activations and 1-byte dropout masks; minidist keeps 4-byte float32 arrays,
    no fused residual+dropout, and GELU's tanh, so its own count above differs in the constant.
    """
    return seq * batch * hidden * (34 + 5 * heads * seq / hidden)


# ----------------------------------------------------------------------------- tensor parallelism, per rank


def tensor_parallel_parameter_counts(config, tp: int) -> dict:
    """How many parameters are split over the tp ranks and how many every rank replicates
    (chapter 6, `parallel/tensor_parallel.py`).

    Split, per block: q, k, v, c_proj weights (4C²) and q, k, v biases (3C); c_fc (4C² + 4C)
    and the MLP's c_proj weight (4C²): 12C² + 7C. Plus wte (VC) and an untied head (VC).
    Replicated, per block: two LayerNorms (4C) and the two row-parallel biases (2C): 6C.
    Plus wpe (T·C) and ln_f (2C). A rank holds split / tp + replicated."""
    V, T, L, C = config.vocab_size, config.block_size, config.n_layer, config.n_embd
    split = L * (12 * C * C + 7 * C) + V * C * (1 if config.tie_weights else 2)
    replicated = L * 6 * C + T * C + 2 * C
    return {"split": split, "replicated": replicated, "per_rank": split // tp + replicated}


def sequence_parallel_activation_bytes(config, batch: int, tp: int, itemsize: int = 4,
                                       seq: int | None = None) -> dict:
    """Activation bytes per rank that sequence parallelism divides by t, and those it adds
    (chapter 6, section 8, `parallel/sequence.py`).

    "region": what plain tensor parallelism keeps whole (B·T·C) on every rank, counted from the
    autograd graph of `TensorParallelGPT` (graph_bytes). Per block: ln_1 and ln_2 (output and
    the normalised input each saves, 4), the two reduced outputs of g (2), the two bias adds (2),
    the two residual adds (2): 10 B·T·C, plus each LayerNorm's 1/std (2 B·T); with dropout, each
    of the two dropouts' mask and output (4 B·T·C). Outside the blocks: the embedding's g and the
    add of wpe (2 B·T·C), the T·C position rows, ln_f (2 B·T·C + B·T), with dropout the
    embedding dropout (2 B·T·C). Sequence parallelism keeps 1/t of all of it.

    "gathered": what it adds. Each column-parallel layer keeps its all-gathered input (B·T·C)
    for its backward: 2 per block and the head's. (Megatron-LM keeps the T/t shard instead and
    all-gathers it again in backward: one more all-gather per layer, overlapped with compute.)

    saved = region · (1 - 1/t) - gathered."""
    seq = config.block_size if seq is None else seq
    btc, bt = batch * seq * config.n_embd, batch * seq
    drop = config.dropout > 0
    per_block = 10 * btc + 2 * bt + (4 * btc if drop else 0)
    outside = 4 * btc + seq * config.n_embd + bt + (2 * btc if drop else 0)
    region = (config.n_layer * per_block + outside) * itemsize
    gathered = (2 * config.n_layer + 1) * btc * itemsize if tp > 1 else 0
    return {"region": region, "gathered": gathered, "saved": region - region // tp - gathered}


# ----------------------------------------------------------------------------- model states, any size

# bytes per parameter for (params, grads, optimizer states) with Adam
PRECISIONS = {
    "fp32": (4, 4, 8),    # fp32 weights and grads, Adam's m and v in fp32
    "mixed": (2, 2, 12),  # fp16 weights and grads; fp32 master copy + m + v (K = 12 in the ZeRO paper)
    "bf16": (2, 2, 12),   # the demo's --precision names: either 16-bit format, the same bytes
    "fp16": (2, 2, 12),   # (minidist/precision/mixed_precision.py measures them)
}


def model_state_bytes(num_params: float, dp: int = 1, zero: int = 0, precision: str = "mixed") -> dict:
    """Per-device bytes of params, grads and optimizer states under ZeRO stage `zero` on `dp` ranks.

    Stage 0 (plain data parallelism) replicates everything; stage 1 partitions the optimizer
    states, stage 2 also the gradients, stage 3 also the parameters — each partitioned pile is
    divided by dp. With mixed precision (2 + 2 + K, K = 12):
      stage 0: 16Ψ   stage 1: 4Ψ + 12Ψ/N   stage 2: 2Ψ + 14Ψ/N   stage 3: 16Ψ/N
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if not num_params > 0:
        raise ValueError(f"number of parameters must be positive, got {num_params}")
    if not (isinstance(dp, (int, np.integer)) and dp >= 1):
        raise ValueError(f"data-parallel degree must be an integer >= 1, got {dp!r}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    p, g, k = PRECISIONS[precision]
    piles = {
        "params": p * num_params / (dp if zero >= 3 else 1),
        "grads": g * num_params / (dp if zero >= 2 else 1),
        "optimizer": k * num_params / (dp if zero >= 1 else 1),
    }
    piles["total"] = sum(piles.values())
    return piles


_SUFFIXES = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str) -> int:
    """'7.5B', '175e9', '350M', '1.3b', '125000' -> an integer number of parameters."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    if not match:
        raise ValueError(f"cannot read a parameter count from {text!r}: use a number like 7.5e9 or 7.5B "
                         "(suffixes K, M, B, T)")
    value = float(match.group(1)) * _SUFFIXES[match.group(2).upper()]
    if value < 1:
        raise ValueError(f"parameter count {text!r} is {value:g}: it must be at least 1")
    return int(round(value))


def format_bytes(n: float) -> str:
    """Bytes with a decimal unit: 1.88 GB, 31.4 GB, 120 GB, 812 KB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n:.0f} B"


# ----------------------------------------------------------------------------- command line


MAX_PARAMS = 10**15  # a thousand times today's largest models: beyond it a count is a typo


def _count(text: str) -> int:
    """--params: a parameter count in 1..MAX_PARAMS, read by `parse_count`."""
    try:
        value = parse_count(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    except OverflowError:  # 1e400 reads as inf
        value = math.inf
    if value > MAX_PARAMS:
        raise argparse.ArgumentTypeError(f"parameter count {text!r} is more than {MAX_PARAMS:.0e}: "
                                         "use a number like 7.5e9 or 7.5B")
    return value


def _stage(text: str) -> int:
    """--zero: a ZeRO stage, 0 to 3."""
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"ZeRO stage must be 0, 1, 2 or 3, got {text}")
    return int(text)


def main(argv=None) -> int:
    parser = cli.OneLineParser(
        prog="python -m minidist.plan.memory",
        description="Per-device memory of model states (params, grads, Adam states) under ZeRO.")
    parser.add_argument("--params", type=_count, required=True, help="parameter count, e.g. 7.5e9 or 7.5B")
    parser.add_argument("--dp", type=cli.integer(1), default=1, help="data-parallel degree N (default 1)")
    parser.add_argument("--zero", type=_stage, default=0, help="ZeRO stage 0-3 (default 0)")
    parser.add_argument("--precision", default="mixed", choices=sorted(PRECISIONS),
                        help="mixed: 2+2+12 bytes/param (default); fp32: 4+4+8")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    num_params = args.params
    piles = model_state_bytes(num_params, args.dp, args.zero, args.precision)
    if args.json:
        print(json.dumps({
            "params": num_params, "dp": args.dp, "zero": args.zero, "precision": args.precision,
            "bytes_per_param": dict(zip(("params", "grads", "optimizer"), PRECISIONS[args.precision])),
            "bytes_per_device": piles["total"],
            "breakdown": {k: piles[k] for k in ("params", "grads", "optimizer")},
        }, indent=2))
        return 0
    p, g, k = PRECISIONS[args.precision]
    print(f"{num_params:,} parameters, {args.precision} precision Adam ({p}+{g}+{k} bytes/param), "
          f"data-parallel degree {args.dp}, ZeRO stage {args.zero}: per device")
    for name in ("params", "grads", "optimizer"):
        print(f"  {name:<10} {format_bytes(piles[name]):>10}")
    print(f"  {'total':<10} {format_bytes(piles['total']):>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
