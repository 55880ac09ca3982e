"""Find the solution regions in the source, write a student copy with each one stubbed out, and
put a student's regions back into a pristine copy of the source (what the grader runs).

In the instructor's tree a region is marked `### BEGIN SOLUTION assignment=<name>` ...
`### END SOLUTION`. In a student copy each stubbed region keeps markers of its own,
`### BEGIN YOUR CODE assignment=<name>` ... `### END YOUR CODE`: only the lines between them are
graded, spliced into the instructor's source in place of the reference.

A second copy of an answer elsewhere in the library (the fast kernel of the same equations) is
marked `### BEGIN REFERENCE assignment=<name> stub=<one line>` ... `### END REFERENCE`: the
student copy holds the one line instead (e.g. a call of the student's own function), without
markers; it is never graded."""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION assignment=(?P<name>[A-Za-z0-9_]+)\s*$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
REFERENCE_BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN REFERENCE assignment=(?P<name>[A-Za-z0-9_]+) stub=(?P<stub>\S.*)$")
REFERENCE_END = re.compile(r"^\s*### END REFERENCE\s*$")
ANSWER_BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN YOUR CODE assignment=(?P<name>[A-Za-z0-9_]+)\s*$")
ANSWER_END = re.compile(r"^\s*### END YOUR CODE\s*$")
STUB = ('{indent}### BEGIN YOUR CODE assignment={name}\n{indent}# YOUR CODE HERE\n'
        '{indent}raise NotImplementedError("YOUR CODE HERE")\n{indent}### END YOUR CODE\n')
COPIED = ("minidist", "tests", "notebooks", "pyproject.toml", "README.md")  # what a student gets
BUILD_OUTPUT = ("__pycache__", "*.pyc", "*.egg-info", ".ipynb_checkpoints")
SKIPPED = shutil.ignore_patterns(*BUILD_OUTPUT)
# a student copy also leaves out the grader's own tests: they quote answers to attack the grader
SKIPPED_FOR_STUDENTS = shutil.ignore_patterns(*BUILD_OUTPUT, "test_assignments*.py")


@dataclass(frozen=True)
class Region:
    name: str
    path: str      # relative to the root
    begin: int     # 1-based line numbers of the two markers
    end: int
    kind: str = "solution"  # or "reference": another copy of the answer, replaced by its stub line


def repository_root() -> Path:
    return Path(__file__).resolve().parents[2]


def regions_in(path: Path, root: Path) -> list[Region]:
    """The marked regions of one file (of each code cell of a notebook, named `path#cellN`); a
    region not closed (or nested) is an error naming its line."""
    relative = path.relative_to(root).as_posix()
    if path.suffix == ".ipynb":
        return [r for i, cell in enumerate(json.loads(path.read_text())["cells"]) if cell["cell_type"] == "code"
                for r in _regions_in_text("".join(cell["source"]), f"{relative}#cell{i}")]
    return _regions_in_text(path.read_text(), relative)


def _regions_in_text(text: str, relative: str) -> list[Region]:
    found, open_at, name, kind = [], None, None, None
    for number, line in enumerate(text.splitlines(), 1):
        begin = BEGIN.match(line) or REFERENCE_BEGIN.match(line)
        end = END.match(line) or REFERENCE_END.match(line)
        if ("BEGIN SOLUTION" in line or "BEGIN REFERENCE" in line) and not begin:
            raise ValueError(f"{relative}:{number}: a BEGIN marker needs 'assignment=<name>' "
                             "(and a REFERENCE marker 'stub=<one line>')")
        if begin:
            if open_at is not None:
                raise ValueError(f"{relative}:{number}: a BEGIN marker inside the region opened at line {open_at}")
            open_at, name, kind = number, begin["name"], "reference" if "stub" in begin.groupdict() else "solution"
        elif end:
            if open_at is None:
                raise ValueError(f"{relative}:{number}: an END marker without a BEGIN marker")
            if (kind == "reference") != bool(REFERENCE_END.match(line)):
                raise ValueError(f"{relative}:{number}: the region opened at line {open_at} ends with the other "
                                 "kind of END marker")
            found.append(Region(name, relative, open_at, number, kind))
            open_at = None
    if open_at is not None:
        raise ValueError(f"{relative}:{open_at}: BEGIN marker of assignment={name} is never closed")
    return found


