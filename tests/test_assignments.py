"""The course assignments (minidist/assignments): markers, student builds, and grading.

Grading runs each assignment's graded tests in a subprocess against a copy of the repository:
the reference earns every point, a full student build none, and a build with one solution
restored earns exactly that assignment's points."""
import json
import subprocess
import sys

import pytest

from minidist.assignments import ASSIGNMENTS, BY_NAME
from minidist.assignments.grade import grade, sandbox_problem
from minidist.assignments.markers import _regions_in_text, all_regions, build, regions_in, repository_root

ROOT = repository_root()
NAMES = [a.name for a in ASSIGNMENTS]
SANDBOX = sandbox_problem() is None  # under bubblewrap where it runs (tests/test_assignments_tamper.py)


def test_markers_parse_and_every_region_is_a_registered_assignment():
    regions = all_regions()
    assert len(ASSIGNMENTS) == 11
    assert {r.name for r in regions} == set(NAMES)  # every region registered, every assignment marked
    assert all(r.begin < r.end for r in regions)


def test_a_notebook_exercise_cell_is_stubbed_like_the_source(tmp_path):
    build(tmp_path, ["mesh_groups"])
    notebook = json.loads((tmp_path / "notebooks/09_frameworks.ipynb").read_text())
    sources = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    exercise = next(source for source in sources if "def my_coordinates" in source)
    assert 'raise NotImplementedError("YOUR CODE HERE")' in exercise and "divmod" not in exercise
    assert "BEGIN SOLUTION" not in "".join(sources)
    assert len(notebook["cells"]) == len(json.loads((ROOT / "notebooks/09_frameworks.ipynb").read_text())["cells"])


def test_an_unclosed_region_names_its_line(tmp_path):
    (tmp_path / "bad.py").write_text("x = 1\n    ### BEGIN SOLUTION assignment=adamw_update\n    y = 2\n")
    with pytest.raises(ValueError, match="bad.py:2: .* never closed"):
        regions_in(tmp_path / "bad.py", tmp_path)


