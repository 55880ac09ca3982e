"""Checkpoint files: a run that dies loses at most the steps since its last checkpoint.

Chapter 2 (clear failure, nothing lost). A checkpoint is one directory per step, one file per
rank (its part of the training state: `Trainer.checkpoint_state()`) and a manifest:

    DIR/step-000040/rank-00000-of-00002.npz
    DIR/step-000040/rank-00001-of-00002.npz
    DIR/step-000040/manifest.json    step, the run it belongs to, and for every file its
                                     bytes, sha256 and arrays (name -> shape, dtype)

Written so that a crash at any moment leaves the newest complete checkpoint loadable:

1. `begin`: a fresh staging directory `DIR/step-000040.partial`;
2. `write_part`: every rank writes its file there and fsyncs it, and returns its manifest entry;
3. `commit` (rank 0, once every part is written): the manifest, fsynced, then one atomic
   `rename` of `step-000040.partial` to `step-000040`; only then are older steps deleted.

`latest(DIR)` is the newest `step-N` directory, and a `.partial` one is never read: a save that
died half-way is simply not there. Loading validates before using (`read_manifest`, `check_run`,
`read_part`): the run (layout, config, dtype), the step, every file's size and checksum, and its
arrays' names, shapes and dtypes against the manifest, each failure naming the file.

No MPI here: `minidist/parallel/checkpointing.py` runs these steps on every rank of a job.
All ranks must see the same directory (one machine, or a shared file system).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np

FORMAT = "minidist-checkpoint-v1"
MANIFEST = "manifest.json"
STEP = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def part_name(rank: int, size: int) -> str:
    return f"rank-{rank:05d}-of-{size:05d}.npz"


# ----------------------------------------------------------------------------- writing


def write_synced(path: Path, data: bytes) -> None:
    """Write and fsync: on disk before anything (a rename, a manifest) says the file is there."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_directory(path: Path) -> None:
    """A rename or a new file is durable only once its directory's entry is on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe(data: bytes, state: dict[str, np.ndarray]) -> dict:
    """A file's manifest entry: bytes, sha256, and each array's shape and dtype."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "arrays": shapes(state)}


def npz_bytes(state: dict[str, np.ndarray]) -> bytes:
    """The .npz file of `state`, in memory: hashed, then written once."""
    buffer = io.BytesIO()
    np.savez(buffer, **state)
    return buffer.getvalue()


def shapes(state: dict[str, np.ndarray]) -> dict[str, list]:
    return {name: [list(np.shape(a)), np.asarray(a).dtype.str] for name, a in state.items()}


def staging(directory, step: int) -> Path:
    """Where the parts of `step`'s checkpoint are written before the commit."""
    return Path(directory) / f"{step_name(step)}.partial"


def begin(directory, step: int) -> Path:
    """A fresh, empty staging directory for the checkpoint of `step` (rank 0, before the parts)."""
    path = staging(directory, step)
    shutil.rmtree(path, ignore_errors=True)  # what a crashed earlier attempt left
    path.mkdir(parents=True)
    return path


def write_part(partial: Path, rank: int, size: int, state: dict[str, np.ndarray]) -> dict:
    """This rank's file, written and fsynced; returns its manifest entry (with its file name)."""
    data = npz_bytes(state)
    name = part_name(rank, size)
    write_synced(partial / name, data)
    return {"file": name, **describe(data, state)}


