"""`python -m minidist.demo`: train the small GPT and watch it learn.

    python -m minidist.demo                           # serial, on the built-in sorting task
    python -m minidist.demo --data input.txt          # byte-level language model of any file
    mpirun -n 4 python -m minidist.demo               # the tour: every strategy vs serial
    mpirun -n 4 python -m minidist.demo --dp 4        # one strategy: --dp N [--zero S | --balance],
                                                      # --tp N, --pp N --microbatches M
                                                      # [--schedule interleaved --virtual-stages V]
    mpirun -n 4 python -m minidist.demo --dp 2 --tp 2 # composed: any two or three of --dp --tp --pp
    mpirun -n 8 python -m minidist.demo --dp 2 --tp 2 --pp 2 --zero 1   # (their product = ranks)
    mpirun -n 4 python -m minidist.demo --cp 4        # context parallel: each sequence over 4 ranks
    mpirun -n 4 python -m minidist.demo --cp 2 --dp 2 # [--cp-algorithm ulysses] [--cp-split contiguous]
    mpirun -n 4 python -m minidist.demo --layout dp2-tp2-zero1-m2   # any layout by its name (layout.py)

The flags and the `--json` keys are a contract (notebooks and checks read them): later
chapters add flags and keys, none is renamed or dropped.

JSON keys: world_size, layout {dp, tp, pp, zero}, layout_name (`str(Layout)`, e.g. "dp2-tp2-m4";
"tour" for the tour), dtype, config, losses (global mean loss of
every step), accuracies, tokens_per_s (median over steps after the first), step_seconds,
parameters, memory (one entry per rank: bytes of params, grads, optimizer, activations, peak),
comm (one entry per rank: bytes_sent, bytes_received, messages, ...); for pipelines
`pipeline` (schedule, microbatches, virtual_stages, bubble_measured, bubble_theory,
peak_activations); with --balance `rows_per_rank` (the split of every step); for the
tour `tour` (one row per strategy); `algorithm` (the --algorithm asked for) and
`all_reduce_algorithms` (those that really ran, e.g. ["shared_memory"] for "auto" on one
machine; also in every tour row), `kernels` (fast or plain), `first_step` (0, or the step a
--checkpoint run resumed from: then losses, accuracies and step_seconds cover the steps this run
trained, first_step to steps - 1); `traffic_by_group` (one entry per rank: the bytes it sent
per step in each of its mesh's groups, "dp", "tp", "pp", "embedding"; empty for one-strategy
layouts) and, for composed layouts, `mesh` (shape {pp, dp, tp}, order, and every rank's
coordinates and groups); with --cp `context_parallel` (cp, dp, algorithm, split, this rank's
token positions, every rank's visible attention scores, the bytes a rank sends per step in its
cp group, and what rank 0's attention computed), and layout gains "cp".

    python -m minidist.demo --dp 2 ... --checkpoint ckpt --checkpoint-every 50
                                      # saves ckpt/step-000050/ ...; the same command again resumes
                                      # from the newest complete checkpoint (minidist/checkpoint.py),
                                      # with this layout or any other (resharded: minidist/reshard.py)

Under `mpirun -n N` with no layout flags the demo runs the tour: the serial reference on rank 0
(the others wait politely, without spinning), then every strategy in `minidist/strategies.py`
that this world and model allow, and one table comparing their losses and weights with serial.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from minidist import checkpoint, cli, comm as dist, frameworks, strategies
from minidist.core.data import make_task
from minidist.comm import all_reduce_algorithm, faults, traffic
from minidist.comm.collectives import ALL_REDUCE
from minidist.core.kernels import kernels
from minidist.layout import LAYOUT_FLAGS, Layout, strategy
from minidist.core.model import GPTConfig
from minidist.moe import MoEConfig
from minidist.core.recompute import check_recompute
from minidist.parallel import checkpointing
from minidist.runtime import limit_threads_per_rank, tune_malloc
from minidist.core.tensor import set_default_dtype


def data_source(text: str) -> str:
    """--data: a built-in task ('sort', 'sort:LENGTH[:DIGITS]') or a regular file (not a device:
    /dev/zero never ends); whether the file is long enough is checked with --block-size."""
    if text == "sort" or text.startswith("sort:") or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(f"{text}: not a regular file" if os.path.exists(text) else
                                     f"no task or file named {text!r} (built-in tasks: 'sort')")


def build_parser() -> argparse.ArgumentParser:
    positive = cli.integer(1)
    p = cli.OneLineParser(prog="python -m minidist.demo", description=__doc__.split("\n\n")[0],
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=positive, default=None, help="training steps (default 300; 20 per strategy in the tour)")
    p.add_argument("--batch-size", type=positive, default=16, help="global batch size (sequences per step)")
    p.add_argument("--lr", type=cli.number(0, lo_open=True), default=3e-3, help="peak learning rate (warm-up then cosine)")
    p.add_argument("--seed", type=cli.integer(0, 2**32 - 1), default=0, help="seed of the weights and the batches")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--n-layer", type=positive, default=4)
    p.add_argument("--n-head", type=positive, default=4)
    p.add_argument("--n-embd", type=positive, default=128)
    p.add_argument("--block-size", type=positive, default=64)
    p.add_argument("--dropout", type=cli.number(0, 1, hi_open=True), default=0.0)
    p.add_argument("--untied", action="store_true", help="separate LM head instead of tying it to the embedding")
    p.add_argument("--data", type=data_source, default="sort", help="'sort' (built-in task) or a path to any text file")
    p.add_argument("--log-every", type=cli.integer(-1), default=0, help="steps between log lines (0: about 10 lines; -1: none)")
    p.add_argument("--layout", metavar="NAME",
                   help="the whole layout by its name, e.g. dp2-tp2-zero1-m4 (minidist/layout.py), instead of "
                        "--dp/--tp/--pp/--zero/--microbatches/... flags")
    p.add_argument("--dp", type=positive, help="data-parallel degree (chapter 3); dp x tp x pp = the number of ranks")
    p.add_argument("--tp", type=positive, help="tensor-parallel degree (chapter 6); combines with --dp and --pp (chapter 9)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: LayerNorms, residual adds and dropouts on T/t tokens (chapter 6, section 8)")
    p.add_argument("--cp", type=positive,
                   help="context-parallel degree (chapter 11): each sequence split over N ranks; combines with --dp")
    p.add_argument("--cp-algorithm", choices=["ring", "ulysses"], default="ring",
                   help="with --cp: ring attention, or DeepSpeed-Ulysses' all-to-all to heads")
    p.add_argument("--cp-split", choices=["zigzag", "contiguous"], default="zigzag",
                   help="with --cp: the tokens each rank holds (zigzag balances the causal mask)")
    p.add_argument("--pp", type=positive, help="pipeline stages (chapters 4-5); combines with --dp and --tp (chapter 9)")
    p.add_argument("--microbatches", type=positive, default=4, help="pipeline micro-batches (1: naive model parallelism)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b", help="pipeline schedule")
    p.add_argument("--virtual-stages", type=positive, default=2,
                   help="model chunks per rank of --schedule interleaved (the model is cut into pp x V chunks)")
    p.add_argument("--zero", type=int, choices=[1, 2, 3], help="ZeRO stage over the --dp replicas (chapter 8)")
    p.add_argument("--accumulation", type=positive, default=1, help="gradient-accumulation micro-steps per optimizer step")
    p.add_argument("--bucket-kb", type=positive, default=1024, help="data-parallel gradient bucket size (KiB)")
    p.add_argument("--naive-dp", action="store_true", help="one blocking all-reduce per parameter after backward")
    p.add_argument("--experts", type=cli.integer(2), help="mixture of experts (chapter 11): E expert MLPs per block")
    p.add_argument("--top-k", type=int, choices=[1, 2], default=1, help="with --experts: experts per token")
    p.add_argument("--capacity-factor", type=cli.number(0, lo_open=True), default=1.25,
                   help="with --experts: each expert takes ceil(k x tokens / E x C) tokens; the rest are dropped")
    p.add_argument("--ep", type=positive,
                   help="with --experts and --dp: experts split over groups of ep ranks (expert parallelism)")
    p.add_argument("--balance", action="store_true",
                   help="data parallelism: re-split the batch every step by each rank's speed (chapter 3, section 7)")
    p.add_argument("--algorithm", choices=["auto", *ALL_REDUCE], default="auto",
                   help="all-reduce algorithm of every strategy (chapter 7); auto: shared memory on one machine")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="compute in 16 bits with fp32 master weights (chapter 10); fp16 with a dynamic loss scale")
    p.add_argument("--fp32-grads", action="store_true",
                   help="with --precision bf16|fp16 and --dp: keep and all-reduce the gradients in fp32 (chapter 10)")
    p.add_argument("--initial-loss-scale", type=cli.number(0, lo_open=True), default=2.0**16,
                   help="with --precision fp16: the dynamic loss scale's start (default 65536)")
    p.add_argument("--loss-scale-window", type=positive, default=2000,
                   help="with --precision fp16: clean steps before the loss scale doubles (default 2000)")
    p.add_argument("--recompute", choices=["none", "full", "selective"], default="none",
                   help="activation checkpointing (chapter 11): rerun each block, or only attention's core, in backward")
    p.add_argument("--segments", type=positive, default=None,
                   help="with --recompute full: checkpoint this many runs of consecutive blocks (default one per block)")
    p.add_argument("--kernels", choices=["fast", "plain"], default="fast",
                   help="the operations' code path (chapter 1): fused_fast.py, or fused.py as its formulas")
    p.add_argument("--json", metavar="PATH", help="write the run's measurements as JSON (rank 0)")
    p.add_argument("--save", metavar="PATH.npz", help="write the final weights, keyed by parameter name")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="save the whole training state in DIR every --checkpoint-every steps; run the same "
                        "command again to resume from the newest complete checkpoint (one layout, not the tour)")
    p.add_argument("--checkpoint-every", type=cli.integer(1), default=50, metavar="K",
                   help="steps between checkpoints (with --checkpoint)")
    p.add_argument("--deepspeed-config", metavar="PATH",
                   help="train the layout of a DeepSpeed JSON config (chapter 9); --pp/--tp give the degrees "
                        "DeepSpeed sets in code")
    p.add_argument("--megatron-args", metavar="ARGS",
                   help="train the layout of a Megatron-LM argument line, in quotes (chapter 9)")
    return p


def check_args(args, world_size: int):
    """Everything that can be wrong with the flags, found identically on every rank before any
    message is sent. Returns (config, task, layout); layout None means the tour. Which layouts
    are valid is `Layout.validate`'s one rule (the planner and the framework readers use it too)."""
    if args.n_embd % args.n_head:  # every flag's own range is its parser type's (build_parser)
        raise ValueError(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    shape = dict(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                 n_embd=args.n_embd, dropout=args.dropout, tie_weights=not args.untied)
    if args.experts is None:
        moe_flags = [flag for flag, given in (("--top-k", args.top_k != 1), ("--ep", args.ep is not None),
                                              ("--capacity-factor", args.capacity_factor != 1.25)) if given]
        if moe_flags:
            raise ValueError(f"{' '.join(moe_flags)} needs --experts E (a mixture-of-experts model)")
        config = GPTConfig(**shape)
    else:
        config = MoEConfig(**shape, num_experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor)
    try:
        task = make_task(args.data, args.block_size, seed=args.seed)
    except (ValueError, OSError) as error:  # OSError: a file that cannot be read, e.g. /proc/self/mem
        why = f"cannot read it ({error.strerror})" if getattr(error, "strerror", None) else error
        raise ValueError(f"--data {args.data} --block-size {args.block_size}: {why}") from None
    if args.precision != "fp32" and args.dtype != "float32":
        raise ValueError(f"--precision {args.precision} keeps fp32 master weights: it needs --dtype float32 "
                         f"(--dtype {args.dtype} is the exactness mode)")
    try:
        check_recompute(args.recompute, args.segments, args.n_layer)
    except ValueError as error:
        raise ValueError(f"--recompute {args.recompute} --segments {args.segments}: {error}") from None
    layout = None if is_tour(args, world_size) else Layout.from_args(args).validate(config, world_size,
                                                                                       args.batch_size)
    if layout is None:  # the tour runs every strategy with its own settings: one layout's flags are refused
        asked = Layout.from_args(args)
        why = asked.why_invalid(config, 1, args.batch_size) or next(
            (f"{flag} applies to one layout, not to the tour (give e.g. --dp {world_size})" for flag, on in
             (("--accumulation", asked.microbatches > 1), ("--fp32-grads", asked.fp32_grads)) if on), None)
        if why is not None:
            raise ValueError(why)
    if args.save and layout is None:
        raise ValueError("--save needs one layout (e.g. --dp N): the tour trains many models and keeps none")
    if args.checkpoint is not None and layout is None:
        raise ValueError("--checkpoint needs one layout (e.g. --dp N): the tour trains many models and keeps none")
    for flag, path in (("--json", args.json), ("--save", args.save)):
        if path is not None:
            cli.check_writable(flag, path)
    if args.json is not None and args.save is not None and os.path.abspath(args.json) == os.path.abspath(args.save):
        raise ValueError(f"--json and --save name the same file {args.save}: the weights would overwrite the JSON")
    return config, task, layout


def is_tour(args, world_size: int) -> bool:
    """Several ranks and no layout asked for: the tour of every strategy."""
    return world_size > 1 and args.layout is None and all(getattr(args, axis) is None for axis in
                                                          ("dp", "tp", "pp", "cp", "ep")) and args.experts is None


def apply_layout_name(args, given: set[str]) -> None:
    """--layout NAME: the name's settings become the flags; a layout flag given as well is refused
    (which of the two would the user mean?)."""
    try:
        layout = Layout.parse(args.layout)
    except ValueError as error:
        raise ValueError(f"--layout {args.layout}: {error}") from None
    clash = sorted(given & set(LAYOUT_FLAGS))
    if clash:
        raise ValueError(f"--layout {args.layout} gives the whole layout: drop --{clash[0].replace('_', '-')}")
    for dest, value in layout.demo_settings().items():
        setattr(args, dest, value)


def train(args, trainer, task, show: bool, first_step: int = 0, before_step=None) -> dict:
    """The loop every strategy shares: steps, progress bar, log lines with a sample. It starts at
    `first_step` (a resumed run) and calls `before_step(step)` first in each (checkpoints)."""
    log_every = args.log_every or max(1, args.steps // 10)
    losses, accuracies, seconds = [], [], []
    bar = tqdm(total=args.steps, initial=first_step, disable=not show, desc=trainer.name, unit="step",
               dynamic_ncols=True)
    for step in range(first_step, args.steps):
        if before_step:
            before_step(step)
        start = time.perf_counter()
        loss, acc = trainer.step(step)
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        accuracies.append(acc)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.2f}")
        if show and args.log_every >= 0 and (step % log_every == 0 or step == args.steps - 1):
            bar.write(f"step {step:4d} | loss {loss:.4f} | acc {acc:.3f} | {sample(trainer, task, step)}")
    bar.close()
    tokens = args.batch_size * args.block_size
    return {"losses": losses, "accuracies": accuracies, "step_seconds": seconds,
            "tokens_per_s": tokens / float(np.median(seconds[1:] if len(seconds) > 1 else seconds))}


def sample(trainer, task, step: int) -> str:
    model = trainer.model  # None where no rank holds the whole model
    if model is None:
        return ""
    prompt, expected = task.sample_prompt(step)
    out = model.generate(prompt[None], task.answer_length)[0]
    return task.format_sample(prompt, out[len(prompt):], expected)


IDLE = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "peak": 0}


