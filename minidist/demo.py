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
    mpirun -n 4 python -m minidist.demo --layout dp2-tp2-zero1-m2   # any layout by its name (training/layout.py)

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
                                      # from the newest complete checkpoint (minidist/training/checkpoint.py),
                                      # with this layout or any other (resharded: minidist/training/reshard.py)
    mpirun -n 2 python -m minidist.demo --pp 2 --trace run.json
                                      # the whole job's trace (any layout, the tour too): open it in
                                      # https://ui.perfetto.dev; python -m minidist.trace summary run.json

Under `mpirun -n N` with no layout flags the demo runs the tour: the serial reference on rank 0
(the others wait politely, without spinning), then every strategy in `minidist/training/strategies.py`
that this world and model allow, and one table comparing their losses and weights with serial.
"""
from __future__ import annotations

from dataclasses import asdict

import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from minidist import comm as dist, frameworks, trace
from minidist.training import checkpoint, strategies
from minidist.comm import all_reduce_algorithm, faults, traffic
from minidist.core.kernels import kernels
from minidist.demo_flags import apply_layout_name, build_parser, check_args, is_tour, least_memory, translate  # noqa: F401
from minidist.plan.memory import format_bytes
from minidist.training.layout import Layout, strategy
from minidist.core.moe import MoEConfig
from minidist.parallel import checkpointing
from minidist.runtime import limit_threads_per_rank, memory_available, tune_malloc
from minidist.core.tensor import set_default_dtype


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
        with trace.step(step, trainer):  # --trace: the step's span, then its memory ledger (minidist/trace)
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
    trace.resume()  # --trace records what the counters count: from here to traffic.gather()
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
    trace.pause()  # what follows (weights gathered for the report) is not training
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
            try:  # a full disk: every rank stops with one line, the previous checkpoint still valid
                checkpointing.save(args.checkpoint, step, trainer, facts, world)
            except ValueError as error:
                faults.fail(f"--checkpoint {args.checkpoint}: {error}")
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
    framework_config = None
    if any(getattr(args, dest) is not None for dest in ("deepspeed_config", "megatron_args", "torchtitan_config")):
        framework_config = translate(parser, args, argv, world)
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
    check_memory(args, config, world)
    set_default_dtype(args.dtype)
    kernels(args.kernels)

    report = {"world_size": world.size, "layout": layout.degrees() if layout else {"dp": 1, "tp": 1, "pp": 1, "zero": 0},
              "layout_name": str(layout) if layout else "tour", "dtype": args.dtype, "config": config.to_dict(),
              "algorithm": args.algorithm, "kernels": args.kernels, "precision": args.precision,
              "recompute": args.recompute, "optimizer": asdict(strategies.optim_settings(args))}
    if framework_config is not None:  # every key of the config: applied with the value used, or refused
        report["framework_config"] = framework_config
    if args.trace:  # collective: the ranks' clocks are aligned first (minidist/trace/clock.py)
        trace.begin(world, {"command": "python -m minidist.demo " + " ".join(sys.argv[1:] if argv is None else argv),
                            "layout": report["layout_name"], "world_size": world.size})
    with all_reduce_algorithm(args.algorithm):  # every strategy's all-reduces, unless it names one
        if layout is None:
            report["tour"] = tour(args, config, task, world)
            return finish(args, world, report, None)
        result = run(layout, args, config, task, world, show=True)
    if world.rank == 0:
        print(f"done: final loss {result['losses'][-1]:.4f}, accuracy {result['accuracies'][-1]:.3f}, "
              f"{result['tokens_per_s']:.0f} tokens/s", flush=True)
    return finish(args, world, {**report, **result}, result["state"])


def check_memory(args, config, world) -> None:
    """Refuse, in one line before any work, a run that cannot fit: its least memory (a lower
    bound, `least_memory`) against what the job's machines have available now. Each machine's
    reading is shared, so every rank reaches the same verdict (chapter 2)."""
    need, piles = least_memory(args, config, world.size)
    have = memory_available()
    if world.size > 1:
        readings = world.comm.allgather(have)
        have = sum(readings[ranks[0]] for ranks in world.nodes())
    if need > have:
        faults.fail(f"the model and batch need at least {format_bytes(need)} ({piles}), more than the "
                    f"{format_bytes(have)} of memory available: make --n-embd, --n-layer, --block-size or "
                    f"--batch-size smaller")


def _span(ranks: list[int]) -> str:
    """"0-3" for consecutive ranks, else "0, 2"."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def finish(args, world, report: dict, state) -> int:
    trace.end(args.trace, world)  # --trace: rank 0 writes the whole job's trace (collective; no-op without)
    if world.rank == 0:
        report.pop("state", None)
        for flag, path, write in (("--json", args.json, lambda: checkpoint.write_json(args.json, report)),
                                  ("--save", args.save, lambda: checkpoint.save_weights(args.save, state))):
            if path:
                try:  # checked before training, but a disk can fill up meanwhile: one line, no temporary left
                    write()
                except OSError as error:
                    faults.fail(f"{flag} {path}: cannot be written ({error.strerror or error})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
