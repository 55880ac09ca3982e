"""Wrong but plausible solutions, kept in the instructor's tree (hidden_tests/wrong/<assignment>/),
each with the most it may earn: the proof that the graded tests give no free points.

A wrong solution is a file of regions, as a student would hand them in, after a docstring that
says what is wrong and the largest share of the assignment's points it may earn:

    '''Off by one chunk: each step sends the chunk it has just received, one too early.
    max share: 0.34'''
    ### BEGIN YOUR CODE assignment=ring_all_reduce
    ...
    ### END YOUR CODE

Its regions replace the assignment's regions, in order, in a copy of the reference file
(`submission_of`), which the grader then grades like any student's (tests/test_assignments_wrong.py)."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from minidist.assignments.markers import answers_in_text, repository_root, splice, stub_notebook

MAX_SHARE = re.compile(r"^max share:\s*([0-9.]+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class WrongSolution:
    assignment: str
    name: str          # the file's stem
    why: str           # the docstring's first line: what is wrong
    max_share: float   # the largest share of the points it may earn
    path: Path


def wrong_solutions(root: Path | None = None) -> list[WrongSolution]:
    """Every wrong solution in the instructor's tree, by assignment and name."""
    root = root or repository_root()
    found = []
    for path in sorted((root / "hidden_tests" / "wrong").glob("*/*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        share = MAX_SHARE.search(doc)
        if not share:
            raise ValueError(f"{path}: the docstring needs a line 'max share: <0..1>'")
        found.append(WrongSolution(path.parent.name, path.stem, doc.splitlines()[0], float(share[1]), path))
    return found


def submission_of(wrong: WrongSolution, paths: list[str], dest: Path, root: Path | None = None) -> Path:
    """A submission folder `dest` holding the assignment's graded files `paths`: its source file
    with the assignment's regions replaced by the wrong solution's, in order; a notebook whose
    exercise cell is part of the assignment left as the student copy has it, stubbed (a wrong
    solution earns nothing it did not write)."""
    root = root or repository_root()
    answers = answers_in_text(wrong.path.read_text(), str(wrong.path)).get(wrong.assignment, [])
    sources = [path for path in paths if not path.endswith(".ipynb")]
    if len(sources) != 1:
        raise ValueError(f"{wrong.assignment}: a wrong solution file covers one source file, not {sources}")
    for path in paths:
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        text = (root / path).read_text()
        target.write_text(stub_notebook(text, {wrong.assignment}) if path.endswith(".ipynb")
                          else splice(text, wrong.assignment, answers, path))
    return dest
