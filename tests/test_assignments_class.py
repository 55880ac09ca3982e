"""Grading a class and Gradescope (minidist/assignments/classroom.py).

Three made-up students and one bad archive, graded as a class on two quick assignments
(layer_partition: 1 point; mesh_groups: 2 points, hidden tests too): the correct one earns
everything, the partly right one and the tampering one (a conftest.py that marks every test
passed) the same honest point, and the archive with a `../evil` member is refused with 0. Then
Gradescope: the autograder zip is built and its run_autograder run on a fake /autograder."""
import csv
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile

import pytest
from conftest import hidden_rows

from minidist.assignments.classroom import UnsafeArchive, looks_like_class, safe_extract
from minidist.assignments import BY_NAME
from minidist.assignments.grade import graded_paths, sandbox_problem
from minidist.assignments.markers import build, repository_root

ROOT = repository_root()
NAMES = ["layer_partition", "mesh_groups"]
SANDBOX = sandbox_problem() is None
NO_SANDBOX = [] if SANDBOX else ["--no-sandbox"]
CHEATING_CONFTEST = """\
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
"""
MESH_HIDDEN = "hidden_tests/test_hidden_mesh.py"  # counted by hidden_rows when a test needs it
VISIBILITY = {"hidden", "after_due_date", "after_published", "visible"}


def restore(student, name):
    """Put the reference back into every file of `name`'s regions (each of these files holds the
    regions of one assignment only): what a student who solved it hands in."""
    for path in graded_paths(BY_NAME[name], ROOT):
        assert f"### BEGIN YOUR CODE assignment={name}" in (student / path).read_text()
        shutil.copy2(ROOT / path, student / path)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "student"
    build(out, NAMES)
    return out


