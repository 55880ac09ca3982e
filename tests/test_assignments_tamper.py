"""The grader against hostile submissions (DESIGN principle 8): only the code between a region's
markers is graded, spliced into a fresh copy of the instructor's tree; the submission's tests,
conftest.py and checks never run; under bubblewrap the graded code cannot see the instructor's
tree (the reference); hidden tests never reach the student's folder; and the messages and the
command line hold up (grading from inside the folder, building into the source tree, a deadlock).

One student build (three assignments stubbed) is made per module; each test edits a copy of it
and grades only the cheap assignments."""
import json
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import hidden_rows

from minidist.assignments import BY_NAME
from minidist.assignments.grade import cut, failure_message, grade, graded_copy, sandbox_problem
from minidist.assignments.markers import build, repository_root

ROOT = repository_root()
MESH_HIDDEN = "hidden_tests/test_hidden_mesh.py"  # counted by hidden_rows when a test needs it
STUBBED = ["layer_partition", "mesh_groups", "sendrecv"]
SANDBOX_PROBLEM = sandbox_problem()
SANDBOX = SANDBOX_PROBLEM is None  # the other tests run unsandboxed where bubblewrap cannot
STUB = '    # YOUR CODE HERE\n    raise NotImplementedError("YOUR CODE HERE")\n'
PARTITION = """\
    sizes = [n_layer // stages + (r < n_layer % stages) for r in range(stages)]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(bounds[r]), int(bounds[r + 1])) for r in range(stages)]
"""
CHEATING_CONFTEST = """\
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "student"
    build(out, STUBBED)
    return out


@pytest.fixture
def student(built, tmp_path):
    copy = tmp_path / "student"
    shutil.copytree(built, copy)
    return copy


def answer(student, path, body, replace=None):
    """Write `body` in place of the stub of the (single) stubbed region of `path` (or of the
    answer `replace` written there before)."""
    file = student / path
    text = file.read_text()
    old = STUB if replace is None else textwrap.indent(textwrap.dedent(replace), "    ")
    assert text.count(old) == 1
    file.write_text(text.replace(old, textwrap.indent(textwrap.dedent(body), "    ")))


def points(student, names, sandbox=SANDBOX):
    report = grade([BY_NAME[name] for name in names], student, sandbox=sandbox)
    return {r["name"]: r["points"] for r in report["assignments"]}, report


def test_a_cheating_conftest_edited_tests_and_checks_earn_nothing_extra(student):
    """The same submission earns the same with a conftest.py that marks every report passed (at
    its root, in tests/ and in the checks) and with its tests and checks edited to pass."""
    answer(student, "minidist/parallel/pipeline_stage.py", PARTITION)
    honest, _ = points(student, ["layer_partition", "mesh_groups"])
    assert honest == {"layer_partition": 1, "mesh_groups": 0}  # the right partition, mesh_groups still a stub
    for folder in (student, student / "tests", student / "minidist/assignments/checks"):
        (folder / "conftest.py").write_text(CHEATING_CONFTEST)
    cheating, report = points(student, ["layer_partition", "mesh_groups"])
    assert cheating == honest, report
    for conftest in (student, student / "tests", student / "minidist/assignments/checks"):
        (conftest / "conftest.py").unlink()
    (student / "tests/test_mesh.py").write_text("def test_layout_groups_partition_the_world():\n    pass\n\n"
                                                "def test_layout_of_eight_ranks_is_megatrons():\n    pass\n")
    (student / "minidist/assignments/checks/test_partition.py").write_text("def test_x():\n    pass\n")
    (student / "hidden_tests").mkdir()
    (student / "hidden_tests/test_hidden_mesh.py").write_text("def test_x():\n    pass\n")
    edited, report = points(student, ["layer_partition", "mesh_groups"])
    assert edited == honest, report
    mesh = report["assignments"][1]
    assert mesh["passed"] == 0 and mesh["tests"] > 2 and mesh["hidden_tests"] == hidden_rows(MESH_HIDDEN) > 3  # the instructor's ran


@pytest.mark.full  # the quick tier grades one tampered copy
def test_code_outside_the_regions_is_not_graded(student):
    """A correct function written outside the markers (the stub left in place) earns nothing."""
    file = student / "minidist/parallel/pipeline_stage.py"
    file.write_text(file.read_text() + "\n\ndef partition(n_layer, stages):\n" + PARTITION)
    assert points(student, ["layer_partition"])[0] == {"layer_partition": 0}


REFERENCE_THIEF = """\
import json, pathlib, runpy
import numpy
info = next(pathlib.Path(numpy.__file__).parents[1].glob("minidist-*.dist-info"))
url = json.loads((info / "direct_url.json").read_text())["url"]
source = pathlib.Path(url.removeprefix("file://")) / "minidist/parallel/pipeline_stage.py"
return runpy.run_path(str(source))["partition"](n_layer, stages)
"""
# the same theft by importlib, which the ast check turns away before any test runs
IMPORTLIB_THIEF = """\
from importlib import metadata
return metadata
"""


@pytest.mark.full  # the quick tier grades one tampered copy
def test_the_reference_is_out_of_reach_in_the_sandbox(student):
    """A region that finds the instructor's tree through the installed package's metadata and
    calls the reference from it: that earns the point unsandboxed (so the test can fail), and
    nothing under bubblewrap, where the tree is not there."""
    if not SANDBOX:
        pytest.skip(f"the sandbox is unavailable: {SANDBOX_PROBLEM}")
    answer(student, "minidist/parallel/pipeline_stage.py", REFERENCE_THIEF)
    assert points(student, ["layer_partition"], sandbox=False)[0] == {"layer_partition": 1}
    got, report = points(student, ["layer_partition"], sandbox=True)
    assert got == {"layer_partition": 0} and report["sandboxed"]
    assert "No such file" in report["assignments"][0]["failures"][0]["message"], report  # the tree is not there
    answer(student, "minidist/parallel/pipeline_stage.py", IMPORTLIB_THIEF, replace=REFERENCE_THIEF)
    got, report = points(student, ["layer_partition"], sandbox=False)
    assert got == {"layer_partition": 0}
    assert report["assignments"][0]["failures"][0]["message"].endswith(
        "line 1: uses importlib, which no assignment needs (graded code may not reach other code by a string, "
        "a file or the system)"), report


@pytest.mark.full  # the quick tier grades one tampered copy
def test_hidden_tests_stay_with_the_instructor(student):
    _, report = points(student, ["mesh_groups"])
    assert not (student / "hidden_tests").exists()
    assert not [p for p in student.rglob("*") if "hidden" in p.name]
    mesh = report["assignments"][0]
    assert mesh["hidden_tests"] == hidden_rows(MESH_HIDDEN) and mesh["hidden_passed"] == 0
    assert "hidden" not in json.dumps([f for f in mesh["failures"] if f["test"] != "hidden tests"])
    assert "test_hidden" not in json.dumps(report["assignments"])  # a count, no names
    assert mesh["failures"][-1] == {"test": "hidden tests", "passed": False,
                                    "message": f"{hidden_rows(MESH_HIDDEN)} of {hidden_rows(MESH_HIDDEN)} hidden tests failed"}


@pytest.mark.full  # the quick tier grades one tampered copy
def test_a_missing_or_broken_region_earns_nothing_with_one_line_each(student, tmp_path):
    file = student / "minidist/parallel/pipeline_stage.py"
    file.write_text(file.read_text().replace("    ### END YOUR CODE\n", "", 1))
    got, report = points(student, ["layer_partition"])
    assert got == {"layer_partition": 0}
    [failure] = report["assignments"][0]["failures"]
    assert failure["test"] == "region" and "never closed" in failure["message"] and "\n" not in failure["message"]
    (student / "minidist/parallel/mesh.py").unlink()
    assert graded_copy(BY_NAME["mesh_groups"], student, tmp_path / "copy") == [
        "minidist/parallel/mesh.py: missing from the submission"]


@pytest.mark.full  # the quick tier grades one tampered copy
def test_grading_from_inside_the_student_folder(student):
    answer(student, "minidist/parallel/pipeline_stage.py", PARTITION)
    command = [sys.executable, "-m", "minidist.assignments", "grade", ".", "--only", "layer_partition", "mesh_groups",
               "--json", "report.json"] + ([] if SANDBOX else ["--no-sandbox"])
    proc = subprocess.run(command, cwd=student, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((student / "report.json").read_text())
    assert report["points"] == 1 and "1/1" in proc.stdout, proc.stdout
    assert report["assignments"][1]["hidden_tests"] == hidden_rows(MESH_HIDDEN)  # the instructor's tree's, not the folder's copy


def test_building_into_the_source_tree_is_refused_in_one_line():
    for out in (ROOT, ROOT / "build" / "student-copy"):
        proc = subprocess.run([sys.executable, "-m", "minidist.assignments", "build", str(out)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "inside the source tree" in proc.stderr and not (ROOT / "build" / "student-copy").exists()


def test_building_over_another_checkout_is_refused_and_a_student_copy_builds_again(tmp_path):
    other = tmp_path / "another-checkout"  # e.g. a second clone with work in it, not the installed one
    work = other / "minidist" / "core" / "fused_fast.py"
    work.parent.mkdir(parents=True)
    work.write_text("# work not yet committed\n")
    proc = subprocess.run([sys.executable, "-m", "minidist.assignments", "build", str(other), "--only", "mesh_groups"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "not empty and not a student copy" in proc.stderr
    assert [p.relative_to(other).as_posix() for p in sorted(other.rglob("*"))] == [
        "minidist", "minidist/core", "minidist/core/fused_fast.py"] and work.read_text() == "# work not yet committed\n"
    student = tmp_path / "student"
    build(student, ["mesh_groups"])
    (student / "my-notes.txt").write_text("mine")
    build(student, ["mesh_groups"])  # a student copy is built again in place; what else is there stays
    assert (student / "my-notes.txt").read_text() == "mine" and (student / "minidist" / "parallel" / "mesh.py").exists()


@pytest.mark.full  # the quick tier grades one tampered copy
def test_without_bubblewrap_grading_is_refused_unless_asked(student, tmp_path):
    bare = tmp_path / "bin"  # a PATH without bwrap
    bare.mkdir()
    command = [sys.executable, "-m", "minidist.assignments", "grade", str(student), "--only", "sendrecv"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env={"PATH": str(bare)},
                          cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "apt-get install bubblewrap" in proc.stderr and "--no-sandbox" in proc.stderr


def test_a_message_is_cut_at_a_word_with_an_ellipsis():
    assert cut("short  and\nsimple") == "short and simple"
    long = cut("word " * 400, limit=100)
    assert len(long) <= 100 and long.endswith("word …")


def test_a_failing_rank_s_exception_comes_first_in_the_message():
    """failure_message on a deadlock's JUnit failure as the graded run writes it: the first rank's
    own exception, how many others raised, then pytest's message."""
    import xml.etree.ElementTree as ElementTree
    failure = ElementTree.Element("failure", message="minidist.comm.launch.RankError: 2 ranks failed")
    failure.text = ("E   minidist.comm.launch.RankError: 2 ranks failed\n"
                    "E   [rank 1] Traceback (most recent call last):\n"
                    "E   [rank 1] minidist.comm.errors.CommTimeout: rank 1 of 2 (world rank 1) timed out after 5.0 s\n"
                    "E   [rank 0] minidist.comm.errors.CommTimeout: rank 0 of 2 (world rank 0) timed out after 5.0 s\n")
    message = failure_message(failure)
    assert message.startswith("rank 1: minidist.comm.errors.CommTimeout: rank 1 of 2 (world rank 1) timed out")
    assert "(and 1 other rank(s))" in message and "RankError: 2 ranks failed" in message and "\n" not in message


@pytest.mark.extended  # 40 s of deadlocks timing out; the message's parts: the test above
def test_a_deadlock_reports_the_ranks_exception_first(student):
    answer(student, "minidist/comm/p2p.py", """\
        send(send_array, dst, tag, group, timeout)  # blocking: every rank waits for its neighbour
        recv(recv_array, src, tag, group, timeout)
        return recv_array
        """)
    got, report = points(student, ["sendrecv"])
    assert got["sendrecv"] <= 0.4  # small messages get through (hidden tests), the visible ring of large ones not
    failure = report["assignments"][0]["failures"][0]
    assert re.match(r"rank (\d): minidist\.comm\.errors\.CommTimeout: rank \1 of 2 ", failure["message"]), failure
    assert "(and 1 other rank(s))" in failure["message"] and "RankError" in failure["message"]
