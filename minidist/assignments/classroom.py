"""Grading a class, and Gradescope.

A class is a folder whose children are the submissions, one per student, named by student id:
each a folder (a student copy) or an archive of one (.zip, .tar.gz, .tgz, .tar). Each is graded
as `grade` grades one copy (spliced into the instructor's tree, under bubblewrap), several at
once, into a gradebook (gradebook.csv) and one JSON report per student.

An archive is extracted into a temporary folder first, and refused, whole, if a member has an
absolute path or a `..` component, is a link that points outside the archive, or is a device:
that student then gets 0 with the reason in the gradebook.

Gradescope: `gradescope_results` turns one report into Gradescope's results.json, and
`build_autograder` writes the autograder zip an instructor uploads (setup.sh, run_autograder and
the instructor's tree with its hidden tests)."""
from __future__ import annotations

import csv
import json
import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from minidist.assignments.grade import GRADED_TREE, grade
from minidist.assignments.markers import SKIPPED, repository_root
from minidist.assignments.registry import Assignment

ARCHIVES = (".tar.gz", ".tgz", ".tar", ".zip")
AUTOGRADER_TREE = GRADED_TREE + ("hidden_tests", "README.md")  # into the zip's tree/
VISIBILITY = ("hidden", "after_due_date", "after_published", "visible")  # Gradescope's values


class UnsafeArchive(ValueError):
    """An archive member that would land outside the extraction folder (one line)."""


def student_id(path: Path) -> str:
    name = path.name
    for suffix in ARCHIVES:
        if name.endswith(suffix) and path.is_file():
            return name[:-len(suffix)]
    return name


def is_submission(path: Path) -> bool:
    return not path.name.startswith(".") and (path.is_dir() or (path.is_file() and path.name.endswith(ARCHIVES)))


def looks_like_class(folder: Path) -> bool:
    """A folder that is not a student copy itself, whose children are submissions."""
    if (folder / "minidist" / "__init__.py").is_file() or not folder.is_dir():
        return False
    children = [c for c in folder.iterdir() if is_submission(c)]
    return bool(children) and all(c.name.endswith(ARCHIVES) or copy_root(c) is not None for c in children)


def copy_root(folder: Path) -> Path | None:
    """The student copy in `folder`: itself, or its single subfolder (an archive of a folder)."""
    if (folder / "minidist" / "__init__.py").is_file():
        return folder
    inner = [c for c in folder.iterdir() if c.is_dir() and not c.name.startswith((".", "__MACOSX"))]
    if len(inner) == 1 and (inner[0] / "minidist" / "__init__.py").is_file():
        return inner[0]
    return None


def _member_problem(name: str, link: str | None) -> str | None:
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or (len(name) > 1 and name[1] == ":"):
        return f"member {name!r} has an absolute path"
    if ".." in path.parts:
        return f"member {name!r} points outside the archive (..)"
    if link is not None:
        target = PurePosixPath(link.replace("\\", "/"))
        depth = len(path.parent.parts)
        for part in target.parts:
            depth += -1 if part == ".." else 0 if part == "." else 1
            if depth < 0:
                break
        if target.is_absolute() or depth < 0:
            return f"member {name!r} is a link to {link!r}, outside the archive"
    return None


def safe_extract(archive: Path, dest: Path) -> None:
    """Extract `archive` into `dest`, or raise UnsafeArchive naming the first bad member
    (nothing is extracted then)."""
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            members = z.infolist()
            links = {m.filename: z.read(m).decode(errors="replace") for m in members
                     if stat.S_ISLNK(m.external_attr >> 16)}
            for m in members:
                if problem := _member_problem(m.filename, links.get(m.filename)):
                    raise UnsafeArchive(problem)
            for m in members:
                if m.filename in links:
                    target = dest / m.filename
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(links[m.filename], target)
                else:
                    z.extract(m, dest)
        return
    with tarfile.open(archive) as t:
        members = t.getmembers()
        for m in members:
            if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
                raise UnsafeArchive(f"member {m.name!r} is not a file, folder or link")
            link = m.linkname if m.issym() else None
            problem = _member_problem(m.name, link) or (
                _member_problem(m.linkname, None) if m.islnk() else None)
            if problem:
                raise UnsafeArchive(problem)
        t.extractall(dest, members=members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))


