"""Saving and resuming a whole training run, on every rank of a job, whatever the layout.

Chapter 2 (nothing lost) and chapter 8 (sharded states). Each trainer gives its rank's pieces of
the serial run's state, `Trainer.global_state()` (minidist/training/reshard.py); this file runs
minidist/training/checkpoint.py's steps collectively, and loads a checkpoint into any layout:

    save(directory, step, trainer, run, group)     # every rank's places gathered; copies written
                                                   # once; every rank writes its part; barrier;
                                                   # rank 0 commits (atomic rename)
    step = resume(directory, trainer, run, group)  # the newest complete checkpoint, validated on
                                                   # every rank, resharded; None if there is none

Resharding is the trainer's own cut: `trainer.load_global_state(read)` gets whole global arrays
from `read(name)` and keeps its piece, as it kept its piece of the serial model's initial weights.
So dp4-zero3 saves and tp2-pp2, or one serial process, resumes. What a rank reads it checks (size,
checksum, shapes), and every part file is checked by some rank; an array no rank reads is refused
too (nothing is silently dropped).

`run` describes what the checkpoint belongs to (model, dtype, batch, schedule...; its "layout"
is recorded, not compared): a checkpoint of another run is refused with the differences named.
An error found on one rank (its file is damaged or unreadable, its disk is full) is shared, so
every rank stops with the same one-line message, naming that rank; a save that fails leaves the
previous checkpoint the newest, and no staging directory behind. Every rank tries its part of
a load or a save before the ranks agree on the outcome (`agreed`), so a rank that failed never
leaves another waiting.

`snapshot(trainer, group)` is the same state in memory (every global array, whole, on every rank)
and `trainer.load_global_state(snapshot)` takes it back: for tests and notebooks.

`MINIDIST_KILL="rank:step"` makes that rank SIGKILL itself just before training step `step`
(`"rank:step:save"`: inside the save of step `step`, after its part is written, before the
commit): fault injection on the real path, for the chaos tests.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys

import numpy as np

from minidist.comm import faults
from minidist.training import checkpoint
from minidist.training.reshard import InMemory, assemble


def own_names(trainer, rank: int) -> dict:
    """The trainer's pieces under their checkpoint names: a local piece becomes `rankR.<name>`."""
    return {(f"rank{rank}.{name}" if piece.local else name): piece for name, piece in trainer.global_state().items()}


def save(directory, step: int, trainer, run: dict, group) -> None:
    """Checkpoint the state after `step` steps. Collective: every rank of `group` calls it."""
    pieces = own_names(trainer, group.rank)
    places = group.comm.allgather({name: piece.where() for name, piece in pieces.items()})  # small
    writes, arrays = checkpoint.plan(places, group.size)  # the same on every rank
    staging, part = checkpoint.staging(directory, step), None

    def write():
        nonlocal part
        part = checkpoint.write_part(staging, group.rank, group.size,
                                     {name: pieces[name].array for name in writes[group.rank]})

    try:  # a rank that cannot write (a full disk) stops every rank, in one line (chapter 2)
        agreed(lambda: group.rank == 0 and checkpoint.begin(directory, step), group)  # the staging directory exists
        agreed(write, group)
        kill_if_asked(group.rank, step, "save")
        parts = group.comm.gather(part, root=0)  # also the barrier: every part is on disk
        # nobody trains on (or exits) before the checkpoint is current
        agreed(lambda: group.rank == 0 and checkpoint.commit(directory, staging, step, {**run}, parts, arrays), group)
    except ValueError as error:
        if group.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # nothing half-written left behind
        newest = checkpoint.latest(directory)
        kept = f"{newest} is still the newest checkpoint" if newest else "there is no checkpoint yet"
        raise ValueError(f"the checkpoint of step {step} was not saved ({error}); {kept}") from None


def resume(directory, trainer, run: dict, group) -> int | None:
    """Load the newest complete checkpoint into `trainer`, whatever layout saved it; its step, or
    None if there is none. Collective. Raises ValueError (the same on every rank) naming the file
    or the difference."""
    path = checkpoint.latest(directory)
    if path is None:
        return None
    read = None

    def prepare():
        nonlocal read
        manifest = checkpoint.read_manifest(path)
        checkpoint.check_run(manifest, run, path)
        read = checkpoint.Checkpoint(path, manifest, group.rank,
                                     same_layout=manifest["run"].get("layout") == run.get("layout"))
        read.verify([p["file"] for p in manifest["parts"]][group.rank::group.size])  # each file by some rank

    agreed(prepare, group)
    agreed(lambda: trainer.load_global_state(read), group)
    used = set().union(*group.comm.allgather(read.used))
    unused = sorted(read.global_names() - used)
    if unused:
        raise ValueError(f"{path / checkpoint.MANIFEST}: {len(unused)} arrays are used by no rank of this trainer "
                         f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}): a state it does not hold")
    return int(read.manifest["step"])


def agreed(work, group) -> None:
    """Run `work` on every rank, then agree: a ValueError or OSError on any rank (a damaged or
    unreadable file, a full disk) raises the same ValueError on every rank, naming the rank
    where only some failed. Every rank tries before any gives up, so none is left waiting."""
    error = None
    try:
        work()
    except (ValueError, OSError) as why:
        error = said(why)
    failed = [(rank, e) for rank, e in enumerate(group.comm.allgather(error)) if e]
    if failed:
        rank, message = failed[0]
        alike = len(failed) == group.size and all(e == message for _, e in failed)
        raise ValueError(message if alike else f"{message} (on rank {rank})")


def said(error: Exception) -> str:
    """An error in one line: an OSError as 'FILE: reason', without its errno."""
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    return str(error)


def snapshot(trainer, group=None) -> InMemory:
    """The trainer's state as a checkpoint holds it, in memory: every global array whole, on every
    rank of `group` (collective; None: one process), and this rank's own (local) arrays."""
    state = trainer.global_state()
    mine = {name: (piece.where(), np.array(piece.array, copy=True)) for name, piece in state.items() if not piece.local}
    everyone = group.comm.allgather(mine) if group is not None and group.size > 1 else [mine]
    writes, _ = checkpoint.plan([{name: where for name, (where, _) in rank.items()} for rank in everyone],
                                len(everyone))
    pieces, kinds = {}, {}
    for rank, names in enumerate(writes):  # copies once, as a save writes them
        for name in names:
            where, array = everyone[rank][name]
            pieces.setdefault(name, []).append((array, where.get("box"), where.get("flat")))
            kinds[name] = (tuple(where["shape"]), np.dtype(where["dtype"]))
    arrays = {name: assemble(*kinds[name], pieces[name]) for name in pieces}
    return InMemory(arrays, {name: np.array(piece.array, copy=True) for name, piece in state.items() if piece.local})


def kill_if_asked(rank: int, step: int, phase: str = "train") -> None:
    """Fault injection: SIGKILL this process if MINIDIST_KILL names this rank, step and phase."""
    spec = os.environ.get("MINIDIST_KILL")
    if not spec:
        return
    fields = spec.split(":")
    if int(fields[0]) == rank and int(fields[1]) == step and (fields[2:] or ["train"])[0] == phase:
        faults.remove_job_files()  # a SIGKILL runs no clean-up: the injected fault does its own (chapter 2)
        # named on stderr first: a restart agent then knows which rank died, whichever ends first after
        print(f"[rank {rank}] MINIDIST_KILL: SIGKILL before {phase} step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
