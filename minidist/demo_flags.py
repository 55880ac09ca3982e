"""The demo's command line: every flag, and everything that can be wrong with them, found on every
rank before any message (chapter 2's rule: a user's mistake fails in one line before any work).

`build_parser` is the contract users, notebooks and checks rely on (extend it, never rename a
flag); `check_args` turns the flags into the model, the task and the `Layout` (`training/layout.py`'s one
rule judges it), or None for the tour; `--layout NAME` and the framework configs
(`--deepspeed-config`, `--megatron-args`, `--torchtitan-config`, chapter 9) become flags first.
"""
from __future__ import annotations

import argparse
import os

from minidist import cli, frameworks
from minidist.comm import faults
from minidist.comm.collectives import ALL_REDUCE
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.core.optim import DECAYS
from minidist.core.recompute import check_recompute
from minidist.training.layout import LAYOUT_FLAGS, Layout
from minidist.core.moe import MoEConfig
from minidist.plan.memory import activation_bytes, format_bytes, moe_param_count, param_count

DESCRIPTION = "`python -m minidist.demo`: train the small GPT and watch it learn."


def data_source(text: str) -> str:
    """--data: a built-in task ('sort', 'sort:LENGTH[:DIGITS]') or a regular file (not a device:
    /dev/zero never ends); whether the file is long enough is checked with --block-size."""
    if text == "sort" or text.startswith("sort:") or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(f"{text}: not a regular file" if os.path.exists(text) else
                                     f"no task or file named {text!r} (built-in tasks: 'sort')")


MAX_STEPS = 10**9  # some thirty years at a step a second: a larger count is a typo


def build_parser() -> argparse.ArgumentParser:
    positive = cli.integer(1)
    p = cli.OneLineParser(prog="python -m minidist.demo", description=DESCRIPTION,
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=cli.integer(1, MAX_STEPS), default=None, help="training steps (default 300; 20 per strategy in the tour)")
    p.add_argument("--batch-size", type=positive, default=16, help="global batch size (sequences per step)")
    p.add_argument("--lr", type=cli.number(0, lo_open=True), default=3e-3, help="peak learning rate (warm-up then cosine)")
    p.add_argument("--min-lr", type=cli.number(0), default=None, help="learning rate at the last step (default lr/10)")
    p.add_argument("--warmup", type=cli.integer(0), default=None, help="warm-up steps (default min(10, steps/10))")
    p.add_argument("--lr-decay", choices=list(DECAYS), default="cosine", help="after warm-up, down to --min-lr")
    p.add_argument("--weight-decay", type=cli.number(0), default=0.1, help="AdamW's decoupled decay (matrices only)")
    p.add_argument("--clip", type=cli.number(0), default=1.0, help="max global gradient norm (0: no clipping)")
    p.add_argument("--adam-beta1", type=cli.number(0, 1, hi_open=True), default=0.9)
    p.add_argument("--adam-beta2", type=cli.number(0, 1, hi_open=True), default=0.95)
    p.add_argument("--adam-eps", type=cli.number(0, lo_open=True), default=1e-8)
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
                   help="the whole layout by its name, e.g. dp2-tp2-zero1-m4 (minidist/training/layout.py), instead of "
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
    p.add_argument("--balance-stages", choices=["blocks", "time"], default="blocks",
                   help="cut the blocks into pipeline stages by count, or by measured cost (chapter 5; --pp with "
                        "one chunk per rank, no --tp or --cp)")
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
    p.add_argument("--trace", metavar="PATH", help="write the job's trace, every rank's spans, collectives and messages, "
                   "in Chrome Trace Event Format (open it in https://ui.perfetto.dev; chapter 5; minidist/trace/)")
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
    p.add_argument("--torchtitan-config", metavar="PATH",
                   help="train the layout of a torchtitan TOML job config (chapter 9); --n-layer/--n-embd/--n-head "
                        "set the model its flavor names")
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
    if args.balance_stages == "time" and (layout is None or layout.pp == 1 or layout.virtual_stages > 1 or
                                          layout.tp > 1 or layout.cp > 1 or args.experts is not None):
        raise ValueError(f"--balance-stages time cuts a pipeline's blocks by measured cost: it needs --pp > 1 with "
                         f"one chunk per rank and no --tp, --cp or --experts (layout "
                         f"{layout if layout is not None else 'the tour'})")
    if args.save and layout is None:
        raise ValueError("--save needs one layout (e.g. --dp N): the tour trains many models and keeps none")
    if args.checkpoint is not None and layout is None:
        raise ValueError("--checkpoint needs one layout (e.g. --dp N): the tour trains many models and keeps none")
    for flag, path in (("--json", args.json), ("--save", args.save), ("--trace", args.trace)):
        if path is not None:
            cli.check_writable(flag, path)
    if args.json is not None and args.save is not None and os.path.abspath(args.json) == os.path.abspath(args.save):
        raise ValueError(f"--json and --save name the same file {args.save}: the weights would overwrite the JSON")
    return config, task, layout


