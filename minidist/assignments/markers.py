"""Find the solution regions in the source and write a student copy with each one stubbed out."""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

BEGIN = re.compile(r"^(?P<indent>\s*)### BEGIN SOLUTION assignment=(?P<name>[A-Za-z0-9_]+)\s*$")
END = re.compile(r"^\s*### END SOLUTION\s*$")
STUB = '{indent}# YOUR CODE HERE\n{indent}raise NotImplementedError("YOUR CODE HERE")\n'
COPIED = ("minidist", "tests", "notebooks", "pyproject.toml", "README.md")  # what a student gets
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".ipynb_checkpoints")


@dataclass(frozen=True)
class Region:
    name: str
    path: str      # relative to the root
    begin: int     # 1-based line numbers of the two markers
    end: int


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
    found, open_at, name = [], None, None
    for number, line in enumerate(text.splitlines(), 1):
        begin, end = BEGIN.match(line), END.match(line)
        if "BEGIN SOLUTION" in line and not begin:
            raise ValueError(f"{relative}:{number}: a BEGIN SOLUTION marker needs 'assignment=<name>'")
        if begin:
            if open_at is not None:
                raise ValueError(f"{relative}:{number}: BEGIN SOLUTION inside the region opened at line {open_at}")
            open_at, name = number, begin["name"]
        elif end:
            if open_at is None:
                raise ValueError(f"{relative}:{number}: END SOLUTION without a BEGIN SOLUTION")
            found.append(Region(name, relative, open_at, number))
            open_at = None
    if open_at is not None:
        raise ValueError(f"{relative}:{open_at}: BEGIN SOLUTION assignment={name} is never closed")
    return found


def all_regions(root: Path | None = None) -> list[Region]:
    root = root or repository_root()
    sources = [path for path in sorted((root / "minidist").rglob("*.py"))
               if "assignments" not in path.relative_to(root).parts]
    sources += sorted((root / "notebooks").glob("*.ipynb"))  # exercise cells (chapter notebooks)
    return [r for path in sources for r in regions_in(path, root)]


def stub(text: str, selected: set[str]) -> str:
    """`text` with each selected region replaced by the stub (at the marker's indentation);
    the markers of the other regions are kept as they are."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        begin = BEGIN.match(line.rstrip("\n"))
        if begin and begin["name"] in selected:
            out.append(STUB.format(indent=begin["indent"]))
            skipping = True
        elif skipping:
            skipping = not END.match(line.rstrip("\n"))
        else:
            out.append(line)
    return "".join(out)


def build(out: Path, selected: list[str], root: Path | None = None) -> list[Region]:
    """Copy the package, tests and notebooks to `out` and stub the selected assignments' regions."""
    root = root or repository_root()
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        source, target = root / name, out / name
        if source.is_dir():
            shutil.copytree(source, target, ignore=SKIPPED, dirs_exist_ok=True)
        elif source.exists():
            shutil.copy2(source, target)
    stubbed = [r for r in all_regions(root) if r.name in selected]
    for path in sorted({r.path.split("#")[0] for r in stubbed}):
        if path.endswith(".ipynb"):  # each code cell's regions, the notebook's JSON otherwise kept
            notebook = json.loads((root / path).read_text())
            for cell in notebook["cells"]:
                if cell["cell_type"] == "code":
                    cell["source"] = stub("".join(cell["source"]), set(selected)).splitlines(keepends=True)
            (out / path).write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
        else:
            (out / path).write_text(stub((root / path).read_text(), set(selected)))
    return stubbed