def commit(directory, partial: Path, step: int, run: dict, parts: list[dict]) -> Path:
    """Make the staged checkpoint the current one (rank 0, after every part is written):
    manifest, one atomic rename, then the older checkpoints go. Returns its directory."""
    directory = Path(directory)
    manifest = {"format": FORMAT, "step": step, "run": run, "parts": parts}
    write_synced(partial / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_directory(partial)
    final = directory / step_name(step)
    if final.exists():  # a run resumes from its newest step and saves only later ones
        raise FileExistsError(f"{final}: a checkpoint of step {step} already exists")
    os.rename(partial, final)  # the commit: atomic
    fsync_directory(directory)
    for entry in directory.iterdir():  # only now: everything but the new checkpoint
        if entry.name.startswith("step-") and entry != final:
            shutil.rmtree(entry, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- reading


def latest(directory) -> Path | None:
    """The newest complete checkpoint in `directory` (None if there is none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = [(int(m.group(1)), entry) for entry in directory.iterdir() if (m := STEP.match(entry.name))]
    return max(steps)[1] if steps else None


def read_manifest(path) -> dict:
    """The manifest of checkpoint directory `path`, checked for form; errors name the file."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{file}: missing (a committed checkpoint always has one)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file}: damaged, not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{file}: not a {FORMAT} manifest")
    match = STEP.match(Path(path).name)
    if match and int(match.group(1)) != manifest.get("step"):
        raise ValueError(f"{file}: says step {manifest.get('step')}, but its directory is {Path(path).name}")
    return manifest


def differences(saved, mine, prefix: str = "") -> list[str]:
    """'dtype float32 there, float64 here' for every key whose value differs (nested dicts too)."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        return [d for key in sorted(set(saved) | set(mine))
                for d in differences(saved.get(key), mine.get(key), f"{prefix}{key}.")]
    return [] if saved == mine else [f"{prefix.rstrip('.')} {saved} there, {mine} here"]


def check_run(manifest: dict, run: dict, path) -> None:
    """Refuse a checkpoint of another run (layout, model, dtype, schedule...), naming what differs."""
    found = differences(manifest.get("run"), run)
    if found:
        raise ValueError(f"checkpoint {path} belongs to another run: " + "; ".join(found))


def read_part(path, manifest: dict, rank: int, size: int) -> dict[str, np.ndarray]:
    """Rank `rank`'s arrays, after checking the file's size, checksum, names, shapes and dtypes
    against the manifest (`read_file`). Every error names the file."""
    name = part_name(rank, size)
    entry = next((p for p in manifest.get("parts", []) if p.get("file") == name), None)
    if entry is None or len(manifest["parts"]) != size:
        raise ValueError(f"{Path(path) / MANIFEST}: has {len(manifest.get('parts', []))} parts, "
                         f"this job has {size} ranks (no entry for {name})")
    return read_file(Path(path) / name, entry)


def read_file(file: Path, entry: dict) -> dict[str, np.ndarray]:
    """The arrays of `file`, checked against its manifest entry (`describe`'s dict)."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{file}: missing") from None
    if len(data) != entry["bytes"]:
        raise ValueError(f"{file}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated or damaged)")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ValueError(f"{file}: checksum mismatch (the file is damaged)")
    try:
        with np.load(io.BytesIO(data)) as archive:
            state = {key: archive[key] for key in archive.files}
    except (zipfile.BadZipFile, ValueError, OSError) as error:
        raise ValueError(f"{file}: not a readable .npz ({error})") from None
    found = shapes(state)
    if set(found) != set(entry["arrays"]):
        raise ValueError(f"{file}: arrays {sorted(set(found) ^ set(entry['arrays']))[:3]} differ from the manifest's")
    for key, (shape, dtype) in entry["arrays"].items():
        if found[key] != [shape, dtype]:
            raise ValueError(f"{file}: array {key} has shape {tuple(found[key][0])} {found[key][1]}, "
                             f"the manifest says {tuple(shape)} {dtype}")
    return state


# ----------------------------------------------------------------------------- the demo's --json and --save


def write_json(path: str, report: dict) -> None:
    replace_atomically(path, "w", lambda f: json.dump(report, f, indent=1))


def save_weights(path: str, state: dict) -> None:
    replace_atomically(path, "wb", lambda f: np.savez(f, **state))


def replace_atomically(path: str, mode: str, write) -> None:
    """Write beside `path`, then rename over it: a reader never sees half a file, and a failed
    write leaves neither a half file nor its temporary. The file gets the user's umask."""
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile(mode, dir=directory, delete=False, suffix=".tmp") as f:
        try:
            write(f)
        except BaseException:
            f.close()
            os.unlink(f.name)
            raise
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(f.name, 0o666 & ~umask)  # NamedTemporaryFile makes 0600
    os.replace(f.name, path)
