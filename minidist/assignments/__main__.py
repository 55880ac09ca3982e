"""The assignments' command line: list, build a student copy, grade one."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from minidist.assignments.grade import grade
from minidist.assignments.markers import build
from minidist.assignments.registry import ASSIGNMENTS, BY_NAME
from minidist.cli import OneLineParser, one_of, output_file


def table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()
                     for row in [header, *rows])


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m minidist.assignments", description=__doc__)
    commands = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    commands.add_parser("list", help="the assignments: chapter, points, time, graded tests")
    b = commands.add_parser("build", help="write a student copy with the selected regions stubbed")
    b.add_argument("out", help="the directory to write (created if missing)")
    b.add_argument("--only", nargs="+", type=one_of(list(BY_NAME)), help="these assignments (default: all)")
    g = commands.add_parser("grade", help="run each assignment's graded tests on a student's copy")
    g.add_argument("student", help="the student's copy (a directory made by build)")
    g.add_argument("--only", nargs="+", type=one_of(list(BY_NAME)), help="these assignments (default: all)")
    g.add_argument("--json", type=output_file, help="also write the report (with each failure's message)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    chosen = [a for a in ASSIGNMENTS if not args.only or a.name in args.only] if args.command != "list" else ASSIGNMENTS
    if args.command == "list":
        rows = [[a.name, a.chapter, a.points, f"{a.minutes} min", len(a.tests), a.where] for a in ASSIGNMENTS]
        print(table(rows, ["assignment", "chapter", "points", "time", "tests", "you write"]))
        return 0
    if args.command == "build":
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            p.error(f"argument out: {args.out!r} is not a directory")
        regions = build(out, [a.name for a in chosen])
        for r in regions:
            print(f"stubbed {r.name:22s} {r.path}:{r.begin}-{r.end}")
        print(f"wrote {out} ({len(chosen)} assignments, {len(regions)} regions)")
        return 0
    student = Path(args.student)
    if not (student / "minidist" / "__init__.py").is_file():
        p.error(f"argument student: {args.student!r} holds no minidist package (build one first)")
    report = grade(chosen, student)
    rows = [[r["name"], r["chapter"], f"{r['passed']}/{r['tests']}", f"{r['points']:g}/{r['max_points']}"]
            for r in report["assignments"]]
    print(table(rows + [["total", "", "", f"{report['points']:g}/{report['max_points']}"]],
                ["assignment", "chapter", "tests passed", "points"]))
    for r in report["assignments"]:
        for failure in r["failures"][:3]:  # the rest are in the --json report
            print(f"  {r['name']}: {failure['test']}: {failure['message']}")
        if len(r["failures"]) > 3:
            print(f"  {r['name']}: ... and {len(r['failures']) - 3} more failing tests")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