def run(layout: Layout, args, config, task, world, show: bool, ranks=None, with_sample=False) -> dict:
    """Train one layout on `ranks` (default: all); collective over the whole world."""
    ranks = range(world.size) if ranks is None else ranks
    traffic.reset()
    trainer, result, per_step = None, {}, {}
    if world.rank in ranks:
        trainer = strategies.make_trainer(layout, args, config, task, world)
        first_step, before_step = resume(layout, args, config, trainer, world) if args.checkpoint else (0, None)
        built = traffic.by_label(traffic.snapshot())  # the set-up's messages (broadcasts) are not a step's
        result = train(args, trainer, task, show and world.rank == 0, first_step, before_step)
        result["first_step"] = first_step
        # a mesh's groups are labelled: the bytes this rank sent per step in its dp, tp, pp, embedding groups
        per_step = {label: (nbytes - built.get(label, 0)) // max(1, args.steps - first_step)
                    for label, nbytes in traffic.by_label(traffic.snapshot()).items()}
        if with_sample and world.rank == 0:
            result["sample"] = sample(trainer, task, args.steps)
    # ranks not taking part wait here, politely, for as long as the others train: an expected
    # wait, so not under the deadlock timeout (chapter 2)
    dist.barrier(timeout=math.inf if world.rank not in ranks else None)
    result["memory"] = world.comm.allgather(trainer.memory() if trainer else IDLE)
    result["comm"] = traffic.gather()
    result["all_reduce_algorithms"] = sorted({kind.split("@")[0].split(".")[1] for counts in result["comm"]
                                              for kind in counts["by_kind"] if kind.startswith("all_reduce.")})
    result["traffic_by_group"] = world.comm.allgather({"rank": world.rank, **per_step})
    if trainer:
        result.update(trainer.report())
    state = trainer.state_dict() if trainer else None  # collective for sharded strategies
    result["state"] = state if world.rank == 0 else None
    result["parameters"] = trainer.num_parameters() if trainer else None
    return result