def all_regions(root: Path | None = None) -> list[Region]:
    root = root or repository_root()
    sources = [path for path in sorted((root / "minidist").rglob("*.py"))
               if "assignments" not in path.relative_to(root).parts]
    sources += sorted((root / "notebooks").glob("*.ipynb"))  # exercise cells (chapter notebooks)
    return [r for path in sources for r in regions_in(path, root)]


def stub(text: str, selected: set[str]) -> str:
    """`text` with each selected region replaced by the stub (at the marker's indentation), and
    each selected reference region by its stub line; the markers of the other regions are kept."""
    out, skipping = [], None
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        begin = BEGIN.match(bare) or REFERENCE_BEGIN.match(bare)
        if begin and begin["name"] in selected:
            reference = "stub" in begin.groupdict()
            out.append(f"{begin['indent']}{begin['stub'].strip()}\n" if reference
                       else STUB.format(indent=begin["indent"], name=begin["name"]))
            skipping = REFERENCE_END if reference else END
        elif skipping:
            skipping = None if skipping.match(bare) else skipping
        else:
            out.append(line)
    return "".join(out)


def stub_notebook(text: str, selected: set[str]) -> str:
    """`stub` on each code cell of a notebook's JSON `text`; everything else of the notebook kept."""
    notebook = json.loads(text)
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell["source"] = stub("".join(cell["source"]), selected).splitlines(keepends=True)
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


class BuildError(ValueError):
    """A student copy that cannot be written where asked (one line)."""


STAMP = ".minidist-student-copy"  # written into every student copy: a folder holding it may be built again


def build(out: Path, selected: list[str], root: Path | None = None) -> list[Region]:
    """Copy the package, tests and notebooks to `out` and stub the selected assignments' regions.
    `out` must be new, empty, or a student copy built before: anything else (another checkout of
    minidist with work in it, a course folder) would have files overwritten by the copy."""
    root = root or repository_root()
    target = out.resolve()
    if target == root.resolve() or root.resolve() in target.parents:
        raise BuildError(f"{out} is inside the source tree {root}: build the student copy somewhere else")
    if target.is_dir() and any(target.iterdir()) and not (target / STAMP).exists():
        raise BuildError(f"{out} is not empty and not a student copy built before: its files would be "
                         f"overwritten, so nothing was written (build into a new or empty folder)")
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).write_text(f"a minidist student copy, built from {root}\n")
    for name in COPIED:
        source, target = root / name, out / name
        if source.is_dir():
            shutil.copytree(source, target, ignore=SKIPPED_FOR_STUDENTS, dirs_exist_ok=True)
        elif source.exists():
            shutil.copy2(source, target)
    stubbed = [r for r in all_regions(root) if r.name in selected]
    for path in sorted({r.path.split("#")[0] for r in stubbed}):
        if path.endswith(".ipynb"):
            (out / path).write_text(stub_notebook((root / path).read_text(), set(selected)))
        else:
            (out / path).write_text(stub((root / path).read_text(), set(selected)))
    return stubbed


class RegionError(ValueError):
    """A submission's region that cannot be graded: missing or malformed (one line)."""


