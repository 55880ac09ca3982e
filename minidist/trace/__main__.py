"""`python -m minidist.trace summary PATH [--json] [--skip N] [--trainer NAME]`: where each rank's step time went.

PATH is a trace written by `--trace` (the demo, the benchmarks). Per rank, the mean step's
compute, exposed communication, idle/bubble and optimizer time, in ms and in % of the step
(minidist/trace/summary.py says how every instant is charged); `--json` prints the same numbers
as JSON for programs; `--skip N` leaves out each rank's first N steps (the warm-up); `--trainer
NAME` counts only that trainer's steps (one strategy of the demo's tour, one mode of a benchmark).
"""
from __future__ import annotations

import json
import sys

from minidist import cli
from minidist.trace.summary import format_table, summarize


def main(argv=None) -> int:
    parser = cli.OneLineParser(prog="python -m minidist.trace", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    summary = commands.add_parser("summary", help="per rank: compute, exposed comm, idle/bubble, optimizer")
    summary.add_argument("path", metavar="PATH", help="a trace file (Chrome Trace Event Format, from --trace)")
    summary.add_argument("--json", action="store_true", help="print the numbers as JSON")
    summary.add_argument("--skip", type=cli.integer(0), default=0, help="leave out each rank's first N steps")
    summary.add_argument("--trainer", metavar="NAME", help="only the steps of this trainer (e.g. pp-1f1b in a tour)")
    args = parser.parse_args(argv)
    try:
        result = summarize(args.path, args.skip, args.trainer)
    except (OSError, ValueError, KeyError) as error:  # not a file, not JSON, not a trace
        parser.error(f"{args.path}: cannot read a trace from it ({error})")
    if not result["ranks"]:
        parser.error(f"{args.path}: no step spans" + (f" of trainer {args.trainer}" if args.trainer else "")
                     + (f" after the first {args.skip} of each rank" if args.skip else ""))
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