def resume(layout: Layout, args, config, trainer, world) -> tuple[int, object]:
    """--checkpoint: load the newest complete checkpoint (saying so in one line), and the
    callback that saves one every --checkpoint-every steps (and injects MINIDIST_KILL faults)."""
    facts = run_facts(layout, args, config, world.size)
    try:
        os.makedirs(args.checkpoint, exist_ok=True)  # an unusable place fails now (every rank), not at step K
        first_step = checkpointing.resume(args.checkpoint, trainer, facts, world) or 0
    except (ValueError, OSError) as error:
        faults.fail(f"--checkpoint {args.checkpoint}: {error}")
    if first_step:
        saved = checkpoint.read_manifest(checkpoint.latest(args.checkpoint))["run"].get("layout")
        saved = saved.get("name") if isinstance(saved, dict) else saved
        resharded = f", saved by {saved}: resharded to {layout}" if saved != str(layout) else ""
        world.print0(f"resuming from {args.checkpoint}: step {first_step} of {args.steps} "
                     f"(checkpoint {checkpoint.step_name(first_step)}{resharded})")

    def before_step(step: int) -> None:
        if step > first_step and step % args.checkpoint_every == 0:
            checkpointing.save(args.checkpoint, step, trainer, facts, world)
        checkpointing.kill_if_asked(world.rank, step)

    return first_step, before_step