def _reason(error: Exception) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__


def grade_submission(path: Path, assignments: list[Assignment], sandbox: bool, seed: int) -> dict:
    """One student's report (grade's, with "student", "seed" and "note"); 0 points and a note
    when the submission cannot be graded (an unsafe or broken archive, no student copy in it)."""
    sid = student_id(path)
    empty = {"student": sid, "seed": seed, "sandboxed": sandbox, "points": 0,
             "max_points": sum(a.points for a in assignments),
             "assignments": [{"name": a.name, "chapter": a.chapter, "max_points": a.points, "points": 0,
                              "passed": 0, "tests": len(a.tests) + len(a.hidden), "hidden_passed": 0,
                              "hidden_tests": 0, "sandboxed": sandbox, "failures": []} for a in assignments]}
    with tempfile.TemporaryDirectory(prefix="minidist-class-") as scratch:
        folder = path
        if path.is_file():
            try:
                safe_extract(path, Path(scratch))
            except (UnsafeArchive, zipfile.BadZipFile, tarfile.TarError, OSError, UnicodeError) as e:
                return {**empty, "note": f"archive refused: {_reason(e)}"}
            folder = Path(scratch)
        root = copy_root(folder)
        if root is None:
            return {**empty, "note": "no student copy (no minidist/__init__.py) in the submission"}
        report = grade(assignments, root, sandbox=sandbox)
    return {**report, "student": sid, "seed": seed, "note": ""}


def grade_class(submissions: Path, assignments: list[Assignment], out: Path, jobs: int | None = None,
                sandbox: bool = True, seed: int = 0, progress=print) -> list[dict]:
    """Grade every submission in `submissions` (`jobs` at once), write out/gradebook.csv and
    out/<student>.json; the reports, by student id."""
    out = out.resolve()
    paths = sorted((c for c in submissions.iterdir() if is_submission(c) and c.resolve() != out),
                   key=lambda c: student_id(c))
    ids = [student_id(c) for c in paths]
    if len(set(ids)) != len(ids):
        raise ValueError(f"two submissions of one student id in {submissions}: "
                         f"{sorted({i for i in ids if ids.count(i) > 1})}")

    def one(path):
        report = grade_submission(path, assignments, sandbox, seed)
        progress(f"{report['student']}: {report['points']:g}/{report['max_points']}"
                 + (f" ({report['note']})" if report["note"] else ""))
        return report

    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as pool:
        reports = list(pool.map(one, paths))
    out.mkdir(parents=True, exist_ok=True)
    for report in reports:
        (out / f"{report['student']}.json").write_text(json.dumps(report, indent=2) + "\n")
    write_gradebook(out / "gradebook.csv", reports, assignments)
    return reports


def write_gradebook(path: Path, reports: list[dict], assignments: list[Assignment]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *(a.name for a in assignments), "total", "max", "sandboxed", "seed", "note"])
        for r in reports:
            points = {a["name"]: a["points"] for a in r["assignments"]}
            writer.writerow([r["student"], *(f"{points[a.name]:g}" for a in assignments), f"{r['points']:g}",
                             r["max_points"], "yes" if r["sandboxed"] else "no", r["seed"], r.get("note", "")])