def least_memory(args, config, world_size: int) -> tuple[int, str]:
    """Bytes the run needs at the very least, all its ranks together, and what they hold: a lower
    bound from the memory ledger's formulas (minidist/plan/memory.py, chapter 1), so that a run
    that cannot fit is refused before it starts, never one that could. Whatever the layout, the
    job holds every weight, its gradient and AdamW's two moments at least once, the batch's
    tokens (inputs and targets, int64), and one sequence's activations in one block (its
    attention scores, s x s per head, shared by at most every rank)."""
    itemsize = 8 if args.dtype == "float64" else 4
    params = moe_param_count(config) if isinstance(config, MoEConfig) else param_count(config)
    states = 4 * params * itemsize
    tokens = 2 * args.batch_size * args.block_size * 8
    sequence = activation_bytes(config, 1, bytes_per_element=itemsize)["per_layer"] // world_size
    return states + tokens + sequence, (f"{format_bytes(states)} for the weights, gradients and AdamW moments of "
                                        f"{params:.3g} parameters, {format_bytes(tokens)} of tokens, "
                                        f"{format_bytes(sequence)} of activations")


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


AUTO_FILLERS = ("lr", "warmup", "weight_decay", "clip", "adam_beta1", "adam_beta2", "adam_eps", "precision",
                "accumulation")  # Hugging Face's "auto" takes these from the command line when given


CONFIG_FLAGS = {"--deepspeed-config": "deepspeed_config", "--megatron-args": "megatron_args",
                "--torchtitan-config": "torchtitan_config"}  # one framework config at a time (chapter 9)


def translate(parser, args, argv, world) -> dict:
    """--deepspeed-config / --megatron-args / --torchtitan-config: the config's layout and settings
    become the flags (chapter 9); a flag given on the command line as well wins (e.g. --n-embd 32 to
    run a big model small). Prints the translation, what is refused and why, and the values the run will use;
    returns the `--json` "framework_config" (every key applied, with the value used, or refused)."""
    configs = [flag for flag, dest in CONFIG_FLAGS.items() if getattr(args, dest) is not None]
    if len(configs) > 1:
        faults.fail(f"give one framework config, not {' and '.join(configs)}")
    flag = configs[0]
    given = frameworks.given_flags(parser, argv)
    try:
        if args.deepspeed_config is not None:
            # the command line's flags fill "auto" as the Trainer's arguments do; the rest take the Trainer's defaults
            fill = {name: getattr(args, name) for name in AUTO_FILLERS if name in given}
            fill.update(batch_size=args.batch_size, n_embd=args.n_embd, steps=args.steps or 300)
            translation = frameworks.from_deepspeed(args.deepspeed_config, world.size, pp=args.pp or 1,
                                                    tp=args.tp or 1, settings=fill)
        elif args.torchtitan_config is not None:
            model = {name: getattr(args, name) for name in ("n_layer", "n_embd", "n_head", "block_size")
                     if name in given}  # the model the run trains: torchtitan's flavor names one minidist lacks
            translation = frameworks.from_torchtitan(args.torchtitan_config, world.size, settings=model)
        else:
            translation = frameworks.from_megatron(args.megatron_args, world.size)
    except ValueError as error:
        faults.fail(f"{flag}: {error}")
    translation.apply(args, keep=given)
    world.print0(translation.describe(args, given))
    for why in translation.unsupported:
        world.print0(f"  not supported: {why}")
    overridden = sorted(f"--{dest.replace('_', '-')}" for dest in given & set(translation.demo_settings()))
    world.print0("the run uses: " + ", ".join(
        f"{name} {getattr(args, name)}" for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "steps",
                                                     "lr", "min_lr", "warmup", "lr_decay", "weight_decay", "clip",
                                                     "adam_beta1", "adam_beta2", "adam_eps", "precision")
        if getattr(args, name, None) is not None)
        + (f" (the command line's {', '.join(overridden)} over the config's)" if overridden else ""))
    return translation.report(args, given)
