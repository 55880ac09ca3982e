"""The command each rank runs, as the agent reads and rewrites it (chapter 11, fault tolerance).

The agent needs two things from the command: where its checkpoints go (`--checkpoint DIR`, found
in any command), and, to restart on fewer ranks, its layout. For `python -m minidist.demo` both
are read with the demo's own parser and checks (`demo_flags.check_args`, whose layout check is
`Layout.validate`'s one rule), so the agent accepts exactly the layouts the demo runs.

Shrinking drops data-parallel replicas only: tensor, pipeline and context parallelism cut the
model and each sequence, so their degrees are the model's, not the job's. From dp = d the new
degree is the largest d' < d dividing d that the demo accepts; the factor f = d / d' goes into
the micro-batches of a step (`--accumulation`, or a pipeline's `--microbatches`). `--batch-size`
is the global batch, so each step still sees the same sequences, and each rank the same micro-
batch of batch / (dp x micro-batches) rows: the same run, in the same memory per rank.

    dp4 on 4 ranks  ->  dp2-m2 on 2 ranks  ->  m4 on 1 rank  ->  nothing left to drop

The new flags are appended (argparse keeps a flag's last value; a `--layout NAME` is replaced by
the new layout's name), so the command the log shows is the user's, plus what changed.
"""
from __future__ import annotations

from dataclasses import replace

from minidist.demo_flags import (
    CONFIG_FLAGS,
    apply_layout_name,
    build_parser,
    check_args,
)
from minidist.frameworks import given_flags
from minidist.training.layout import Layout


def demo_flags(command: list[str]) -> list[str] | None:
    """The flags after `-m minidist.demo`, or None when the command runs something else."""
    for i in range(len(command) - 1):
        if command[i] == "-m" and command[i + 1] == "minidist.demo":
            return command[i + 2:]
    return None


def read_demo(flags: list[str]):
    """The demo's argparse namespace for `flags` (a `--layout` name applied, as the demo does);
    a flag the demo would refuse raises ValueError with the demo's own words."""
    parser = build_parser()

    def error(message):
        raise ValueError(f"the demo's flags: {message}")

    parser.error = error
    args = parser.parse_args(flags)
    given = given_flags(parser, flags)
    if args.layout is not None:
        apply_layout_name(args, given)
    args.given = given
    return args


def checkpoint_dir(command: list[str]) -> str | None:
    """The command's `--checkpoint DIR`: the demo's parse, or the last such flag of any command."""
    flags = demo_flags(command)
    if flags is not None:
        return read_demo(flags).checkpoint
    found = None
    for i, word in enumerate(command):
        if word == "--checkpoint" and i + 1 < len(command):
            found = command[i + 1]
        elif word.startswith("--checkpoint="):
            found = word.split("=", 1)[1]
    return found


def layout_of(command: list[str], world: int) -> Layout | None:
    """The demo's layout on `world` ranks, validated by the demo's checks (None: not the demo)."""
    flags = demo_flags(command)
    if flags is None:
        return None
    return check_args(read_demo(flags), world)[2]


def steps_of(command: list[str]) -> int | None:
    """The demo's --steps (its default for one layout when not given), None for another command."""
    flags = demo_flags(command)
    if flags is None:
        return None
    steps = read_demo(flags).steps
    return 300 if steps is None else steps


def shrink(command: list[str], world: int, base: list[str] | None = None) -> tuple[list[str], int, Layout]:
    """The same run on fewer ranks: (command, ranks, layout), the new flags appended to `base`
    (default `command`; the user's command, so that a second shrink replaces the first's flags).
    ValueError, in one line, where the command is not the demo's or its layout has no
    data-parallel replica the demo lets it drop."""
    flags = demo_flags(command)
    if flags is None:
        raise ValueError("--shrink drops data-parallel replicas of the demo's layout: the command must be "
                         "python -m minidist.demo ...")
    args = read_demo(flags)
    config_flags = sorted(flag for flag, dest in CONFIG_FLAGS.items() if dest in args.given)
    if config_flags:
        raise ValueError(f"--shrink rewrites the layout's flags: give it with --dp/--tp/--pp or --layout, "
                         f"not {config_flags[0]}")
    layout = check_args(args, world)[2]
    if layout is None:
        raise ValueError("--shrink needs one layout (e.g. --dp N), not the tour of every strategy")
    why = f"dp={layout.dp}: no data-parallel replica to drop"
    for dp in [d for d in range(layout.dp - 1, 0, -1) if layout.dp % d == 0]:
        factor = layout.dp // dp
        smaller = replace(layout, dp=dp, microbatches=layout.microbatches * factor)
        if args.layout is not None:
            extra = ["--layout", str(smaller)]
        else:
            extra = ["--dp", str(dp), "--microbatches" if layout.pp > 1 else "--accumulation",
                     str(smaller.microbatches)]
        try:
            checked = check_args(read_demo(demo_flags([*(command if base is None else base), *extra])),
                                 world // factor)[2]  # the demo's own rule, on the command that will run
        except ValueError as error:
            why = str(error)
            continue
        return [*(command if base is None else base), *extra], world // factor, checked
    raise ValueError(f"layout {layout} on {world} ranks cannot shrink: {why}")
