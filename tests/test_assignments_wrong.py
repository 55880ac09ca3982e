"""No free points (DESIGN principle 8, a grader checked against hostile submissions): every
assignment ships wrong but plausible solutions in the instructor's tree (hidden_tests/wrong/),
each graded here like a student's and held to the largest share of the points it states; one
of them does nothing and must earn 0. And the forbidden-call check: a region that calls the
library's own answer earns nothing, with a message naming the call.

The grading runs are the slow part, 5 to 35 s each: the quick tier grades one wrong solution,
the full tier (CI) the do-nothing of the assignments graded without heavy mpiexec runs, and
`pytest --full --extended` all of them (about 10 minutes on 2 cores)."""
import pytest

from minidist.assignments import ASSIGNMENTS, BY_NAME
from minidist.assignments.forbidden import forbidden_uses
from minidist.assignments.grade import grade_one, graded_copy, graded_paths, sandbox_problem
from minidist.assignments.markers import all_regions, answers_in_text, notebook_answers, repository_root
from minidist.assignments.wrong import wrong_solutions

ROOT = repository_root()
SANDBOX = sandbox_problem() is None
WRONG = wrong_solutions()
QUICK = {("layer_partition", "do_nothing")}


def test_every_assignment_ships_three_wrong_solutions_one_of_which_does_nothing():
    by_assignment = {a.name: [w for w in WRONG if w.assignment == a.name] for a in ASSIGNMENTS}
    assert {w.assignment for w in WRONG} <= set(BY_NAME), "a wrong solution for an unknown assignment"
    for name, wrongs in by_assignment.items():
        assert len(wrongs) >= 3, f"{name}: {len(wrongs)} wrong solutions"
        do_nothing = [w for w in wrongs if w.name == "do_nothing"]
        assert do_nothing and do_nothing[0].max_share == 0, f"{name}: no do_nothing solution earning 0"
        assert all(0 <= w.max_share < 1 for w in wrongs), name


def test_the_instructors_guide_lists_every_wrong_solution_with_its_share():
    guide = (ROOT / "docs" / "instructors.md").read_text()
    for wrong in WRONG:
        assert f"| `{wrong.assignment}` | `{wrong.name}` |" in guide, f"docs/instructors.md lacks {wrong.path.name}"
        row = next(line for line in guide.splitlines() if line.startswith(f"| `{wrong.assignment}` | `{wrong.name}` |"))
        assert row.rstrip(" |").endswith(f"{wrong.max_share:g}"), row


def test_each_wrong_solution_has_one_region_per_reference_region():
    for wrong in WRONG:
        regions = [r for r in all_regions(ROOT) if r.name == wrong.assignment and r.kind == "solution"
                   and "#" not in r.path]
        answers = answers_in_text(wrong.path.read_text(), str(wrong.path)).get(wrong.assignment, [])
        assert len(answers) == len(regions), f"{wrong.path}: {len(answers)} regions, the reference has {len(regions)}"


def test_the_reference_uses_nothing_its_assignment_forbids():
    for assignment in ASSIGNMENTS:
        for path in graded_paths(assignment, ROOT):
            read = notebook_answers if path.endswith(".ipynb") else answers_in_text
            for number, (_, body) in enumerate(read((ROOT / path).read_text(), path)[assignment.name], 1):
                assert forbidden_uses("".join(body), assignment.forbidden, f"{path}, region {number}", "") == []


def test_calling_the_library_s_ring_earns_nothing_with_the_call_named(tmp_path):
    """The library's own reduce-scatter and all-gather make a correct ring all-reduce; as the
    student's answer they earn 0, before any test runs."""
    assignment = BY_NAME["ring_all_reduce"]
    path = graded_paths(assignment, ROOT)[0]
    text = (ROOT / path).read_text()
    body = answers_in_text(text, path)["ring_all_reduce"][0][1]
    start = text.index("".join(body))
    shortcut = ("    out = buf.copy()\n    yield from reduce_scatter_ring(ctx, out, op, buf[:0])\n"
                "    yield from all_gather_ring(ctx, buf, chunk_bounds(buf.size, ctx.size))\n")
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(text[:start] + shortcut + text[start + len("".join(body)):])
    problems = graded_copy(assignment, tmp_path, tmp_path / "copy")
    assert problems == [f"{path}, region 1, line 2: uses reduce_scatter_ring, the library's own answer: write it "
                        f"yourself ({assignment.where})"]
    assert grade_one(assignment, tmp_path, sandbox=SANDBOX)["points"] == 0


# graded under several real mpiexec jobs each, 8 to 25 s a grading: their do-nothing is in the extended tier
MPI_HEAVY = {"sendrecv", "ddp_bucket_hook", "tensor_parallel_f_g", "zero1_partition"}


def tier(wrong):
    """The quick tier grades one; the full tier the do-nothing of each assignment graded without a
    heavy mpiexec run (every graded test must fail for it); the rest in the extended tier."""
    if (wrong.assignment, wrong.name) in QUICK:
        return ()
    cheap = wrong.name == "do_nothing" and wrong.assignment not in MPI_HEAVY
    return pytest.mark.full if cheap else pytest.mark.extended


@pytest.mark.parametrize("wrong", [pytest.param(w, id=f"{w.assignment}-{w.name}", marks=tier(w)) for w in WRONG])
def test_a_wrong_solution_earns_at_most_its_share(wrong, tmp_path):
    from minidist.assignments.wrong import submission_of
    assignment = BY_NAME[wrong.assignment]
    student = submission_of(wrong, graded_paths(assignment, ROOT), tmp_path / "student")
    result = grade_one(assignment, student, sandbox=SANDBOX, test_timeout=60, run_timeout=240)
    share = result["points"] / assignment.points
    assert share <= wrong.max_share + 1e-9, (
        f"{wrong.path.name} ({wrong.why}) earned {share:.2f} > {wrong.max_share}: {result['failures']}")
