"""Run each assignment's graded tests against a student's copy, in a subprocess with that copy
first on the path; a test that hangs (a deadlock) fails with a message when its time is up."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from minidist.assignments.markers import repository_root
from minidist.assignments.registry import Assignment

TEST_TIMEOUT = 120      # seconds per test (pytest-timeout), then the whole run's limit below
RUN_TIMEOUT = 600


def _results(junit: Path) -> list[dict]:
    """One {test, passed, message} per test case in pytest's JUnit XML report."""
    rows = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = next((c for c in case if c.tag == "skipped"), None)
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        message = None
        if problem is not None:
            errors = [line.strip() for line in (problem.text or "").splitlines() if "Error" in line]
            first = " ".join((problem.get("message") or "failed").split())[:400]
            message = first + (f" | {errors[-1][:500]}" if errors and errors[-1] not in first else "")
        elif skipped is not None:  # a graded test that cannot run earns nothing
            message = "skipped: " + (skipped.get("message") or "").strip()[:480]
        rows.append({"test": name, "passed": message is None, "message": message})
    return rows


def grade_one(assignment: Assignment, student: Path, test_timeout: int = TEST_TIMEOUT,
              run_timeout: int = RUN_TIMEOUT) -> dict:
    """Points for one assignment: its share of graded tests that pass, times its points."""
    student = student.resolve()
    restore_hidden_tests(assignment, student)
    env = {**os.environ, **assignment.env, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(student), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    with tempfile.TemporaryDirectory() as scratch:
        junit = Path(scratch) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                   f"--rootdir={student}", f"--timeout={test_timeout}", f"--junitxml={junit}",
                   *assignment.tests, *assignment.hidden]
        # a session of its own, so that a hung mpiexec and its ranks go down with pytest
        proc = subprocess.Popen(command, cwd=student, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=run_timeout)
            rows = _results(junit) if junit.exists() else []
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            rows = []
            output = f"timed out after {run_timeout} s (a deadlock?)\n" + output
    if not rows:  # nothing ran: an import error, a collection error or the time limit
        last = [line for line in output.strip().splitlines() if line.strip()][-3:]
        rows = [{"test": test, "passed": False, "message": " | ".join(last)[:500] or "did not run"}
                for test in (*assignment.tests, *assignment.hidden)]
    passed = sum(row["passed"] for row in rows)
    return {"name": assignment.name, "chapter": assignment.chapter, "max_points": assignment.points,
            "points": round(assignment.points * passed / len(rows), 2), "passed": passed,
            "tests": len(rows), "failures": [row for row in rows if not row["passed"]]}


def restore_hidden_tests(assignment: Assignment, student: Path) -> None:
    """Put the instructor's hidden tests of `assignment` into the student's copy (a student build
    has none; a copy the student changed gets the instructor's files back)."""
    root = repository_root()
    for test in assignment.hidden:
        path = test.split("::")[0]
        source, target = root / path, student / path
        if source.resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def grade(assignments: list[Assignment], student: Path, **limits) -> dict:
    results = [grade_one(a, student, **limits) for a in assignments]
    return {"student": str(student.resolve()), "assignments": results,
            "points": round(sum(r["points"] for r in results), 2),
            "max_points": sum(r["max_points"] for r in results)}
