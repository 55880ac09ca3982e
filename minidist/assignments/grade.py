"""Grade only what the student wrote: for each assignment, its regions are taken out of the
submission and spliced into a fresh copy of the instructor's tree, whose graded tests then run in
a subprocess (under bubblewrap where it is installed; see docs/instructors.md). Nothing else of
the submission is run or imported: not its tests, conftest.py, checks, or any other file.

Hidden tests are copied into that temporary copy only, in a run of their own, and reported as
counts: their names, parameters and messages stay with the instructor. A test that hangs (a
deadlock) fails with a message when its time is up."""
from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from minidist.assignments.forbidden import forbidden_uses
from minidist.assignments.markers import (SKIPPED, RegionError, all_regions, answers_in_text, notebook_answers,
                                          repository_root, splice, splice_notebook)
from minidist.assignments.registry import Assignment

TEST_TIMEOUT = 120      # seconds per test (pytest-timeout)
RUN_TIMEOUT = 600       # seconds per pytest run (the visible tests, then the hidden ones)
CPU_SECONDS = 900       # RLIMIT_CPU of each process of a run (its ranks included)
ADDRESS_SPACE = 16 << 30  # RLIMIT_AS of each process of a run, bytes
FILE_SIZE = 1 << 30     # RLIMIT_FSIZE: the largest file a run may write, bytes
MESSAGE_LIMIT = 1200    # characters of a failure's message in the report
GRADED_TREE = ("minidist", "tests", "notebooks", "pyproject.toml")  # what the graded tests need of the instructor's tree
INSTALL_BWRAP = "install bubblewrap (apt-get install bubblewrap) or pass --no-sandbox to grade unsandboxed"
INSIDE = "/grading"     # where the copy is mounted in the sandbox


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot run here (one line, saying how to install it)."""


def sandbox_problem() -> str | None:
    """None if bubblewrap runs here (a user namespace, no network), else why not, in one line."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return f"bubblewrap (bwrap) is not installed: {INSTALL_BWRAP}"
    proc = subprocess.run([bwrap, "--ro-bind", "/", "/", "--unshare-all", "--dev", "/dev", "--proc", "/proc", "true"],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        why = " ".join(proc.stderr.split())[:200] or f"exit {proc.returncode}"
        return f"bubblewrap cannot make a sandbox here ({why}): allow user namespaces, or pass --no-sandbox"
    return None


def _bwrap_command(tree: Path, out: Path) -> list[str]:
    """bubblewrap's arguments: the system and Python read-only, the copy read-only at INSIDE, its
    output folder writable, a fresh /tmp, /dev and /proc, no network, no other process, nothing
    else of the machine (not the instructor's tree, not a home folder)."""
    command = [shutil.which("bwrap"), "--unshare-all", "--die-with-parent", "--new-session",
               "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    system = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    for path in system + sorted(python):
        if Path(path).exists():
            command += ["--ro-bind", path, path]
    return command + ["--ro-bind", str(tree), INSIDE, "--bind", str(out), f"{INSIDE}-out", "--chdir", INSIDE]


def _limits(cpu: int = CPU_SECONDS, memory: int = ADDRESS_SPACE) -> None:
    """In the child before it runs pytest: a session of its own (a hung mpiexec and its ranks go
    down with it) and resource limits, inherited by every process it starts."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE, FILE_SIZE))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def cut(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` on one line, at most `limit` characters, cut at a word boundary with an ellipsis."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = text[:limit - 1]
    return (head.rsplit(" ", 1)[0] if " " in head else head) + " …"


RANK_EXCEPTION = re.compile(r"\[rank (\d+)\] ((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Timeout|Exit|Interrupt|"
                            r"Warning)\w*(?::.*)?)$")


def failure_message(problem) -> str:
    """One line for a failed test: a failing rank's own exception first (the first rank to raise,
    with how many others did), then pytest's message, then the last error line of the traceback."""
    text = problem.text or ""
    ranks = {}
    for line in text.splitlines():
        found = RANK_EXCEPTION.search(line.strip().removeprefix("E").strip())
        if found and found[1] not in ranks:
            ranks[found[1]] = found[2]
    head = " ".join((problem.get("message") or "failed").split("\n[rank")[0].split())
    parts = []
    if ranks:
        rank, exception = next(iter(ranks.items()))
        others = f" (and {len(ranks) - 1} other rank(s))" if len(ranks) > 1 else ""
        parts.append(f"rank {rank}: {exception}{others}")
    parts.append(head)
    errors = [line.strip() for line in text.splitlines() if "Error" in line and "[rank" not in line]
    if errors and errors[-1].lstrip("E ").strip() not in " ".join(parts):
        parts.append(errors[-1].lstrip("E ").strip())
    return cut(" | ".join(parts))


def _results(junit: Path) -> list[dict]:
    """One {test, passed, message} per test case in pytest's JUnit XML report."""
    rows = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = next((c for c in case if c.tag == "skipped"), None)
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        message = None
        if problem is not None:
            message = failure_message(problem)
        elif skipped is not None:  # a graded test that cannot run earns nothing
            message = cut("skipped: " + (skipped.get("message") or ""))
        rows.append({"test": name, "passed": message is None, "message": message})
    return rows


def graded_paths(assignment: Assignment, root: Path | None = None) -> list[str]:
    """The files holding the regions a student writes for `assignment` (sources and notebooks)."""
    return sorted({r.path.split("#")[0] for r in all_regions(root) if r.name == assignment.name
                   and r.kind == "solution"})


def graded_copy(assignment: Assignment, student: Path, dest: Path, root: Path | None = None,
                hidden: bool = False) -> list[str]:
    """Write into `dest` the instructor's tree (GRADED_TREE, and hidden_tests/ if `hidden`) with
    the regions of `assignment` taken from the submission `student`. Returns one line per region
    that could not be taken (missing, malformed, or using what the assignment forbids: forbidden.py);
    nothing of the submission is copied then."""
    root = root or repository_root()
    for name in GRADED_TREE + (("hidden_tests",) if hidden else ()):
        source = root / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=SKIPPED)
        elif source.exists():
            shutil.copy2(source, dest / name)
    problems, spliced = [], {}
    for path in graded_paths(assignment, root):
        try:
            submitted = student / path
            if not submitted.is_file():
                raise RegionError(f"{path}: missing from the submission")
            if any(part.is_symlink() for part in (submitted, *submitted.parents) if student in (part, *part.parents)):
                raise RegionError(f"{path}: a symbolic link in the submission (only the student's own files are "
                                  "read; a link could point at the reference)")
            notebook = path.endswith(".ipynb")
            read = notebook_answers if notebook else answers_in_text
            try:
                answers = read(submitted.read_text(errors="replace"), path).get(assignment.name)
            except RegionError:
                raise
            except (ValueError, KeyError, TypeError) as error:  # JSONDecodeError is a ValueError
                raise RegionError(f"{path}: not a notebook the grader can read ({error})") from None
            if not answers:
                raise RegionError(f"{path}: no region of {assignment.name}: keep its '### BEGIN YOUR CODE "
                                  f"assignment={assignment.name}' and '### END YOUR CODE' lines around your code")
            for number, (_, body) in enumerate(answers, 1):
                problems += forbidden_uses("".join(body), assignment.forbidden, f"{path}, region {number}",
                                           f"write it yourself ({assignment.where})")
            spliced[path] = (splice_notebook if notebook else splice)((root / path).read_text(), assignment.name,
                                                                      answers, path)
        except RegionError as problem:
            problems.append(str(problem))
    if not problems:
        for path, text in spliced.items():
            (dest / path).write_text(text)
    return problems


