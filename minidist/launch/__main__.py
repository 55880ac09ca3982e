"""The agent's command line and its loop of attempts (chapter 11, fault tolerance).

    python -m minidist.launch --restarts 3 [--shrink] -n 4 -- python -m minidist.demo ARGS...

Attempt 1 runs the command on -n ranks. After a failure the agent says what died (exit status or
signal, and the rank, when the output names it), what was lost (the steps the attempt had done
against the newest complete checkpoint's step: those are done again) and what resumes (step,
ranks, layout), then starts again: on the same ranks, or with --shrink on fewer
(minidist/launch/command.py), after --restarts failures it stops with one line and the last exit
status. MINIDIST_KILL (fault injection) is removed from the restarts' environment: it is a fault
to inject once, and a restart that hit it again would only fail the same way.

Exit status 2 is not restarted: it is a job that stopped itself in one line (`faults.fail`: a
refused flag, a damaged checkpoint, a full disk), and would stop the same way again.
"""
import mpi4py

mpi4py.rc.initialize = False  # the agent reads the demo's flags, whose modules import MPI: it is no rank

import os
import shlex
import signal
import sys

from minidist import cli
from minidist.launch import command as rank_command
from minidist.launch.attempt import run_attempt, say
from minidist.training import checkpoint


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="python -m minidist.launch", usage="python -m minidist.launch [--restarts R] "
                          "[--shrink] -n N -- COMMAND...", description="Run COMMAND on N ranks under mpiexec; "
                          "when a rank dies, restart it from its newest complete checkpoint.")
    p.add_argument("-n", type=cli.integer(1), required=True, help="ranks of the first attempt")
    p.add_argument("--restarts", type=cli.integer(0), default=0,
                   help="failures to restart after (the command must have --checkpoint DIR)")
    p.add_argument("--shrink", action="store_true",
                   help="restart on fewer ranks: fewer data-parallel replicas, more micro-batches each")
    return p


def read_command_line(argv: list[str]):
    """(the agent's flags, the ranks' command); a mistake ends here in one line, before any rank starts."""
    parser = build_parser()
    if "--" not in argv:
        parser.error("give the command each rank runs after --, e.g. -n 4 -- python -m minidist.demo --dp 4")
    cut = argv.index("--")
    args, command = parser.parse_args(argv[:cut]), argv[cut + 1:]
    if not command:
        parser.error("nothing after --: give the command each rank runs, e.g. python -m minidist.demo --dp 4")
    try:
        args.checkpoint = rank_command.checkpoint_dir(command)
        if args.restarts and args.checkpoint is None:
            raise ValueError(f"--restarts {args.restarts} needs --checkpoint DIR in the command: without "
                             "checkpoints there is nothing to resume from")
        rank_command.layout_of(command, args.n)  # the demo's flags, checked as the demo will (None: another command)
        if args.shrink:
            rank_command.shrink(command, args.n)  # a layout that cannot shrink is refused now, not after a failure
    except ValueError as error:
        parser.error(str(error))
    return args, command


def newest_checkpoint(directory: str | None) -> tuple[int, str]:
    """(step, words) of the newest complete checkpoint, found by checkpoint.py's own `latest`."""
    path = checkpoint.latest(directory) if directory else None
    if path is None:
        return 0, "there is no complete checkpoint yet"
    try:
        step = int(checkpoint.read_manifest(path)["step"])
        return step, f"the newest complete checkpoint is step {step} ({path})"
    except ValueError as error:  # the job itself will refuse it, naming the file
        return 0, f"the newest checkpoint, {path}, cannot be read ({error})"


def lost_line(outcome, directory: str | None, steps: int | None) -> tuple[str, int]:
    """What the failure cost: the steps the attempt had done against the checkpoint's step."""
    step, where = newest_checkpoint(directory)
    if outcome.steps_done is None:
        return f"lost: the attempt reported no step done; {where}", step
    total = f" of {steps}" if steps else ""
    cost = f"{steps_count(outcome.steps_done - step)} lost, to be done again" if outcome.steps_done > step \
        else "nothing lost"
    return f"lost: the attempt had done {steps_count(outcome.steps_done)}{total}; {where}: {cost}", step


def steps_count(n: int) -> str:
    return f"{n} step{'s' * (n != 1)}"


class Stopped(BaseException):
    """The agent was told to stop: the attempt under way is ended on the way out (attempt.py)."""


def stop(signum, frame):
    raise Stopped(signum)


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, stop)
    args, original = read_command_line(sys.argv[1:] if argv is None else argv)
    command, world, env = original, args.n, dict(os.environ)
    steps = rank_command.steps_of(original)
    failures = 0
    while True:
        layout = rank_command.layout_of(command, world)
        say(f"attempt {failures + 1} of {args.restarts + 1}: {world} ranks"
            + (f", layout {layout}" if layout else "") + f": {shlex.join(command)}")
        outcome = run_attempt(command, world, env)
        if outcome.leftover:
            say(f"processes {outcome.leftover} of the attempt outlived SIGKILL: not restarting beside them")
            return outcome.exit_status or 1
        if outcome.code == 0:
            say(f"done: attempt {failures + 1} finished" + (f" on {world} ranks" if failures else ""))
            return 0
        failures += 1
        if outcome.code == 2 and outcome.dead_signal is None:
            say(f"attempt {failures} failed: the job stopped itself in one line (above; exit status 2): not a "
                "lost rank, and a restart would stop the same way: stopped")
            return 2
        say(f"attempt {failures} failed: {outcome.what_died()}")
        line, resume_at = lost_line(outcome, args.checkpoint, steps)
        say(line)
        if failures > args.restarts:
            say(f"stopped after {failures} failed attempt{'s' * (failures > 1)} (--restarts {args.restarts}): "
                f"last exit status {outcome.exit_status}")
            return outcome.exit_status
        if args.shrink:
            try:
                command, smaller, layout = rank_command.shrink(command, world, base=original)
            except ValueError as error:
                say(f"stopped: {error}; last exit status {outcome.exit_status}")
                return outcome.exit_status
            how = f"on {smaller} ranks (was {world}), layout {layout}, the global batch unchanged"
            world = smaller
        else:
            how = f"on the same {world} ranks" + (f", layout {layout}" if layout else "")
        if "MINIDIST_KILL" in env:
            say(f"MINIDIST_KILL={env.pop('MINIDIST_KILL')} applied to the first attempt only: "
                "removed from the restarts' environment")
        say(f"resuming: step {resume_at}" + (f" of {steps}" if steps else "") + f" {how}"
            + ("" if resume_at else " (no checkpoint: from the start)"))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, Stopped) as why:  # Ctrl-C or SIGTERM: the attempt has been ended already
        number = why.args[0] if isinstance(why, Stopped) else signal.SIGINT
        say(f"stopped by {signal.Signals(number).name}: the attempt under way was ended, nothing restarted")
        sys.exit(128 + number)
