"""Checkpoint files: one format for every layout, so any layout resumes any other's checkpoint.

Chapter 2 (clear failure, nothing lost) and chapter 8 (sharded states). A run that dies loses at
most the steps since its last checkpoint, and may resume on another layout (serial, dp, tp, pp,
ZeRO...). A checkpoint is one directory per step, one file per rank and a manifest:

    DIR/step-000040/rank-00000-of-00004.npz   the pieces this rank wrote, keyed by global name
    DIR/step-000040/manifest.json             the step, the run, every file's bytes, sha256 and
                                              arrays, and every global array's shape, dtype, pieces

Every array is the serial run's, under its global name (minidist/training/reshard.py), with the place of
each piece: a box of index ranges (a tensor-parallel shard), a flat range (a ZeRO chunk), both,
or neither (whole). A piece held by several ranks (data-parallel copies) is written once, by the
lowest of them. Arrays named `rankR.<name>` are rank R's own (its random generators), read back
only by the same layout. 16-bit floats are stored as their bits (uint16: an .npz has no
bfloat16), and come back exactly, in the manifest's dtype. Of a 4-rank dp2-tp2 run (tp ranks 0
and 1 hold the two halves of the vocabulary; ranks 2 and 3, the other replica, hold copies):

    {"format": "minidist-checkpoint-v2", "step": 4, "run": {..., "layout": {"name": "dp2-tp2", ...}},
     "parts": [{"file": "rank-00000-of-00004.npz", "bytes": 455792, "sha256": "5c36b651...",
                "arrays": {"param.wte.weight": [[128, 32], "<f8"], ...}}, ...],
     "arrays": {"param.wte.weight": {"shape": [256, 32], "dtype": "float64", "pieces": [
                    {"file": "rank-00000-of-00004.npz", "box": [[0, 128], [0, 32]]},
                    {"file": "rank-00001-of-00004.npz", "box": [[128, 256], [0, 32]]}]},
                "step": {"shape": [], "dtype": "int64", "pieces": [{"file": "rank-00000-of-00004.npz"}]},
                "rank3.rng.drop.rng": {"shape": [165], "dtype": "uint8",
                                       "pieces": [{"file": "rank-00003-of-00004.npz"}]}, ...}}

A ZeRO chunk's piece says `"flat": [1462, 2924]` instead of a box: those elements of the array,
flattened (minidist/training/reshard.py has every kind).

Written so that a crash at any moment leaves the newest complete checkpoint loadable:

1. `begin`: a fresh staging directory `DIR/step-000040.partial`;
2. `write_part`: every rank writes its file there and fsyncs it, and returns its manifest entry;
3. `commit` (rank 0, once every part is written): the manifest, fsynced, then one atomic
   `rename` of `step-000040.partial` to `step-000040`; only then are older steps deleted.

`latest(DIR)` is the newest `step-N` directory, and a `.partial` one is never read: a save that
died half-way is simply not there. Loading validates before using: `read_manifest` (its form,
field by field, every piece inside its array: `check_form` in checkpoint_format.py), `check_run`
(the same model, dtype, batch, schedule...; the layout may differ; a step before the last), and
`Checkpoint`, whose `read(name)` assembles a global array from its pieces, each file's size,
checksum, names, shapes and dtypes checked before its first use and every element covered exactly
once; each failure names the file. `consolidate(path)`: every global array, whole, in one process.

No MPI here: `minidist/parallel/checkpointing.py` runs these steps on every rank of a job.
All ranks must see the same directory (one machine, or a shared file system).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy: np.dtype("bfloat16"))
import numpy as np

from minidist.training.checkpoint_format import (FORMAT, LOCAL, MANIFEST, PART, SHA256, STEP,  # noqa: F401
                                                 check_form, check_run, differences, part_name, step_name)
from minidist.training.reshard import assemble, extent


# ----------------------------------------------------------------------------- writing


def write_synced(path: Path, data: bytes) -> None:
    """Write and fsync: on disk before anything (a rename, a manifest) says the file is there.
    An error names the file (a full disk's does not by itself)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(path)) from None


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


def foreign(dtype) -> bool:
    """A dtype registered by another package (ml_dtypes' bfloat16 and fp8 formats), which an
    .npz cannot name: NumPy writes its descriptor ('<V2', '<f1') and reads back raw bytes or
    nothing. Its `kind` is no test: ml_dtypes says 'V' for some formats and 'f' for others."""
    return np.dtype(dtype).isbuiltin == 2


def stored(array: np.ndarray) -> np.ndarray:
    """What the file holds: the array, or for a format NumPy cannot save (bfloat16, fp8:
    `foreign`) its bit patterns as unsigned integers of the same width."""
    array = np.asarray(array)
    return array.view(f"u{array.dtype.itemsize}") if foreign(array.dtype) else array


def plan(places: list[dict[str, dict]], size: int) -> tuple[list[list[str]], dict]:
    """Who writes what, from every rank's {name: `Piece.where()`}: of identical pieces (same array,
    same place: data-parallel copies) the lowest rank's only. Returns the names each rank writes
    and the manifest's "arrays" section. Pure: every rank computes the same from the same input."""
    writes, arrays = [[] for _ in places], {}
    for rank, mine in enumerate(places):
        for name, where in mine.items():
            entry = arrays.setdefault(name, {"shape": where["shape"], "dtype": where["dtype"], "pieces": []})
            if (entry["shape"], entry["dtype"]) != (where["shape"], where["dtype"]):
                raise ValueError(f"array {name}: rank {rank} holds a piece of a {where['shape']} {where['dtype']} "
                                 f"array, a lower rank of a {entry['shape']} {entry['dtype']} one")
            place = {key: where[key] for key in ("box", "flat") if key in where}
            if any({k: v for k, v in piece.items() if k != "file"} == place for piece in entry["pieces"]):
                continue  # a copy of a piece a lower rank writes
            entry["pieces"].append({"file": part_name(rank, size), **place})
            writes[rank].append(name)
    return writes, arrays


def write_part(partial: Path, rank: int, size: int, state: dict[str, np.ndarray]) -> dict:
    """This rank's file, written and fsynced; returns its manifest entry (with its file name)."""
    state = {name: stored(array) for name, array in state.items()}
    data = npz_bytes(state)
    name = part_name(rank, size)
    write_synced(partial / name, data)
    return {"file": name, **describe(data, state)}


def commit(directory, partial: Path, step: int, run: dict, parts: list[dict], arrays: dict) -> Path:
    """Make the staged checkpoint the current one (rank 0, after every part is written):
    manifest, one atomic rename, then the older checkpoints go. Returns its directory."""
    directory = Path(directory)
    manifest = {"format": FORMAT, "step": step, "run": run, "parts": parts, "arrays": arrays}
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
    check_form(manifest, file)
    match = STEP.match(Path(path).name)
    if match and int(match.group(1)) != manifest["step"]:
        raise ValueError(f"{file}: says step {manifest['step']}, but its directory is {Path(path).name}")
    return manifest


def read_file(file: Path, entry: dict) -> dict[str, np.ndarray]:
    """The arrays of `file`, checked against its manifest entry (`describe`'s dict)."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{file}: missing") from None
    except OSError as error:  # a directory in its place, no permission, an I/O error
        raise ValueError(f"{file}: cannot be read ({error.strerror or error})") from None
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


class Checkpoint:
    """The global arrays of the checkpoint at `path`, for rank `rank` of the job that loads it.

        read = Checkpoint(path, read_manifest(path), rank)
        read("param.wte.weight")       # the whole (256, 32) array, from its pieces
        read.local("rng.drop.rng")     # this rank's own array (`rankR.<name>`), None from another layout

    A file is read, and checked against the manifest (`read_file`), the first time one of its
    pieces is needed, then kept; `verify` checks files up front. `used` collects the names read."""

    def __init__(self, path, manifest: dict, rank: int = 0, same_layout: bool = True):
        self.path, self.manifest, self.rank, self.same_layout = Path(path), manifest, rank, same_layout
        self.entries = {p["file"]: p for p in manifest["parts"]}
        self.files: dict[str, dict[str, np.ndarray]] = {}
        self.used: set[str] = set()

    def global_names(self) -> set[str]:
        """Every array of the serial run's state (not a rank's own)."""
        return {name for name in self.manifest["arrays"] if not LOCAL.match(name)}

    def verify(self, files) -> None:
        for file in files:
            self.part(file)

    def part(self, file: str) -> dict[str, np.ndarray]:
        if file not in self.files:
            try:
                self.files[file] = read_file(self.path / file, self.entries[file])
            except (KeyError, TypeError) as why:  # an edited entry: its arrays are not [shape, dtype] pairs
                raise ValueError(f"{self.path / MANIFEST}: the entry of {file} is malformed ({why!s})") from None
        return self.files[file]

    def __call__(self, name: str) -> np.ndarray:
        entry = self.manifest["arrays"].get(name)
        if entry is None:
            raise ValueError(f"{self.path / MANIFEST}: has no array {name}")
        shape, dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
        pieces = []
        for piece in entry["pieces"]:
            file, box, flat = self.path / piece["file"], piece.get("box"), piece.get("flat")
            data = self.part(piece["file"])
            if name not in data:
                raise ValueError(f"{file}: has no array {name}, though the manifest places a piece of it there")
            array = data[name]
            if array.dtype != dtype:  # stored as bits
                if array.dtype != stored(np.zeros(0, dtype)).dtype:
                    raise ValueError(f"{file}: array {name} is {array.dtype}, the manifest says {dtype}")
                array = array.view(dtype)
            if array.shape != extent(shape, box, flat):
                raise ValueError(f"{file}: array {name} has shape {array.shape}, its piece of the {shape} array "
                                 f"is {extent(shape, box, flat)}")
            pieces.append((array, box, flat))
        try:
            full = assemble(shape, dtype, pieces)
        except ValueError as why:
            raise ValueError(f"{self.path / MANIFEST}: array {name}: {why}") from None
        self.used.add(name)
        return full

    def local(self, name: str) -> np.ndarray | None:
        """This rank's own array `name`, as this layout saved it; None if another layout saved
        the checkpoint (missing on the same layout: an error)."""
        key = f"rank{self.rank}.{name}"
        if key in self.manifest["arrays"]:
            return self(key)
        if self.same_layout:
            raise ValueError(f"{self.path / MANIFEST}: has no array {key} (this layout saves it)")
        return None


def consolidate(path) -> dict[str, np.ndarray]:
    """Every global array of the checkpoint at `path`, whole, by global name; one process, no MPI.
    `{k[6:]: v for k, v in consolidate(p).items() if k.startswith("param.")}` is the serial
    model's state dict."""
    read = Checkpoint(path, read_manifest(path))
    return {name: read(name) for name in sorted(read.global_names())}