def run_facts(layout: Layout, args, config, world_size: int) -> dict:
    """What a checkpoint must agree on to be resumed: the model, dtype, precision, and every flag
    that shapes the steps (the schedule's length too: the learning rate follows it). "layout" says
    how the run was split (its name, strategy and ranks): recorded, not compared, since any layout
    resumes any other's checkpoint (minidist/parallel/checkpointing.py reshards it); on the same
    layout the resumed run repeats the uninterrupted one bit for bit, on another to rounding."""
    flags = ("steps", "batch_size", "lr", "seed", "data", "precision", "initial_loss_scale", "loss_scale_window")
    return {"dtype": args.dtype, "config": config.to_dict(), **{name: getattr(args, name, None) for name in flags},
            "layout": {"name": str(layout), "strategy": strategy(layout, isinstance(config, MoEConfig)),
                       "world_size": world_size}}


def tour(args, config, task, world) -> list[dict]:
    """Serial reference, then every strategy on this world: one table to compare them."""
    plan, skipped = strategies.tour_plan(args, config, world.size)
    world.print0(f"minidist tour on {world.size} ranks: the serial run, then {len(plan) - 1} strategies, "
                 f"{args.steps} steps each, compared with serial.")
    for reason in skipped:
        world.print0(f"  (skipped {reason})")
    rows, reference = [], None
    for layout, ranks in plan:
        kind = strategy(layout, isinstance(config, MoEConfig))
        result = run(layout, args, config, task, world, show=True, ranks=ranks, with_sample=kind == "serial")
        if world.rank == 0:
            step_seconds = float(np.median(result["step_seconds"][1:] or result["step_seconds"]))
            print(f"{kind:14s} loss {result['losses'][-1]:.4f}  acc {result['accuracies'][-1]:.3f}  "
                  f"{step_seconds * 1e3:6.1f} ms/step  all-reduce: {', '.join(result['all_reduce_algorithms']) or '-'}"
                  + (f"  | sample {result['sample']}" if result.get("sample") else ""), flush=True)
            reference = reference or result["state"]
            diff = max(float(np.max(np.abs(result["state"][k] - reference[k]))) for k in reference)
            rows.append({"strategy": kind, "layout": layout.degrees(), "layout_name": str(layout),
                         "final_loss": result["losses"][-1],
                         "max_abs_diff_from_serial": diff,
                         "step_seconds": step_seconds,
                         "tokens_per_s": result["tokens_per_s"],
                         "bytes_sent_per_rank": max(c["bytes_sent"] for c in result["comm"]) // args.steps,
                         "all_reduce_algorithms": result["all_reduce_algorithms"],
                         "peak_bytes_per_rank": max(m["peak"] for m in result["memory"])})
    if world.rank == 0:
        print_table(rows)
    return rows


