"""The assignments' command line: list, build a student copy, grade one."""
from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.parse
import urllib.request
from importlib import metadata
from pathlib import Path

from minidist.assignments.classroom import (build_autograder, copy_root, grade_class, gradescope_results,
                                            looks_like_class)
from minidist.assignments.grade import SandboxUnavailable, grade, sandbox_problem
from minidist.assignments.markers import BuildError, build, repository_root
from minidist.assignments.registry import ASSIGNMENTS, BY_NAME
from minidist.cli import OneLineParser, integer, one_of, output_file


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
    g.add_argument("student", help="the student's copy (a directory made by build), or a class: a folder of "
                                   "submissions (folders or .zip/.tar.gz archives) named by student id")
    g.add_argument("--only", nargs="+", type=one_of(list(BY_NAME)), help="these assignments (default: all)")
    g.add_argument("--json", type=output_file, help="also write the report (with each failure's message)")
    g.add_argument("--no-sandbox", action="store_true",
                   help="run the graded tests without bubblewrap (where it cannot be installed); the report says so")
    g.add_argument("--sandbox-if-available", action="store_true",
                   help="bubblewrap where it runs, else unsandboxed (inside Gradescope's container); the report says so")
    g.add_argument("--class", dest="klass", action="store_true",
                   help="STUDENT is a folder of submissions (detected when it holds no minidist package)")
    g.add_argument("--jobs", type=integer(1), default=None, help="students graded at once (default: the cores)")
    g.add_argument("--out", help="--class: the gradebook's folder (default: STUDENT/../grades); "
                                 "--format gradescope: the folder of results.json")
    g.add_argument("--seed", type=integer(0), default=0,
                   help="recorded in the gradebook (the graded tests use fixed seeds of their own)")
    g.add_argument("--format", choices=["text", "gradescope"], default="text",
                   help="gradescope: write Gradescope's results.json into --out for one submission")
    s = commands.add_parser("gradescope", help="write the autograder zip to upload to Gradescope")
    s.add_argument("zip", help="the zip to write (OUT.zip)")
    s.add_argument("--only", nargs="+", type=one_of(list(BY_NAME)), help="these assignments (default: all)")
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
        except OSError as e:  # a read-only or full place: one line, as for any bad argument
            if isinstance(e, shutil.Error):  # copytree's list of (source, target, why): the first says enough
                e = OSError(e.args[0][0][2]) if e.args and e.args[0] else e
            p.error(f"argument out: cannot write {e.filename or args.out} ({e.strerror or e})")
        for r in regions:
            print(f"stubbed {r.name:22s} {r.path}:{r.begin}-{r.end}")
        print(f"wrote {out} ({len(chosen)} assignments, {len(regions)} regions)")
        return 0
    if args.command == "gradescope":
        if not args.zip.endswith(".zip"):
            p.error(f"argument zip: {args.zip!r} does not end in .zip")
        names = build_autograder(Path(output_file(args.zip)), chosen)
        print(f"wrote {args.zip} ({len(names)} files, {len(chosen)} assignments): upload it as the autograder")
        return 0
    student = Path(args.student)
    sandbox = not args.no_sandbox
    if args.sandbox_if_available and sandbox_problem() is not None:
        sandbox = False
    if sandbox and (problem := sandbox_problem()):
        p.error(problem)
    if args.format == "gradescope":
        return gradescope(student, chosen, sandbox, Path(args.out or "."))
    if args.klass or looks_like_class(student):
        if not student.is_dir():
            p.error(f"argument student: {args.student!r} is not a folder of submissions")
        out = Path(args.out) if args.out else student.resolve().parent / "grades"
        try:
            reports = grade_class(student, chosen, out, jobs=args.jobs, sandbox=sandbox, seed=args.seed)
        except ValueError as e:
            p.error(str(e))
        print(f"wrote {out / 'gradebook.csv'} ({len(reports)} students) and one JSON report each")
        return 0
    if not (student / "minidist" / "__init__.py").is_file():
        p.error(f"argument student: {args.student!r} holds no minidist package (build one first)")
    try:
        report = grade(chosen, student, sandbox=sandbox)
    except SandboxUnavailable as e:
        p.error(str(e))
    rows = [[r["name"], r["chapter"], f"{r['passed']}/{r['tests']}", f"{r['points']:g}/{r['max_points']}"]
            for r in report["assignments"]]
    print(table(rows + [["total", "", "", f"{report['points']:g}/{report['max_points']}"]],
                ["assignment", "chapter", "tests passed", "points"]))
    if not report["sandboxed"]:
        print("not sandboxed (--no-sandbox or --sandbox-if-available): the graded code could read and write what this user can")
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


def gradescope(submission: Path, chosen: list, sandbox: bool, out: Path) -> int:
    """Write out/results.json for one submission (0 points, with why, when it holds no copy)."""
    root = copy_root(submission) if submission.is_dir() else None
    if root is None:
        empty = {"sandboxed": sandbox, "points": 0, "max_points": sum(a.points for a in chosen),
                 "assignments": [{"name": a.name, "points": 0, "tests": 0, "passed": 0, "hidden_tests": 0,
                                  "hidden_passed": 0, "failures": []} for a in chosen]}
        results = gradescope_results(empty, chosen, note="the submission holds no minidist package: submit the "
                                                          "whole student copy (its minidist/ folder at the top)")
    else:
        results = gradescope_results(grade(chosen, root, sandbox=sandbox), chosen)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{results['score']:g}/{results['max_score']:g}: wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
