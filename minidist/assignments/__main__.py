"""The assignments' command line: list, build a student copy, grade one."""
from __future__ import annotations

import json
import os
import sys
import urllib.parse
import urllib.request
from importlib import metadata
from pathlib import Path

from minidist.assignments.grade import SandboxUnavailable, grade
from minidist.assignments.markers import BuildError, build, repository_root
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
    g.add_argument("--no-sandbox", action="store_true",
                   help="run the graded tests without bubblewrap (where it cannot be installed); the report says so")
    return p


def installed_tree() -> Path | None:
    """The instructor's tree that pip installed minidist from (editable), if any."""
    try:
        url = json.loads(metadata.distribution("minidist").read_text("direct_url.json") or "{}").get("url", "")
    except (metadata.PackageNotFoundError, ValueError):
        return None
    parsed = urllib.parse.urlparse(url)
    return Path(urllib.request.url2pathname(parsed.path)).resolve() if parsed.scheme == "file" else None


def shadowed_by_working_directory() -> bool:
    """Whether this minidist was imported from the working directory (`python -m` puts it first:
    run inside a student's copy, that copy's package) while the installed one is another tree."""
    installed = installed_tree()
    return (repository_root() == Path.cwd().resolve()
            and installed is not None and installed != repository_root() and (installed / "minidist").is_dir())


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if argv is None and args.command != "list" and shadowed_by_working_directory():
        # again without the working directory on the path (Python 3.11's -P): the installed tree grades
        again = ("import runpy, sys; del sys.path[0]; sys.argv[0] = 'minidist.assignments'; "
                 "runpy.run_module('minidist.assignments', run_name='__main__', alter_sys=True)")
        os.execv(sys.executable, [sys.executable, "-c", again, *sys.argv[1:]])
    chosen = [a for a in ASSIGNMENTS if not args.only or a.name in args.only] if args.command != "list" else ASSIGNMENTS
    if args.command == "list":
        rows = [[a.name, a.chapter, a.points, f"{a.minutes} min", len(a.tests), a.where] for a in ASSIGNMENTS]
        print(table(rows, ["assignment", "chapter", "points", "time", "tests", "you write"]))
        return 0
    if args.command == "build":
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            p.error(f"argument out: {args.out!r} is not a directory")
        try:
            regions = build(out, [a.name for a in chosen])
        except BuildError as e:
            p.error(f"argument out: {e}")
        for r in regions:
            print(f"stubbed {r.name:22s} {r.path}:{r.begin}-{r.end}")
        print(f"wrote {out} ({len(chosen)} assignments, {len(regions)} regions)")
        return 0
    student = Path(args.student)
    if not (student / "minidist" / "__init__.py").is_file():
        p.error(f"argument student: {args.student!r} holds no minidist package (build one first)")
    try:
        report = grade(chosen, student, sandbox=not args.no_sandbox)
    except SandboxUnavailable as e:
        p.error(str(e))
    rows = [[r["name"], r["chapter"], f"{r['passed']}/{r['tests']}", f"{r['points']:g}/{r['max_points']}"]
            for r in report["assignments"]]
    print(table(rows + [["total", "", "", f"{report['points']:g}/{report['max_points']}"]],
                ["assignment", "chapter", "tests passed", "points"]))
    if not report["sandboxed"]:
        print("not sandboxed (--no-sandbox): the graded code could read and write what this user can")
    for r in report["assignments"]:
        if r["hidden_tests"]:
            print(f"  {r['name']}: hidden tests passed {r['hidden_passed']}/{r['hidden_tests']}")
        for failure in r["failures"][:3]:  # the rest are in the --json report
            print(f"  {r['name']}: {failure['test']}: {failure['message']}")
        if len(r["failures"]) > 3:
            print(f"  {r['name']}: ... and {len(r['failures']) - 3} more failing tests")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