def print_table(rows) -> None:
    print(f"\n{'strategy':14s} {'layout':20s} {'final loss':>10s} {'max |w - serial|':>17s} "
          f"{'step ms':>8s} {'sent/rank/step':>15s} {'peak mem/rank':>14s}")
    for r in rows:
        print(f"{r['strategy']:14s} {r['layout_name']:20s} {r['final_loss']:10.4f} "
              f"{r['max_abs_diff_from_serial']:17.2e} {r['step_seconds'] * 1e3:8.1f} "
              f"{r['bytes_sent_per_rank'] / 1e6:12.2f} MB {r['peak_bytes_per_rank'] / 1e6:11.1f} MB")


def main(argv=None) -> int:
    faults.install()
    tune_malloc()
    world = dist.get_world()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.deepspeed_config is not None or args.megatron_args is not None:
        translate(parser, args, argv, world)
    if args.layout is not None:
        try:
            apply_layout_name(args, frameworks.given_flags(parser, argv))
        except ValueError as error:
            faults.fail(str(error))
    limit_threads_per_rank(world.comm)
    if world.size > 1:  # where MPI put the ranks: one machine, or several (chapter 2)
        nodes = world.nodes()
        world.print0(f"minidist: {world.size} ranks on {len(nodes)} node{'s' if len(nodes) > 1 else ''}: "
                     + "; ".join(f"node {i}: ranks {_span(ranks)}" for i, ranks in enumerate(nodes)))
    tour_asked = is_tour(args, world.size)
    if args.steps is None:
        args.steps = 10 if tour_asked else 300
    if args.log_every == 0 and tour_asked:
        args.log_every = -1  # the tour: the bars, then one labelled line per strategy
    try:
        config, task, layout = check_args(args, world.size)
    except (ValueError, FileNotFoundError) as error:
        faults.fail(str(error))
    set_default_dtype(args.dtype)
    kernels(args.kernels)

    report = {"world_size": world.size, "layout": layout.degrees() if layout else {"dp": 1, "tp": 1, "pp": 1, "zero": 0},
              "layout_name": str(layout) if layout else "tour", "dtype": args.dtype, "config": config.to_dict(),
              "algorithm": args.algorithm, "kernels": args.kernels, "precision": args.precision,
              "recompute": args.recompute}
    with all_reduce_algorithm(args.algorithm):  # every strategy's all-reduces, unless it names one
        if layout is None:
            report["tour"] = tour(args, config, task, world)
            return finish(args, world, report, None)
        result = run(layout, args, config, task, world, show=True)
    if world.rank == 0:
        print(f"done: final loss {result['losses'][-1]:.4f}, accuracy {result['accuracies'][-1]:.3f}, "
              f"{result['tokens_per_s']:.0f} tokens/s", flush=True)
    return finish(args, world, {**report, **result}, result["state"])


