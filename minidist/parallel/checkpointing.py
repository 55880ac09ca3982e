"""Saving and resuming a whole training run, on every rank of a job, whatever the strategy.

Chapter 2 (nothing lost). Each trainer gives its rank's part of the training state
(`Trainer.checkpoint_state()`); this file runs minidist/checkpoint.py's steps collectively:

    save(directory, step, trainer, run, group)     # staging dir; every rank writes its part;
                                                   # barrier; rank 0 commits (atomic rename)
    step = resume(directory, trainer, run, group)  # the newest complete checkpoint, validated
                                                   # on every rank; None if there is none

`run` describes what the checkpoint belongs to (layout, model, dtype, schedule...): a checkpoint
of another run is refused with the differences named. An error found on one rank (its file is
damaged) is shared, so every rank stops with the same one-line message.

`MINIDIST_KILL="rank:step"` makes that rank SIGKILL itself just before training step `step`
(`"rank:step:save"`: inside the save of step `step`, after its part is written, before the
commit): fault injection on the real path, for the chaos test.
"""
from __future__ import annotations

import os
import signal

from minidist import checkpoint
from minidist.comm import barrier
from minidist.train import check_arrays


def save(directory, step: int, trainer, run: dict, group) -> None:
    """Checkpoint the state after `step` steps. Collective: every rank of `group` calls it."""
    state = trainer.checkpoint_state()
    if group.rank == 0:
        checkpoint.begin(directory, step)
    barrier(group)  # the staging directory exists, empty
    staging = checkpoint.staging(directory, step)
    part = checkpoint.write_part(staging, group.rank, group.size, state)
    kill_if_asked(group.rank, step, "save")
    parts = group.comm.gather(part, root=0)  # also the barrier: every part is on disk
    if group.rank == 0:
        checkpoint.commit(directory, staging, step, run, parts)
    barrier(group)  # nobody trains on (or exits) before the checkpoint is current


def resume(directory, trainer, run: dict, group) -> int | None:
    """Load the newest complete checkpoint into `trainer`; its step, or None if there is none.
    Collective. Raises ValueError (the same on every rank) naming the file or the difference."""
    path = checkpoint.latest(directory)
    if path is None:
        return None
    error, step = None, None
    try:
        manifest = checkpoint.read_manifest(path)
        checkpoint.check_run(manifest, run, path)
        state = checkpoint.read_part(path, manifest, group.rank, group.size)
        try:  # before any rank loads: loading may be collective (ZeRO gathers the weights)
            check_arrays(trainer.checkpoint_state(), state)
        except ValueError as why:
            raise ValueError(f"{path / checkpoint.part_name(group.rank, group.size)}: {why}") from None
        step = int(manifest["step"])
    except ValueError as why:
        error = str(why)
    errors = [e for e in group.comm.allgather(error) if e]  # one rank's damaged file stops them all
    if errors:
        raise ValueError(errors[0])
    trainer.load_checkpoint_state(state)
    return step


def kill_if_asked(rank: int, step: int, phase: str = "train") -> None:
    """Fault injection: SIGKILL this process if MINIDIST_KILL names this rank, step and phase."""
    spec = os.environ.get("MINIDIST_KILL")
    if not spec:
        return
    fields = spec.split(":")
    if int(fields[0]) == rank and int(fields[1]) == step and (fields[2:] or ["train"])[0] == phase:
        os.kill(os.getpid(), signal.SIGKILL)