# ----------------------------------------------------------------------------- the demo's --json and --save


def write_json(path: str, report: dict) -> None:
    replace_atomically(path, "w", lambda f: json.dump(report, f, indent=1))


def save_weights(path: str, state: dict) -> None:
    """The final weights by name. A format an .npz cannot hold (bfloat16 would come back as raw
    bytes, dtype |V2) is written as float32, which holds its values exactly."""
    state = {k: np.asarray(v, dtype=np.float32) if foreign(np.asarray(v).dtype) else v for k, v in state.items()}
    replace_atomically(path, "wb", lambda f: np.savez(f, **state))


def replace_atomically(path: str, mode: str, write) -> None:
    """Write beside `path`, then rename over it: a reader never sees half a file, and a failed
    write leaves neither a half file nor its temporary. The file gets the user's umask.

    A full disk may only show when the buffered bytes reach it (the flush at close), so the
    close, fsync and rename are inside the clean-up too (chapter 2: nothing left behind)."""
    directory = os.path.dirname(os.path.abspath(path))
    f = tempfile.NamedTemporaryFile(mode, dir=directory, delete=False, suffix=".tmp")
    try:
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the file
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(f.name, 0o666 & ~umask)  # NamedTemporaryFile makes 0600
        os.replace(f.name, path)
    except BaseException:
        try:
            os.unlink(f.name)
        except OSError:
            pass  # already renamed, or never there
        raise