@pytest.fixture(scope="module")
def classroom(built, tmp_path_factory):
    """submissions/: alice/ (correct), bob.zip (layer_partition only, in a folder of its own),
    carol/ (bob's answer and a cheating conftest.py), mallory.zip (a member ../evil)."""
    base = tmp_path_factory.mktemp("course")
    subs = base / "submissions"
    subs.mkdir()
    alice = shutil.copytree(built, subs / "alice")
    restore(alice, "layer_partition")
    restore(alice, "mesh_groups")
    bob = shutil.copytree(built, base / "bob")
    restore(bob, "layer_partition")
    carol = shutil.copytree(bob, subs / "carol")
    for folder in (carol, carol / "tests", carol / "minidist/assignments/checks"):
        (folder / "conftest.py").write_text(CHEATING_CONFTEST)
    shutil.make_archive(str(subs / "bob"), "zip", base, "bob")
    with zipfile.ZipFile(subs / "mallory.zip", "w") as z:
        z.write(alice / "minidist/__init__.py", "minidist/__init__.py")
        z.writestr("../evil", "pwned\n")
    proc = subprocess.run([sys.executable, "-m", "minidist.assignments", "grade", str(subs), "--class",
                           "--only", *NAMES, "--jobs", "2", "--seed", "7", *NO_SANDBOX],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return base, bob, proc


@pytest.mark.full  # grades a class
def test_the_gradebook_rows_are_exactly_right(classroom):
    base, _, proc = classroom
    with open(base / "grades" / "gradebook.csv", newline="") as f:
        rows = list(csv.reader(f))
    yes = "yes" if SANDBOX else "no"
    assert rows == [
        ["student", "layer_partition", "mesh_groups", "total", "max", "sandboxed", "seed", "note"],
        ["alice", "1", "2", "3", "3", yes, "7", ""],
        ["bob", "1", "0", "1", "3", yes, "7", ""],
        ["carol", "1", "0", "1", "3", yes, "7", ""],  # the cheating conftest.py earns nothing
        ["mallory", "0", "0", "0", "3", yes, "7",
         "archive refused: member '../evil' points outside the archive (..)"],
    ], proc.stdout
    assert not (base / "evil").exists() and not (base / "submissions" / "evil").exists()
    carol = json.loads((base / "grades" / "carol.json").read_text())
    assert carol["student"] == "carol" and carol["seed"] == 7 and carol["points"] == 1
    mesh = carol["assignments"][1]
    assert mesh["name"] == "mesh_groups" and mesh["passed"] == 0 and mesh["hidden_tests"] == hidden_rows(MESH_HIDDEN)
    assert sorted(p.name for p in (base / "grades").iterdir()) == [
        "alice.json", "bob.json", "carol.json", "gradebook.csv", "mallory.json"]


def test_unsafe_archive_members_are_refused(tmp_path):
    def tar_with(member):
        path = tmp_path / "s.tar.gz"
        with tarfile.open(path, "w:gz") as t:
            t.addfile(member, io.BytesIO(b"x") if member.isfile() else None)
        return path

    absolute = tarfile.TarInfo("/etc/evil")
    absolute.size = 1
    link = tarfile.TarInfo("minidist/link")
    link.type, link.linkname = tarfile.SYMTYPE, "../../outside"
    for member, why in ((absolute, "absolute path"), (link, "outside the archive")):
        with pytest.raises(UnsafeArchive, match=why):
            safe_extract(tar_with(member), tmp_path / "x")
    inside = tarfile.TarInfo("a/b/link")
    inside.type, inside.linkname = tarfile.SYMTYPE, "../c.py"
    safe_extract(tar_with(inside), tmp_path / "ok")
    assert (tmp_path / "ok/a/b/link").is_symlink()


@pytest.mark.full  # grades a class
def test_a_class_is_detected(classroom, built):
    base, _, _ = classroom
    assert looks_like_class(base / "submissions") and not looks_like_class(built)


def check_gradescope_shape(results):
    assert isinstance(results["score"], float) and isinstance(results["max_score"], float)
    assert results["visibility"] in VISIBILITY and isinstance(results["output"], str)
    assert results["tests"]
    for test in results["tests"]:
        assert {"name", "score", "max_score", "output", "visibility"} <= set(test)
        assert isinstance(test["name"], str) and isinstance(test["output"], str)
        assert isinstance(test["score"], (int, float)) and isinstance(test["max_score"], (int, float))
        assert 0 <= test["score"] <= test["max_score"] and test["visibility"] in VISIBILITY
        assert test.get("status", "passed") in ("passed", "failed")
    assert 0 <= results["score"] <= results["max_score"]
    assert abs(sum(t["score"] for t in results["tests"]) - results["score"]) < 0.01
    assert abs(sum(t["max_score"] for t in results["tests"]) - results["max_score"]) < 0.01


@pytest.mark.full  # grades a class
def test_the_autograder_zip_runs_on_a_fake_autograder_layout(classroom, tmp_path):
    base, bob, _ = classroom
    zip_path = tmp_path / "autograder.zip"
    proc = subprocess.run([sys.executable, "-m", "minidist.assignments", "gradescope", str(zip_path),
                           "--only", *NAMES], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    root = tmp_path / "autograder"
    with zipfile.ZipFile(zip_path) as z:
        names = set(z.namelist())
        assert {"setup.sh", "run_autograder", "tree/pyproject.toml", "tree/minidist/__init__.py",
                "tree/tests/conftest.py", "tree/hidden_tests/test_hidden_mesh.py", "tree/notebooks/09_frameworks.ipynb"} <= names
        assert stat.S_IMODE(z.getinfo("run_autograder").external_attr >> 16) & 0o111
        z.extractall(root / "source")
    setup = (root / "source/setup.sh").read_text()
    assert all(word in setup for word in ("python3", "mpich", "bubblewrap", "/autograder/source/tree"))
    shutil.copy(root / "source/run_autograder", root / "run_autograder")  # as Gradescope's image build does
    (root / "run_autograder").chmod(0o755)
    shutil.copytree(bob, root / "submission")
    env = {**os.environ, "MINIDIST_AUTOGRADER_ROOT": str(root), "MINIDIST_AUTOGRADER_PYTHON": sys.executable}
    run = subprocess.run([str(root / "run_autograder")], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads((root / "results/results.json").read_text())
    check_gradescope_shape(results)
    with open(base / "grades" / "gradebook.csv", newline="") as f:
        bob_row = next(row for row in csv.DictReader(f) if row["student"] == "bob")
    assert results["score"] == float(bob_row["total"]) == 1.0 and results["max_score"] == float(bob_row["max"])
    by_name = {t["name"]: t for t in results["tests"]}
    assert set(by_name) == {"layer_partition: tests", "layer_partition: hidden tests", "mesh_groups: tests",
                            "mesh_groups: hidden tests"}
    hidden = by_name["mesh_groups: hidden tests"]
    assert hidden["visibility"] in ("after_published", "hidden") and hidden["score"] == 0
    assert hidden["output"] == f"0 of {hidden_rows(MESH_HIDDEN)} hidden tests passed"
    assert "test_hidden" not in json.dumps(results) and "hidden_tests/" not in json.dumps(results)
    partition = [by_name[f"layer_partition: {kind}"] for kind in ("tests", "hidden tests")]
    assert all(t["score"] == t["max_score"] > 0 for t in partition)
    assert sum(t["score"] for t in partition) == pytest.approx(1, abs=1e-3)  # the point, cut by visible and hidden
    assert "NotImplementedError" in by_name["mesh_groups: tests"]["output"]
    assert (root / "submission/minidist/__init__.py").is_file()  # the submission itself is left as it was


def test_a_linked_file_is_not_read(tmp_path):
    """A folder submission whose file is a symbolic link (to the instructor's reference, say) earns
    nothing for that region: the grader reads only the student's own files."""
    from minidist.assignments import grade as grading
    from minidist.assignments.markers import repository_root
    from minidist.assignments.registry import ASSIGNMENTS
    assignment = next(a for a in ASSIGNMENTS if a.name == "layer_partition")
    root = repository_root()
    student = tmp_path / "student"
    for path in grading.graded_paths(assignment, root):
        (student / path).parent.mkdir(parents=True, exist_ok=True)
        (student / path).symlink_to(root / path)
    problems = grading.graded_copy(assignment, student, tmp_path / "tree")
    assert problems and all("symbolic link" in p for p in problems), problems