def test_build_of_one_assignment_stubs_exactly_its_regions_and_stays_importable(tmp_path):
    stubbed = build(tmp_path, ["one_f_one_b"])
    assert [r.name for r in stubbed] == ["one_f_one_b"] * 2  # the warm-up and the 1F1B order
    assert not (tmp_path / "hidden_tests").exists()  # the instructor's hidden tests stay behind
    source = (tmp_path / "minidist/parallel/schedules.py").read_text()
    assert source.count('raise NotImplementedError("YOUR CODE HERE")') == 2
    assert "        # YOUR CODE HERE\n" not in source and "    # YOUR CODE HERE\n" in source  # indentation kept
    assert "BEGIN SOLUTION" not in source
    # everything else is complete: the other regions keep their code and markers
    assert {r.name for r in all_regions(tmp_path)} == set(NAMES) - {"one_f_one_b"}
    check = ("import minidist.parallel.schedules as s, minidist.comm.algorithms, minidist.core.optim, "
             "minidist.parallel.data_parallel, minidist.parallel.tensor_layers\n"
             "assert s.__file__.startswith(%r)\n"
             "try:\n    list(s.one_f_one_b(0, 2, 2))\nexcept NotImplementedError as e:\n    print(e)\n" % str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "YOUR CODE HERE", proc.stderr


def points(report):
    assert len(report["assignments"]) == len(ASSIGNMENTS)
    return {r["name"]: r["points"] for r in report["assignments"]}


def test_every_graded_test_is_in_the_quick_tier():
    """The grader runs plain `pytest` on the graded node ids: a graded test marked `full` would be
    deselected there and earn nothing (tests/conftest.py)."""
    graded = [test for a in ASSIGNMENTS for test in a.tests if test.startswith("tests/")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", *graded], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert graded and "deselected" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.full  # grades every assignment: runs their tests, some under mpiexec
def test_the_reference_earns_every_point():
    report = grade(ASSIGNMENTS, ROOT, sandbox=SANDBOX)
    assert points(report) == {a.name: a.points for a in ASSIGNMENTS}, report
    assert report["points"] == report["max_points"] == sum(a.points for a in ASSIGNMENTS)


RESTORED = ("one_f_one_b", "tensor_parallel_f_g")  # one without MPI, one with
STUBBED = ("adamw_update", "moe_capacity")  # the do-nothing tests grade each stub's twin


@pytest.mark.full
def test_a_student_build_earns_exactly_what_it_restores_and_the_report_says_why(tmp_path):
    """A build with every assignment stubbed but two, graded on those two and two stubbed ones:
    the two earn every point, the others none, each failing test with its message, and hidden
    tests as a count. (Every assignment's stub is graded in tests/test_assignments_wrong.py, as
    its do-nothing twin.)"""
    build(tmp_path / "student", [name for name in NAMES if name not in RESTORED])
    out = tmp_path / "report.json"
    graded = [name for name in NAMES if name in RESTORED + STUBBED]
    proc = subprocess.run([sys.executable, "-m", "minidist.assignments", "grade", str(tmp_path / "student"),
                           "--only", *graded, "--json", str(out), *([] if SANDBOX else ["--no-sandbox"])],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert {r["name"]: r["points"] for r in report["assignments"]} == {
        name: (BY_NAME[name].points if name in RESTORED else 0) for name in graded}
    for result in report["assignments"]:
        if result["name"] in RESTORED:
            assert result["failures"] == [] and result["passed"] == result["tests"]
            continue
        visible = [f for f in result["failures"] if f["test"] != "hidden tests"]
        assert result["passed"] == result["hidden_passed"] == 0 and result["tests"] >= 1
        assert len(visible) == result["tests"] - result["hidden_tests"] >= 1
        if result["hidden_tests"]:  # hidden tests: a count, not their names
            assert result["failures"][-1]["message"].startswith(f"{result['hidden_tests']} of ")
        assert all(f["message"] for f in result["failures"]), result["failures"]
    assert sum("YOUR CODE HERE" in f["message"] for r in report["assignments"] for f in r["failures"]) >= 2
    restored, most = sum(BY_NAME[name].points for name in RESTORED), sum(BY_NAME[name].points for name in graded)
    assert "total" in proc.stdout and f"{restored}/{most}" in proc.stdout.replace(".0/", "/"), proc.stdout


def test_list_and_bad_names_on_the_command_line(tmp_path):
    listed = subprocess.run([sys.executable, "-m", "minidist.assignments", "list"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and all(name in listed.stdout for name in NAMES)
    bad = subprocess.run([sys.executable, "-m", "minidist.assignments", "build", str(tmp_path / "x"),
                          "--only", "magic"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "magic" in bad.stderr
    assert not (tmp_path / "x").exists()



def source_text(file) -> str:
    """A file's text; a notebook's code cells, one after the other."""
    text = file.read_text()
    if file.suffix == ".ipynb":
        return "\n".join("".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "code")
    return text


def test_a_student_build_holds_no_answer(tmp_path):
    """Every code line of every region (the answers, and their second copies such as a fast
    kernel's) that appears nowhere else in the instructor's tree must appear nowhere in a full
    student build: no copy of an answer survives in a helper, a notebook or a test."""
    build(tmp_path, NAMES)
    inside, outside = set(), set()
    for file in [f for part in ("minidist", "tests", "notebooks") for f in (ROOT / part).rglob("*")
                 if f.suffix in (".py", ".ipynb") and "__pycache__" not in f.parts and "assignments" not in f.parts
                 and not f.name.startswith("test_assignments")]:
        text = source_text(file)
        marked = {n for r in _regions_in_text(text, file.name) for n in range(r.begin, r.end - 1)}
        for number, line in enumerate(text.splitlines()):
            code = line.split("#")[0].strip()
            if len(code) >= 20:
                (inside if number in marked else outside).add(code)
    distinctive = inside - outside
    assert len(distinctive) >= 40
    leaks = [f"{file.relative_to(tmp_path)}: {line}" for file in tmp_path.rglob("*")
             if file.suffix in (".py", ".ipynb", ".md") and file.is_file()
             for line in distinctive if line in source_text(file)]
    assert leaks == []