def translate(parser, args, argv, world) -> None:
    """--deepspeed-config / --megatron-args: the config's layout becomes the flags (chapter 9);
    a flag given on the command line as well wins (e.g. --n-embd 32 to run a big model small)."""
    if args.deepspeed_config is not None and args.megatron_args is not None:
        faults.fail("give --deepspeed-config or --megatron-args, not both")
    flag = "--deepspeed-config" if args.deepspeed_config is not None else "--megatron-args"
    try:
        if args.deepspeed_config is not None:
            translation = frameworks.from_deepspeed(args.deepspeed_config, world.size, pp=args.pp or 1,
                                                    tp=args.tp or 1)
        else:
            translation = frameworks.from_megatron(args.megatron_args, world.size)
    except ValueError as error:
        faults.fail(f"{flag}: {error}")
    translation.apply(args, keep=frameworks.given_flags(parser, argv))
    world.print0(translation.describe())
    for why in translation.unsupported:
        world.print0(f"  not supported: {why}")


def _span(ranks: list[int]) -> str:
    """"0-3" for consecutive ranks, else "0, 2"."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def finish(args, world, report: dict, state) -> int:
    if world.rank == 0:
        report.pop("state", None)
        if args.json:
            checkpoint.write_json(args.json, report)
        if args.save:
            checkpoint.save_weights(args.save, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
