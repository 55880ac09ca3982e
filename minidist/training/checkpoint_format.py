"""What a checkpoint is on disk, and the checks a manifest passes before any array is read
(chapter 2: a user's mistake, or a damaged file, fails in one line naming the field).

The names (`step_name`, `part_name`), the manifest's schema checked field by field
(`check_form`), and whether a checkpoint belongs to this run (`check_run`). checkpoint.py writes
and reads the files; its module docstring shows a whole manifest.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from minidist.training.reshard import extent

FORMAT = "minidist-checkpoint-v2"
MANIFEST = "manifest.json"
STEP = re.compile(r"^step-(\d+)$")
LOCAL = re.compile(r"^rank\d+\.")  # rank R's own arrays: `rankR.<name>`
PART = re.compile(r"^rank-\d{5}-of-\d{5}\.npz$")  # `part_name`'s
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def part_name(rank: int, size: int) -> str:
    return f"rank-{rank:05d}-of-{size:05d}.npz"


def _shown(value) -> str:
    """A field's value in an error message, as the JSON said it (short)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field(entry: dict, key: str, file: Path, where: str, kind: str, ok) -> object:
    """`entry[key]`, refused in one line naming the field (`where` + key) unless `ok(value)`."""
    if key not in entry:
        raise ValueError(f"{file}: field {where}{key}: missing")
    value = entry[key]
    if isinstance(value, bool) or not ok(value):
        raise ValueError(f"{file}: field {where}{key}: expected {kind}, got {_shown(value)}")
    return value


def _is_array_listing(value) -> bool:
    """A part's "arrays": {name: [shape, dtype string]}, as `shapes` writes it."""
    return isinstance(value, dict) and all(
        isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], list) and isinstance(pair[1], str)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in pair[0]) for pair in value.values())


def check_form(manifest: dict, file: Path) -> None:
    """The manifest's schema, field by field (an edited one is refused here, in one line naming
    the field, before any read), then every array's shape, dtype and pieces, each piece inside
    its array and in a listed file."""
    _field(manifest, "step", file, "", "a whole number >= 0", lambda v: isinstance(v, int) and v >= 0)
    parts = manifest.get("parts")
    if not isinstance(parts, list) or not parts:
        raise ValueError(f"{file}: field parts: expected a list of file entries, got {_shown(parts)}")
    for i, part in enumerate(parts):
        where = f"parts[{i}]."
        if not isinstance(part, dict):
            raise ValueError(f"{file}: field parts[{i}]: expected a file entry (file, bytes, sha256, arrays), "
                             f"got {_shown(part)}")
        # a plain part name: a manifest never sends a reader outside its own directory
        _field(part, "file", file, where, "a part name rank-RRRRR-of-NNNNN.npz",
               lambda v: isinstance(v, str) and PART.match(v))
        _field(part, "bytes", file, where, "a whole number >= 0", lambda v: isinstance(v, int) and v >= 0)
        _field(part, "sha256", file, where, "64 hexadecimal digits", lambda v: isinstance(v, str) and SHA256.match(v))
        _field(part, "arrays", file, where, "{name: [shape, dtype]}", _is_array_listing)
    files = [p["file"] for p in parts]
    if len(set(files)) != len(files):
        raise ValueError(f"{file}: field parts: lists a file twice")
    files = set(files)
    arrays = manifest.get("arrays")
    if not isinstance(arrays, dict):
        raise ValueError(f"{file}: field arrays: expected {{name: entry}}, got {_shown(arrays)}")
    for name, entry in arrays.items():
        try:
            _check_entry(entry, files)
        except KeyError as why:
            raise ValueError(f"{file}: array {name}: malformed entry (field {why.args[0]} missing)") from None
        except (TypeError, ValueError) as why:
            raise ValueError(f"{file}: array {name}: malformed entry ({why!s})") from None


def _check_entry(entry: dict, files: set) -> None:
    shape = entry["shape"]
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"shape {shape}")
    np.dtype(entry["dtype"])
    if not entry["pieces"]:
        raise ValueError("no pieces")
    for piece in entry["pieces"]:
        if piece["file"] not in files:
            raise ValueError(f"a piece in {piece['file']}, which is not among its parts")
        box, flat = piece.get("box"), piece.get("flat")
        if box is not None and (len(box) != len(shape) or not all(0 <= a <= b <= n for (a, b), n in zip(box, shape))):
            raise ValueError(f"box {box} is not inside shape {shape}")
        if flat is not None and not 0 <= flat[0] <= flat[1] <= int(np.prod(extent(shape, box), dtype=np.int64)):
            raise ValueError(f"flat range {flat} is not inside its box")


def differences(saved, mine, prefix: str = "") -> list[str]:
    """'dtype float32 there, float64 here' for every key whose value differs (nested dicts too)."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        return [d for key in sorted(set(saved) | set(mine))
                for d in differences(saved.get(key), mine.get(key), f"{prefix}{key}.")]
    return [] if saved == mine else [f"{prefix.rstrip('.')} {saved} there, {mine} here"]


def check_run(manifest: dict, run: dict, path) -> None:
    """Refuse a checkpoint of another run (model, dtype, batch, schedule, precision, seed...),
    naming what differs. The "layout" it was saved with may differ: loading reshards."""
    def facts(run):
        return {k: v for k, v in run.items() if k != "layout"} if isinstance(run, dict) else run

    found = differences(facts(manifest.get("run")), facts(run))
    if found:
        raise ValueError(f"checkpoint {path} belongs to another run: " + "; ".join(found))
    steps = run.get("steps") if isinstance(run, dict) else None
    if isinstance(steps, int) and not manifest["step"] < steps:  # a run saves only steps it goes on from
        raise ValueError(f"{Path(path) / MANIFEST}: field step: {manifest['step']} is not below the run's "
                         f"{steps} steps")