def _run(tests: tuple[str, ...], tree: Path, out: Path, env: dict, sandbox: bool, test_timeout: int,
         run_timeout: int) -> list[dict]:
    """Run pytest on `tests` in `tree`; the rows of its report, or one failed row per node id
    (with the output's last lines) when nothing ran."""
    inside, report = (INSIDE, f"{INSIDE}-out/report.xml") if sandbox else (str(tree), str(out / "report.xml"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--rootdir={inside}", f"--timeout={test_timeout}", f"--junitxml={report}", *tests]
    if sandbox:
        command = _bwrap_command(tree, out) + command
    env = {**env, "PYTHONPATH": inside}
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: _limits(cpu=max(CPU_SECONDS, run_timeout)))
    try:
        output, _ = proc.communicate(timeout=run_timeout)
        rows = _results(out / "report.xml") if (out / "report.xml").exists() else []
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        rows = []
        output += f"\ntimed out after {run_timeout} s (a deadlock?)"
    if not rows:  # nothing ran: an import error, a collection error or the time limit
        last = [line for line in output.strip().splitlines() if line.strip()][-3:]
        rows = [{"test": test, "passed": False, "message": cut(" | ".join(last)) or "did not run"} for test in tests]
    return rows


def _environment(assignment: Assignment) -> dict:
    """What a graded run sees of the environment: not the grader's own (its PYTHONPATH, its home)."""
    keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TERM") or k.startswith("MINIDIST_")}
    path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"])
    return {**keep, "PATH": path, "HOME": "/tmp", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            **assignment.env}


def grade_one(assignment: Assignment, student: Path, test_timeout: int = TEST_TIMEOUT,
              run_timeout: int = RUN_TIMEOUT, sandbox: bool = True) -> dict:
    """Points for one assignment: its share of graded tests that pass (visible and hidden), times
    its points. A region missing or malformed in the submission earns nothing, with one line each."""
    student = student.resolve()
    env = _environment(assignment)
    result = {"name": assignment.name, "chapter": assignment.chapter, "max_points": assignment.points,
              "points": 0, "passed": 0, "tests": len(assignment.tests) + len(assignment.hidden),
              "hidden_passed": 0, "hidden_tests": 0, "sandboxed": sandbox, "failures": []}
    with tempfile.TemporaryDirectory(prefix=f"minidist-grade-{assignment.name}-") as scratch:
        tree, out = Path(scratch) / "tree", Path(scratch) / "out"
        tree.mkdir()
        out.mkdir()
        problems = graded_copy(assignment, student, tree, hidden=bool(assignment.hidden))
        if problems:
            result["failures"] = [{"test": "region", "passed": False, "message": p} for p in problems]
            return result
        # one run for the visible and the hidden tests; the hidden ones' rows are only counted
        ran = _run(tuple(assignment.tests) + tuple(assignment.hidden), tree, out, env, sandbox, test_timeout,
                   run_timeout)
    hidden_rows = [row for row in ran if row["test"].startswith("hidden_tests/")]
    rows = [row for row in ran if not row["test"].startswith("hidden_tests/")]
    hidden_passed = sum(row["passed"] for row in hidden_rows)
    failures = [row for row in rows if not row["passed"]]
    if hidden_passed < len(hidden_rows):  # a count only: names, parameters and messages stay hidden
        failures.append({"test": "hidden tests", "passed": False,
                         "message": f"{len(hidden_rows) - hidden_passed} of {len(hidden_rows)} hidden tests failed"})
    passed = sum(row["passed"] for row in rows) + hidden_passed
    total = len(rows) + len(hidden_rows)
    return {**result, "points": round(assignment.points * passed / total, 2), "passed": passed, "tests": total,
            "hidden_passed": hidden_passed, "hidden_tests": len(hidden_rows), "failures": failures}


def grade(assignments: list[Assignment], student: Path, sandbox: bool = True, **limits) -> dict:
    """Grade each assignment of `student`; `sandbox`: under bubblewrap (SandboxUnavailable if it
    cannot run here), else unsandboxed, as the report then says."""
    if sandbox and (problem := sandbox_problem()):
        raise SandboxUnavailable(problem)
    results = [grade_one(a, student, sandbox=sandbox, **limits) for a in assignments]
    return {"student": str(student.resolve()), "sandboxed": sandbox, "assignments": results,
            "points": round(sum(r["points"] for r in results), 2),
            "max_points": sum(r["max_points"] for r in results)}
