"""`python -m minidist.plan`: every DP x TP x PP layout of a model on a cluster, ranked (chapter 9).

One idea: a layout — data-parallel replicas d, tensor-parallel ranks t, pipeline stages p, the
ZeRO stage, m micro-batches and the pipeline schedule — is a handful of integers, and its memory
and step time are formulas (`predict.py`). So write down *every* valid layout, predict each,
and sort: the rules of thumb of Megatron-LM (Narayanan et al. 2021, section 3.3) fall out of the
arithmetic instead of being memorised —

    keep t within a node (its all-reduces run 4 times per layer and micro-batch),
    let the pipeline cross nodes (one activation per micro-batch and boundary),
    make the model-parallel size t·p just large enough to fit, and use data parallelism for the rest.

    python -m minidist.plan --gpus 4                                    # the demo GPT on 4 ranks
    python -m minidist.plan --model gpt3-175b --gpus 1024 --memory 80 --top 5
    python -m minidist.plan --n-layer 24 --n-embd 2048 --n-head 16 --vocab-size 50257 --pad-vocab \\
        --seq-len 2048 --global-batch 512 --gpus 64 --precision mixed --json plan.json

The rules a layout must follow are the demo's own, `Layout.validate` (minidist/training/layout.py), as in
Megatron-LM/DeepSpeed, so every layout ranked here is one `python -m minidist.demo --layout NAME` runs:
N = d·t·p; t divides the heads, 4·n_embd and the vocabulary (or the vocabulary is padded to a
multiple of 128·t, as Megatron-LM does: --pad-vocab); p <= n_layer; d divides the global batch and
m the replica's batch; ZeRO needs d > 1, and stages 2-3 do not combine with p > 1 (gradients
must persist across micro-batches; DeepSpeed refuses it too); interleaved 1F1B needs m a
multiple of p and n_layer >= p·v. Layouts that do not fit in memory are ranked after those that
do and marked so; none is dropped.

GPT-3 175B on 1024 A100s of 80 GB, 8 to a node (mixed precision, no recomputation): the best
layout is dp32-tp8-pp4-zero1-m48, about 166 TFLOP/s per GPU — tp inside a node, the pipeline across
4 nodes, the rest data parallel, and t·p = 32 the smallest that fits (tests/test_plan.py). Each
prediction is checked against published runs: `python -m minidist.plan.against_published`.

    python -m minidist.plan --model gpt3-175b --gpus 1024 --explain dp16-tp8-pp8-zero1-m96
    python -m minidist.plan --model gpt3-175b --gpus 1024 --layout dp4-tp8-pp32-m384
    python -m minidist.plan --list-devices
"""
from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import asdict

from tqdm import tqdm

from minidist import cli
from minidist.plan.memory import format_bytes
from minidist.training.layout import Layout
from minidist.plan.hardware import PRESETS as PRESET_DEVICES, device_table, load_device
from minidist.plan.predict import STATE_BYTES, Cluster, Workload, bytes_per_param, predict
from minidist.plan.workload import TransformerShape, block_widths

SCHEDULES = ("gpipe", "1f1b", "interleaved")