def gradescope_results(report: dict, assignments: list[Assignment], hidden_visibility: str = "after_published",
                       note: str = "") -> dict:
    """Gradescope's results.json for one report: one test entry per assignment's visible tests
    (their failures' messages as output) and one per its hidden tests (a count only, shown to
    the student after grades are published)."""
    by_name = {r["name"]: r for r in report["assignments"]}
    tests = []
    for a in assignments:
        r = by_name[a.name]
        regions = [f["message"] for f in r["failures"] if f["test"] == "region"]
        if regions or r["tests"] == 0:
            tests.append({"name": f"{a.name}: your code", "score": 0.0, "max_score": float(a.points),
                          "output": "\n".join(regions) or "not graded", "visibility": "visible",
                          "status": "failed"})
            continue
        visible = r["tests"] - r["hidden_tests"]
        visible_passed = r["passed"] - r["hidden_passed"]
        share = a.points / r["tests"]
        lines = [f"{visible_passed} of {visible} tests passed"]
        lines += [f"{f['test']}: {f['message']}" for f in r["failures"] if f["test"] not in ("region", "hidden tests")]
        tests.append({"name": f"{a.name}: tests", "score": round(share * visible_passed, 4),
                      "max_score": round(share * visible, 4), "output": "\n".join(lines), "visibility": "visible",
                      "status": "passed" if visible_passed == visible else "failed"})
        if r["hidden_tests"]:
            tests.append({"name": f"{a.name}: hidden tests", "score": round(share * r["hidden_passed"], 4),
                          "max_score": round(share * r["hidden_tests"], 4),
                          "output": f"{r['hidden_passed']} of {r['hidden_tests']} hidden tests passed",
                          "visibility": hidden_visibility,
                          "status": "passed" if r["hidden_passed"] == r["hidden_tests"] else "failed"})
    output = [note] if note else []
    if not report["sandboxed"]:
        output.append("graded without the bubblewrap sandbox (it cannot run in this container)")
    return {"score": float(report["points"]), "max_score": float(report["max_points"]),
            "output": "\n".join(output), "visibility": "visible", "stdout_visibility": "hidden", "tests": tests}


SETUP_SH = """\
#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image (Ubuntu).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends python3 python3-venv python3-pip mpich libmpich-dev bubblewrap
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install --upgrade pip
# the instructor's tree, editable: the grader splices each submission into a copy of this tree
/autograder/venv/bin/pip install -e "/autograder/source/tree[dev]"
"""

RUN_AUTOGRADER = """\
#!/usr/bin/env bash
# Gradescope runs this for each submission. MINIDIST_AUTOGRADER_ROOT (default /autograder) and
# MINIDIST_AUTOGRADER_PYTHON (default its venv's python) let a test run it elsewhere.
set -uo pipefail
ROOT="${{MINIDIST_AUTOGRADER_ROOT:-/autograder}}"
PYTHON="${{MINIDIST_AUTOGRADER_PYTHON:-$ROOT/venv/bin/python}}"
TREE="$ROOT/source/tree"
rm -rf "$ROOT/work"
mkdir -p "$ROOT/work" "$ROOT/results"
cp -R "$ROOT/submission" "$ROOT/work/submission"
cd "$ROOT/work"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
PYTHONPATH="$TREE" "$PYTHON" -m minidist.assignments grade "$ROOT/work/submission" \\
    --format gradescope --out "$ROOT/results" --sandbox-if-available {only}
"""


def build_autograder(zip_path: Path, assignments: list[Assignment], root: Path | None = None) -> list[str]:
    """Write Gradescope's autograder zip: setup.sh and run_autograder at its root, and the
    instructor's tree (hidden tests included) under tree/. Returns the zip's file names."""
    root = root or repository_root()
    only = "--only " + " ".join(a.name for a in assignments)
    with tempfile.TemporaryDirectory(prefix="minidist-autograder-") as scratch:
        staging = Path(scratch)
        for name in AUTOGRADER_TREE:
            source = root / name
            if source.is_dir():
                shutil.copytree(source, staging / "tree" / name, ignore=SKIPPED)
            elif source.exists():
                (staging / "tree").mkdir(exist_ok=True)
                shutil.copy2(source, staging / "tree" / name)
        (staging / "setup.sh").write_text(SETUP_SH)
        (staging / "run_autograder").write_text(RUN_AUTOGRADER.format(only=only))
        names = []
        with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as z:
            for path in sorted(staging.rglob("*")):
                if path.is_file():
                    name = path.relative_to(staging).as_posix()
                    info = zipfile.ZipInfo(name)
                    info.compress_type = zipfile.ZIP_DEFLATED
                    executable = name in ("setup.sh", "run_autograder")
                    info.external_attr = ((0o100755 if executable else 0o100644) << 16)
                    z.writestr(info, path.read_bytes())
                    names.append(name)
    return names