def answers_in_text(text: str, relative: str) -> dict[str, list[tuple[str, list[str]]]]:
    """The regions of a submitted file, by assignment: (indent, body lines) for each, in order.
    Either marker pair counts (a stubbed region's YOUR CODE markers, or SOLUTION markers a
    copy built without that assignment kept); a region not closed, nested, or closed by the
    other kind's marker is a RegionError naming its line."""
    found: dict[str, list[tuple[str, list[str]]]] = {}
    open_at, name, indent, kind, body = None, None, "", None, []
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        bare = line.rstrip("\r\n")
        begin = BEGIN.match(bare) or ANSWER_BEGIN.match(bare)
        end_kind = "solution" if END.match(bare) else "answer" if ANSWER_END.match(bare) else None
        if begin is None and ("BEGIN SOLUTION" in bare or "BEGIN YOUR CODE" in bare):
            raise RegionError(f"{relative}:{number}: a BEGIN marker needs 'assignment=<name>' and nothing after it")
        if begin:
            if open_at is not None:
                raise RegionError(f"{relative}:{number}: a BEGIN marker inside the region of {name} opened at line {open_at}")
            open_at, name, indent, body = number, begin["name"], begin["indent"], []
            kind = "solution" if BEGIN.match(bare) else "answer"
        elif end_kind:
            if open_at is None:
                raise RegionError(f"{relative}:{number}: an END marker without a BEGIN marker")
            if end_kind != kind:
                raise RegionError(f"{relative}:{number}: the region of {name} opened at line {open_at} "
                                  f"ends with the other kind of END marker")
            found.setdefault(name, []).append((indent, body))
            open_at = None
        elif open_at is not None:
            body.append(line if line.endswith("\n") else line + "\n")
    if open_at is not None:
        raise RegionError(f"{relative}:{open_at}: the region of {name} is never closed")
    return found


def splice(text: str, name: str, answers: list[tuple[str, list[str]]], relative: str) -> str:
    """The instructor's `text` with the body of each region of assignment `name` replaced by the
    submission's region of the same place (the first by the first, ...), re-indented to the
    instructor's marker; a RegionError if the submission has fewer such regions."""
    out, skipping, index = [], False, 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        begin = BEGIN.match(line.rstrip("\n"))
        if begin and begin["name"] == name:
            if index >= len(answers):
                raise RegionError(f"{relative}: region {index + 1} of {name} (line {number} of the reference) is "
                                  f"missing: keep its '### BEGIN YOUR CODE assignment={name}' and "
                                  f"'### END YOUR CODE' lines")
            theirs, body = answers[index]
            out.append(line)
            out += [begin["indent"] + row[len(theirs):] if row.startswith(theirs) else row for row in body]
            skipping, index = True, index + 1
        elif skipping:
            if END.match(line.rstrip("\n")):
                out.append(line)
                skipping = False
        else:
            out.append(line)
    if index < len(answers):
        raise RegionError(f"{relative}: {len(answers)} regions of {name}, the reference has {index}")
    return "".join(out)


def notebook_answers(text: str, relative: str) -> dict[str, list[tuple[str, list[str]]]]:
    """`answers_in_text` over a notebook's code cells, in order (a student may add cells)."""
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for number, cell in enumerate(json.loads(text)["cells"]):
        if cell["cell_type"] == "code":
            for name, answers in answers_in_text("".join(cell["source"]), f"{relative}#cell{number}").items():
                found.setdefault(name, []).extend(answers)
    return found


def splice_notebook(text: str, name: str, answers: list[tuple[str, list[str]]], relative: str) -> str:
    """The instructor's notebook `text` with its regions of `name` replaced, cell by cell, by the
    submission's `answers` in order (`splice` for each code cell that has such regions)."""
    notebook, used = json.loads(text), 0
    for number, cell in enumerate(notebook["cells"]):
        source = "".join(cell["source"])
        count = sum(1 for r in _regions_in_text(source, relative) if r.name == name) if cell["cell_type"] == "code" else 0
        if count:
            if used + count > len(answers):
                raise RegionError(f"{relative}: cell {number} has {count} region(s) of {name}; the submission's "
                                  f"notebook has {len(answers) - used} left")
            cell["source"] = splice(source, name, answers[used:used + count], f"{relative}#cell{number}"
                                    ).splitlines(keepends=True)
            used += count
    if used < len(answers):
        raise RegionError(f"{relative}: {len(answers)} regions of {name}, the reference has {used}")
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"