# name: (GPTConfig fields, global batch, precision, pad_vocab)
PRESETS = {
    "demo": (dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128), 16, "fp32", False),
    "gpt2": (dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768), 512, "mixed", True),
    # GPT-3 175B (Brown et al. 2020); V = 51200 is GPT-2's 50257 as Megatron-LM pads it for t <= 8
    "gpt3-175b": (dict(vocab_size=51200, block_size=2048, n_layer=96, n_head=96, n_embd=12288), 1536, "mixed", False),
    # Llama 3 405B (Llama Team 2024, Table 3): grouped-query attention, SwiGLU, untied; 16M tokens a step
    "llama3-405b": (dict(vocab_size=128000, block_size=8192, n_layer=126, n_head=128, n_embd=16384, n_kv_head=8,
                         ffn_hidden=53248, gated_mlp=True, tie_weights=False), 2048, "mixed", False),
}


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> list[int]:
    """The divisors of n, in order: pairs (k, n/k) up to √n, so 10¹² takes a million steps, not 10¹²."""
    small, large, k = [], [], 1
    while k * k <= n:
        if n % k == 0:
            small.append(k)
            if k * k != n:
                large.append(n // k)
        k += 1
    return small + large[::-1]


def factorisations(config, world: int, global_batch: int) -> list[tuple[int, int, int]]:
    """(d, t, p) with d·t·p = world that can be valid: t divides the heads (tensor parallelism splits
    them), p <= the layers, d divides the global batch. Bounded by the model, not by the world: a
    billion devices are answered at once."""
    shapes = []
    kv, _, _ = block_widths(config)  # grouped-query attention: t also divides the key/value heads
    for t in divisors(math.gcd(world, config.n_head, kv)):
        for p in range(1, min(config.n_layer, world // t) + 1):
            if (world // t) % p == 0 and global_batch % (world // (t * p)) == 0:
                shapes.append((world // (t * p), t, p))
    return shapes


def why_invalid(config, world: int, layout: Layout, global_batch: int, pad_vocab: bool = False) -> str | None:
    """Why `layout` cannot run `config` on `world` devices (one line), or None if it can: the demo's
    own rule, `Layout.why_invalid`, so every layout the planner ranks is one minidist runs; and with
    grouped-query attention t divides the key/value heads and the MLP's width (Megatron-LM's rule)."""
    why = layout.why_invalid(config, world, global_batch, pad_vocab)
    kv, ffn, _ = block_widths(config)
    if why is None and (kv % layout.tp or ffn % layout.tp):
        why = f"tp={layout.tp} does not divide the {kv} key/value heads and the MLP's width {ffn}"
    return why


def candidate_layouts(config, world: int, global_batch: int, zero_stages=(0, 1, 2, 3), schedules=SCHEDULES,
                      pad_vocab: bool = False) -> list[Layout]:
    """Every valid layout: each factorisation d·t·p = world, ZeRO stage, divisor m of the
    replica's batch, schedule and v (filtered by `why_invalid`)."""
    layouts = []
    for d, t, p in factorisations(config, world, global_batch):
        for zero in zero_stages:
            for m in divisors(global_batch // d):
                options = [(None, 1)] if p == 1 else \
                    [(s, 1) for s in schedules if s != "interleaved"] + \
                    [("interleaved", v) for v in range(2, config.n_layer // p + 1) if "interleaved" in schedules]
                for schedule, v in options:
                    layout = Layout(dp=d, tp=t, pp=p, zero=zero, microbatches=m, schedule=schedule,
                                    virtual_stages=v)
                    if why_invalid(config, world, layout, global_batch, pad_vocab) is None:
                        layouts.append(layout)
    return layouts


def plan(workload: Workload, cluster: Cluster, zero_stages=(0, 1, 2, 3), schedules=SCHEDULES,
         progress: bool = False, top: int = 10, within: float = 0.1, accept=None) -> list[dict]:
    """Every valid layout with its prediction, best first: those that fit by step time, then
    those that do not (also by step time), each with "fits" saying which. `accept(layout)`, if
    given, keeps only the layouts it returns True for (a framework's own rules, e.g.
    frameworks.megatron.why_megatron_refuses).

    Two passes keep it quick: every layout's pipeline is first estimated (`pipeline_estimate`),
    then the schedule is simulated for the `top` best and for every layout within `within` of the
    best estimate, the only ones that can finish first ("simulated" says which)."""
    layouts = candidate_layouts(workload.config, cluster.gpus, workload.global_batch, zero_stages, schedules,
                                workload.pad_vocab)
    if accept is not None:
        layouts = [layout for layout in layouts if accept(layout)]
    rows = [{"name": str(layout), "layout": asdict(layout), **predict(workload, layout, cluster, simulate=False)}
            for layout in layouts]
    rows.sort(key=lambda r: (not r["fits"], r["step_seconds"]))
    best = rows[0]["step_seconds"] if rows else 0.0
    closer = [i for i, r in enumerate(rows) if i < top or (r["fits"] and r["step_seconds"] <= best * (1 + within))]
    for i in tqdm(closer, desc="simulating", unit="layout", disable=not progress or len(closer) < 200,
                  file=sys.stderr, dynamic_ncols=True):
        rows[i] = {"name": rows[i]["name"], "layout": rows[i]["layout"],
                   **predict(workload, Layout(**rows[i]["layout"]), cluster)}
    rows.sort(key=lambda r: (not r["fits"], r["step_seconds"], r["memory"]["peak"]))
    for rank, row in enumerate(rows, 1):
        row["rank"] = rank
    return rows


def _time(seconds: float, unit: float) -> str:
    return f"{seconds / unit:.3g}"


def _unit(seconds: float) -> tuple[float, str]:
    """The unit a step time reads best in: s, ms or us."""
    return next(((u, n) for u, n in ((1.0, "s"), (1e-3, "ms")) if seconds >= u), (1e-6, "us"))


def format_table(rows: list[dict], top: int, cluster: Cluster) -> str:
    """The best `top` rows, and a line on the layouts that do not fit."""
    shown = rows[:top]
    fitting = sum(r["fits"] for r in rows)
    unit, name = _unit(shown[0]["step_seconds"] if shown else 1.0)
    lines = [f"{'#':>4}  {'layout':<36} {'b':>4} {'step ' + name:>9} {'compute':>8} {'bubble':>8} "
             f"{'tp':>8} {'pp':>8} {'dp':>8} {'TFLOP/s':>8} {'MFU':>5}  {'memory/device':>13}  fits"]
    for r in shown:
        t = [_time(r[k], unit) for k in ("step_seconds", "compute", "bubble", "tp", "pp", "dp")]
        fits = "yes" if r["fits"] else f"no (> {format_bytes(cluster.memory)})"
        lines.append(f"{r['rank']:>4}  {r['name']:<36} {r['micro_batch']:>4} {t[0]:>9} {t[1]:>8} {t[2]:>8} "
                     f"{t[3]:>8} {t[4]:>8} {t[5]:>8} {r['tflops_per_device']:>8.1f} {r['mfu']:>5.0%}  "
                     f"{format_bytes(r['memory']['peak']):>13}  {fits}")
    lines.append(f"(b: micro-batch; times in {name} on the busiest rank: the step = compute + bubble + the exposed "
                 f"tp, pp and dp communication + the optimizer; TFLOP/s per device as Narayanan et al. count them "
                 f"(with recomputation's forward), MFU the model's FLOPs over the peak, "
                 f"{cluster.flops / 1e12:.3g} TFLOP/s; memory: the heaviest stage's device)")
    misfits = [r for r in rows if not r["fits"]]
    if misfits:
        least = min(misfits, key=lambda r: r["memory"]["peak"])
        lines.append(f"{len(misfits)} of {len(rows)} layouts do not fit in {format_bytes(cluster.memory)} per device "
                     f"(the closest, {least['name']}, needs {format_bytes(least['memory']['peak'])}); "
                     f"{fitting} fit" + ("" if fitting else ": none fits"))
    return "\n".join(lines)


def build_parser():
    positive, real = cli.integer(1), cli.number(0, lo_open=True)
    p = cli.OneLineParser(prog="python -m minidist.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="demo",
                   help="a preset (demo: minidist's GPT; gpt2: 12 x 768; gpt3-175b: 96 x 12288, 96 heads; "
                        "llama3-405b: 126 x 16384, 128 heads, 8 key/value heads, SwiGLU); "
                        "the flags below override its fields")
    for flag in ("--n-layer", "--n-embd", "--n-head", "--vocab-size", "--seq-len"):
        p.add_argument(flag, type=positive)
    p.add_argument("--n-kv-head", type=positive,
                   help="key/value heads shared by the query heads (grouped-query attention; default: --n-head)")
    p.add_argument("--ffn-hidden", type=positive, help="the MLP's width (default: 4 x --n-embd)")
    p.add_argument("--gated-mlp", action="store_true", help="a gated MLP (SwiGLU: gate, up and down matrices)")
    p.add_argument("--untied", action="store_true", help="a separate LM head instead of the tied embedding")
    p.add_argument("--pad-vocab", action="store_true", default=None,
                   help="pad the vocabulary to a multiple of 128 x tp as Megatron-LM does (gpt2 preset: on)")
    p.add_argument("--gpus", type=positive, help="devices N")
    p.add_argument("--device", default="a100-80gb",
                   help=f"a preset ({', '.join(PRESET_DEVICES)}), this-machine (measured), or a JSON file: "
                        "the device's peak FLOP/s, memory and links (python -m minidist.plan --list-devices)")
    p.add_argument("--list-devices", action="store_true", help="print the device presets and exit")
    p.add_argument("--gpus-per-node", type=positive, help="(default: the device's)")
    p.add_argument("--memory", type=real, help="memory per device, GB (default: the device's)")
    p.add_argument("--intra-bw", type=real, help="bandwidth inside a node, GB/s per device (default: the device's)")
    p.add_argument("--intra-latency", type=cli.number(0), help="latency inside a node, us")
    p.add_argument("--inter-bw", type=real, help="bandwidth between nodes, GB/s per device (default: the device's)")
    p.add_argument("--inter-latency", type=cli.number(0), help="latency between nodes, us")
    p.add_argument("--rails", type=positive,
                   help="rings a collective across nodes runs side by side, one per NIC, each with its share of "
                        "the bytes (NCCL: up to the group's members on a node); default 1, which matches the "
                        "ZeRO-3 runs Narayanan et al. measured (chapter 9, the paper's trade-offs)")
    p.add_argument("--tflops", type=real, help="peak TFLOP/s of one device's matrix units in the run's precision "
                                               "(default: the device's data sheet); the achieved speed is predicted")
    p.add_argument("--layer-overhead", type=cli.number(0), default=0.0,
                   help="fixed us per layer and micro-batch that no split shrinks (Python's cost, in minidist)")
    p.add_argument("--cores", type=cli.number(0.001),
                   help="CPU cores the ranks share, when they outnumber them (4 ranks on a 2-core laptop): the "
                        "ranks computing at a moment share them, the waiting ones take none (default: a device each)")
    p.add_argument("--overhead-cores", type=cli.number(0.001),
                   help="with --cores: the cores the Python-bound fixed costs (--layer-overhead) share, while the "
                        "array work shares --cores (bench plan measures both; default: --cores for both)")
    p.add_argument("--layout", metavar="NAME", help="predict this one layout (e.g. dp4-tp8-pp12-m96) and its rank")
    p.add_argument("--explain", metavar="NAME", help="this layout's breakdown, and why it lost to the best")
    p.add_argument("--global-batch", type=positive, help="sequences per step (default: the preset's)")
    p.add_argument("--precision", choices=sorted(STATE_BYTES),
                   help="fp32: 4+4+8 bytes per parameter (as minidist runs); mixed: 2+2+12 (default: the preset's)")
    p.add_argument("--state-bytes", type=cli.listof(cli.number(0, lo_open=True)), metavar="P,G,K",
                   help="bytes per parameter of the parameters, gradients and optimizer as a framework keeps them, "
                        "e.g. 2,2,16 for Megatron-LM's fp16 optimizer (default: the precision's)")
    p.add_argument("--activations", choices=["minidist", "megatron"],
                   help="activation count: minidist's own, or Korthikanti et al. 2022 (default: minidist for "
                        "fp32/fp64, megatron for mixed)")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation (Megatron-LM 2021)")
    p.add_argument("--selective-recompute", action="store_true",
                   help="recompute only the attention core (Korthikanti et al. 2022; Megatron-LM's default since)")
    p.add_argument("--sequence-parallel", action="store_true", help="split the replicated activations by tp")
    p.add_argument("--flash-attention", action="store_true",
                   help="attention that never stores its s x s scores (Dao et al. 2022; every run since 2023)")
    p.add_argument("--scatter-gather", action="store_true",
                   help="send each pipeline message in tp pieces, gathered inside the receiving node (Megatron-LM)")
    p.add_argument("--no-dropout", action="store_true",
                   help="the blocks have no dropout (Llama): no dropout masks among the stored activations")
    p.add_argument("--ends-as-layers", action="store_true",
                   help="cut the pipeline counting the embedding and the head as a layer each (Llama 3)")
    p.add_argument("--no-overlap", action="store_true", help="count all data-parallel communication as exposed")
    p.add_argument("--zero", type=cli.listof(cli.integer(0, 3)), default=[0, 1, 2, 3], help="ZeRO stages to try")
    p.add_argument("--schedules", type=cli.listof(cli.one_of(SCHEDULES)), default=list(SCHEDULES))
    p.add_argument("--top", type=positive, default=10, help="rows to print")
    p.add_argument("--json", type=cli.output_file, metavar="PATH", help="write every layout's prediction")
    return p


def setup(args) -> tuple[Workload, Cluster]:
    """The workload and cluster the flags describe; ValueError names what is wrong."""
    fields, batch, precision, pad = PRESETS[args.model]
    fields = dict(fields)
    if args.untied:
        fields["tie_weights"] = False
    if args.gated_mlp:
        fields["gated_mlp"] = True
    for name, key in (("n_layer", "n_layer"), ("n_embd", "n_embd"), ("n_head", "n_head"), ("n_kv_head", "n_kv_head"),
                      ("ffn_hidden", "ffn_hidden"), ("vocab_size", "vocab_size"), ("seq_len", "block_size")):
        if getattr(args, name) is not None:
            fields[key] = getattr(args, name)
    if fields["n_embd"] % fields["n_head"]:
        raise ValueError(f"--n-embd {fields['n_embd']} is not divisible by --n-head {fields['n_head']}")
    if fields.get("n_kv_head") and fields["n_head"] % fields["n_kv_head"]:
        raise ValueError(f"--n-kv-head {fields['n_kv_head']} does not divide --n-head {fields['n_head']}")
    config = TransformerShape(**fields)  # GPT's own block unless the flags give it grouped-query attention or a gate
    if args.recompute and args.selective_recompute:
        raise ValueError("--recompute recomputes every layer's forward, --selective-recompute only the attention "
                         "core: choose one")
    if args.state_bytes is not None and len(args.state_bytes) != 3:
        raise ValueError(f"--state-bytes needs three numbers (parameters, gradients, optimizer), "
                         f"got {len(args.state_bytes)}")
    precision = args.precision or precision
    activations = args.activations or ("megatron" if precision == "mixed" else "minidist")
    workload = Workload(config, args.global_batch or batch, config.block_size, precision, activations,
                        args.recompute, args.sequence_parallel, not args.no_overlap,
                        pad if args.pad_vocab is None else args.pad_vocab,
                        state_bytes=tuple(args.state_bytes) if args.state_bytes else None,
                        flash_attention=args.flash_attention, scatter_gather=args.scatter_gather,
                        dropout=not args.no_dropout, ends_as_layers=args.ends_as_layers,
                        selective=args.selective_recompute)
    device = load_device(args.device)
    changes = {field: getattr(args, flag) * scale for flag, field, scale in (
        ("gpus_per_node", "gpus_per_node", 1), ("memory", "memory", 1e9), ("intra_bw", "intra_bandwidth", 1e9),
        ("intra_latency", "intra_latency", 1e-6), ("inter_bw", "inter_bandwidth", 1e9),
        ("inter_latency", "inter_latency", 1e-6), ("tflops", "flops", 1e12), ("cores", "cores", 1),
        ("overhead_cores", "overhead_cores", 1), ("rails", "rails", 1))
        if getattr(args, flag) is not None}
    cluster = Cluster.of(device, args.gpus, precision, layer_overhead=args.layer_overhead * 1e-6, **changes)
    return workload, cluster


def no_layout_reason(workload: Workload, world: int, zero_stages, schedules) -> str:
    """Why no layout is valid: the verdict on each factorisation d·t·p that can be (m = 1, the first
    ZeRO stage and schedule asked for), or what rules them all out."""
    c, reasons = workload.config, []
    for d, t, p in factorisations(c, world, workload.global_batch):
        layout = Layout(dp=d, tp=t, pp=p, zero=min(zero_stages), schedule=None if p == 1 else schedules[0],
                        virtual_stages=2 if p > 1 and schedules[0] == "interleaved" else 1)
        reasons.append(why_invalid(c, world, layout, workload.global_batch, workload.pad_vocab))
    if not reasons:
        most = c.n_head * c.n_layer * workload.global_batch
        return (f"d·t·p = {world} needs t dividing the {c.n_head} heads, p <= {c.n_layer} layers and d dividing the "
                f"global batch {workload.global_batch}: no such d, t, p (at most {most} devices can share this "
                "model and batch)")
    return "; ".join(dict.fromkeys(r for r in reasons if r)) or "none of the micro-batch counts fits"


def explain(rows: list[dict], name: str, cluster: Cluster) -> str:
    """One layout's breakdown beside the best's, and where the difference lies."""
    by_name = {r["name"]: r for r in rows}
    if name not in by_name:
        raise ValueError(f"--explain {name}: not a valid layout of this model on {cluster.gpus} devices "
                         f"(python -m minidist.plan --layout {name} says why)")
    mine, best = by_name[name], rows[0]
    keys = ("compute", "tp", "pp", "bubble", "dp", "optimizer",
            *(("gradients",) if mine["gradients"] or best["gradients"] else ()),
            *(("sharing",) if mine["sharing"] or best["sharing"] else ()), "step_seconds")
    unit, u = _unit(best["step_seconds"])
    lines = [f"{'':<12}{name:>24}{best['name'] + ' (best)':>32}"]
    for key in keys:
        lines.append(f"{key:<12}{_time(mine[key], unit) + ' ' + u:>24}{_time(best[key], unit) + ' ' + u:>32}")
    if mine["shared_cores_seconds"] is not None:  # the ranks share fewer cores: the step before its end's wait
        shared = [_time(r["shared_cores_seconds"], unit) + " " + u for r in (mine, best)]
        lines.append(f"{'shared cores':<12}{shared[0]:>24}{shared[1]:>32}")
    lines.append(f"{'TFLOP/s':<12}{mine['tflops_per_device']:>24.1f}{best['tflops_per_device']:>32.1f}")
    lines.append(f"{'memory':<12}{format_bytes(mine['memory']['peak']):>24}{format_bytes(best['memory']['peak']):>32}")
    if mine is best:
        lines.append(f"{name} is the best layout.")
        return "\n".join(lines)
    if not mine["fits"]:
        lines.append(f"{name} does not fit: it needs {format_bytes(mine['memory']['peak'])} of "
                     f"{format_bytes(cluster.memory)} per device.")
    worse = sorted(((mine[k] - best[k], k) for k in keys[:-1]), reverse=True)
    slower = mine["step_seconds"] / best["step_seconds"] - 1
    lines.append(f"{name} is rank {mine['rank']}, {slower:.1%} slower than {best['name']}: mostly "
                 + ", ".join(f"{k} (+{_time(diff, unit)} {u})" for diff, k in worse[:2] if diff > 0))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_devices:
        print(device_table())
        return 0
    if args.gpus is None:
        parser.error("--gpus N is required (the devices to plan for)")
    if args.overhead_cores is not None and args.cores is None:
        parser.error("--overhead-cores needs --cores (the cores the rest of the work shares)")
    try:
        workload, cluster = setup(args)
        asked = [Layout.parse(name) for name in (args.layout, args.explain) if name]
        for layout in asked:
            reason = why_invalid(workload.config, cluster.gpus, layout, workload.global_batch, workload.pad_vocab)
            if reason:
                raise ValueError(f"layout {layout}: {reason}")
    except ValueError as error:
        parser.error(str(error))
    zero_stages, schedules = tuple(dict.fromkeys(args.zero)), tuple(dict.fromkeys(args.schedules))
    for layout in asked:  # the asked layout is ranked among the rest, whatever --zero and --schedules say
        zero_stages = tuple(dict.fromkeys(zero_stages + (layout.zero,)))
        schedules = tuple(dict.fromkeys(schedules + ((layout.schedule,) if layout.schedule else ())))
    rows = plan(workload, cluster, zero_stages, schedules, progress=True, top=args.top)
    for layout in asked:  # simulated, whatever its estimate
        i = next(i for i, r in enumerate(rows) if r["name"] == str(layout))
        rows[i] = {**rows[i], **predict(workload, layout, cluster)}
    if not rows:
        why = no_layout_reason(workload, cluster.gpus, zero_stages, schedules)
        parser.error(f"--gpus {cluster.gpus}: no valid layout of {cluster.gpus} devices: {why}")
    c = workload.config
    nodes = -(-cluster.gpus // cluster.gpus_per_node)
    how = "".join(f", {word}" for word, on in (("recompute", workload.recompute),
                                                ("selective recompute", workload.selective),
                                                ("sequence parallel", workload.sequence_parallel),
                                                ("FlashAttention", workload.flash_attention),
                                                ("scatter/gather", workload.scatter_gather),
                                                ("no dropout", not workload.dropout),
                                                ("embedding and head cut as layers", workload.ends_as_layers)) if on)
    kv, ffn, inputs = block_widths(c)
    shape = (f", {kv} key/value heads" if kv != c.n_head else "") + (f", MLP {ffn}" if ffn != 4 * c.n_embd else "") + \
        (" gated" if inputs == 2 else "")
    print(f"GPT {c.n_layer} x {c.n_embd} ({c.n_head} heads{shape}, vocab {c.vocab_size}, seq {workload.seq}), "
          f"global batch {workload.global_batch}, {workload.precision} "
          f"({'+'.join(f'{b:g}' for b in bytes_per_param(workload))} bytes per parameter), "
          f"activations: {workload.activations}{how}; "
          f"{cluster.gpus} devices ({nodes} node{'s' * (nodes > 1)} of {cluster.gpus_per_node}, "
          f"{format_bytes(cluster.memory)} each"
          + (f", sharing {cluster.cores:g} cores" if cluster.cores and cluster.cores < cluster.gpus else "")
          + (f" ({cluster.overhead_cores:g} for the fixed costs)" if cluster.overhead_cores and cluster.cores
             and cluster.cores < cluster.gpus else "")
          + f"): {len(rows)} valid layout{'s' * (len(rows) != 1)}")
    if args.layout:
        row = next(r for r in rows if r["name"] == str(Layout.parse(args.layout)))
        print(format_table([row], 1, cluster))
        print(f"{row['name']}: rank {row['rank']} of {len(rows)}; the best, {rows[0]['name']}, takes "
              f"{rows[0]['step_seconds'] / row['step_seconds']:.1%} of its time")
    elif args.explain:
        print(explain(rows, str(Layout.parse(args.explain)), cluster))
    else:
        print(format_table(rows, args.top, cluster))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": c.to_dict(), "workload": {k: v for k, v in asdict(workload).items() if k != "config"},
                       "cluster": asdict(cluster), "layouts": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
