"""Sharded checkpoints for ZeRO: every rank writes only what it owns (chapter 8).

Under ZeRO no rank holds the whole training state, so no rank can write it alone. Each rank
writes its chunk of every unit — weights, AdamW's two moments — to `shard-R-of-N.npz`, and rank 0
writes `layout.json`: how the units were cut (names, shapes, padding), N, the stage, the step.

    trainer.save_checkpoint("ckpt/step-100")    # collective: every rank calls it
    trainer.load_checkpoint("ckpt/step-100")    # resume on the same layout, bit for bit
    state = consolidate_checkpoint("ckpt/step-100")   # full weights, serial keys, one process
    GPT(config).load_state_dict(state)

Crash-safe. A save never touches the checkpoint it replaces: the shards go to a fresh folder
(`shards-000100-<random>/`), each fsynced, with its size and sha256; after a barrier rank 0
writes `layout.json`, which names that folder, by an atomic `os.replace`. So `layout.json`
always points at a complete set of shards, the old one until the new one is complete; the old
shards are deleted only after. Loading checks each shard's size and checksum against it
(minidist/checkpoint.py's `read_file`).

A checkpoint only fits the layout that wrote it: rank r's file holds chunk r of units padded
for N ranks. Loading one on another N (or another model) is refused with a message; use
`consolidate_checkpoint` to get the full weights instead (resharding optimizer states is not
implemented). The stage does not change the chunks, so stages 1, 2 and 3 can resume each other.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from minidist import checkpoint
from minidist.comm import barrier
from minidist.train import check_arrays, generator_states, load_generator_states, load_scaler_state, scaler_state

FORMAT = "minidist-zero-v1"


def _shard_name(rank: int, n: int) -> str:
    return f"shard-{rank:05d}-of-{n:05d}.npz"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    checkpoint.write_synced(tmp, data)  # on disk before the rename makes it visible
    os.replace(tmp, path)
    checkpoint.fsync_directory(path.parent)


def layout_of(trainer) -> dict:
    return {
        "format": FORMAT, "dp": trainer.group.size, "stage": trainer.stage,
        "dtype": np.dtype(trainer.units[0].dtype).name, "config": trainer.config.to_dict(),
        "units": [{"name": u.name, "numel": u.numel, "padded": u.padded,
                   "params": [[n, list(s)] for n, s in zip(u.names, u.shapes)]} for u in trainer.units],
    }


def save_checkpoint(trainer, directory) -> None:
    directory = Path(directory)
    world, opt = trainer.group, trainer.optimizer
    folder = f"shards-{opt.step_count:06d}-{uuid.uuid4().hex[:8]}" if world.rank == 0 else None
    folder = world.comm.bcast(folder, root=0)  # one fresh folder, named by rank 0
    if world.rank == 0:
        (directory / folder).mkdir(parents=True)
    barrier(world)
    arrays = {"step": np.array(opt.step_count)}
    for u in range(len(trainer.units)):
        arrays[f"param.{u}"] = opt.params[u]
        arrays[f"exp_avg.{u}"] = opt.exp_avg[u]
        arrays[f"exp_avg_sq.{u}"] = opt.exp_avg_sq[u]
        if opt.masters is not None:  # 16-bit weights: their fp32 master chunk (chapter 10)
            arrays[f"master.{u}"] = opt.masters[u]
    arrays.update(scaler_state(trainer.scaler))
    data = checkpoint.npz_bytes(arrays)
    checkpoint.write_synced(directory / folder / _shard_name(world.rank, world.size), data)
    entries = world.comm.gather(checkpoint.describe(data, arrays), root=0)  # every shard is on disk ...
    if world.rank == 0:  # ... so layout.json can point at them: the commit
        checkpoint.fsync_directory(directory / folder)
        layout = dict(layout_of(trainer), step=opt.step_count, shards=folder, checksums=entries)
        _atomic_write(directory / "layout.json", json.dumps(layout, indent=1).encode())
        for entry in directory.glob("shards-*"):  # only now: the replaced shards, and any leftovers
            if entry.name != folder:
                shutil.rmtree(entry, ignore_errors=True)
    barrier(world)


def _read_shard(directory, layout: dict, rank: int) -> dict[str, np.ndarray]:
    """Rank `rank`'s shard, its size and checksum checked against layout.json."""
    file = Path(directory) / layout.get("shards", ".") / _shard_name(rank, layout["dp"])
    if "checksums" not in layout:  # written before checksums existed
        with np.load(file) as shard:
            return dict(shard)
    return checkpoint.read_file(file, layout["checksums"][rank])


def read_layout(directory) -> dict:
    path = Path(directory) / "layout.json"
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a complete ZeRO checkpoint: no layout.json "
                                "(it is written last, so no save has finished)")
    layout = json.loads(path.read_text())
    if layout.get("format") != FORMAT:
        raise ValueError(f"{path}: format {layout.get('format')!r}, expected {FORMAT!r}")
    return layout


def check_saved_layout(saved: dict, mine: dict, directory) -> None:
    """Refuse a checkpoint cut for another layout, naming the difference."""
    problems = []
    if saved["dp"] != mine["dp"]:
        problems.append(f"it was written by dp={saved['dp']} ranks, this job has dp={mine['dp']}")
    if saved["dtype"] != mine["dtype"]:
        problems.append(f"its dtype is {saved['dtype']}, this model's is {mine['dtype']}")
    if saved["config"] != mine["config"]:
        problems.append(f"its model is {saved['config']}, this one is {mine['config']}")
    elif saved["units"] != mine["units"]:
        problems.append("its units are cut differently")
    if problems:
        raise ValueError(f"ZeRO checkpoint {directory} does not fit this layout: " + "; ".join(problems)
                         + ". Resharding is not supported: consolidate_checkpoint() gives the full "
                         "weights, from which a new run can start (with fresh optimizer states).")


def load_checkpoint(trainer, directory) -> None:
    world, opt = trainer.group, trainer.optimizer
    saved = read_layout(directory)
    check_saved_layout(saved, layout_of(trainer), directory)
    kinds = [("param", opt.params), ("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)]
    kinds += [("master", opt.masters)] if opt.masters is not None else []
    pairs = [(f"{kind}.{u}", arrays[u]) for u in range(len(trainer.units)) for kind, arrays in kinds]
    error = None
    try:
        shard = _read_shard(directory, saved, world.rank)
        for key, mine in pairs:
            if shard[key].shape != mine.shape:  # never load a cut array by broadcasting
                raise ValueError(f"ZeRO checkpoint {directory}: {key} has shape {shard[key].shape}, "
                                 f"this rank's chunk is {mine.shape}")
    except ValueError as why:
        error = str(why)
    errors = [e for e in world.comm.allgather(error) if e]  # one rank's damaged shard stops them all
    if errors:
        raise ValueError(errors[0])
    for key, mine in pairs:
        mine[...] = shard[key]
    opt.step_count = int(shard["step"])
    load_scaler_state(trainer.scaler, shard)
    trainer.all_gather_parameters()  # stages 1-2 keep the full weights: rebuilt from the chunks
    barrier(world)


def consolidate_checkpoint(directory) -> dict[str, np.ndarray]:
    """The full weights of a sharded checkpoint, keyed like the serial model (no MPI needed):
    unit u is the concatenation of every rank's chunk u, padding cut off, split into params."""
    layout = read_layout(directory)
    n = layout["dp"]
    shards = [_read_shard(directory, layout, r) for r in range(n)]
    state = {}
    for u, unit in enumerate(layout["units"]):
        flat = np.concatenate([s[f"param.{u}"] for s in shards])[:unit["numel"]]
        offset = 0
        for name, shape in unit["params"]:
            size = int(np.prod(shape, dtype=np.int64))
            state[name] = flat[offset:offset + size].reshape(shape).copy()
            offset += size
    return state


# ----------------------------------------------------------------------------- the demo's --checkpoint


def checkpoint_state(trainer) -> dict[str, np.ndarray]:
    """`Trainer.checkpoint_state()` of a ZeRO trainer: this rank's chunk of every unit (weights,
    both moments), the step count, and the dropout generators of the model it runs."""
    opt, state = trainer.optimizer, {"optimizer.step": np.array(trainer.optimizer.step_count)}
    for i, (unit, p, m, v) in enumerate(zip(trainer.units, opt.params, opt.exp_avg, opt.exp_avg_sq)):
        state[f"param.{unit.name}"] = p
        state[f"optimizer.{unit.name}.exp_avg"], state[f"optimizer.{unit.name}.exp_avg_sq"] = m, v
        if opt.masters is not None:  # 16-bit weights: the fp32 master chunk (chapter 10)
            state[f"optimizer.{unit.name}.master"] = opt.masters[i]
    return {**state, **generator_states(_model(trainer)), **scaler_state(trainer.scaler)}


def load_checkpoint_state(trainer, state: dict[str, np.ndarray]) -> None:
    """Put `checkpoint_state`'s arrays back (exact names and shapes), then rebuild the full
    weights of stages 1-2 from the chunks. Collective."""
    check_arrays(checkpoint_state(trainer), state)
    opt = trainer.optimizer
    for i, (unit, p, m, v) in enumerate(zip(trainer.units, opt.params, opt.exp_avg, opt.exp_avg_sq)):
        p[...], m[...] = state[f"param.{unit.name}"], state[f"optimizer.{unit.name}.exp_avg"]
        v[...] = state[f"optimizer.{unit.name}.exp_avg_sq"]
        if opt.masters is not None:
            opt.masters[i][...] = state[f"optimizer.{unit.name}.master"]
    opt.step_count = int(state["optimizer.step"])
    load_generator_states(_model(trainer), state)
    load_scaler_state(trainer.scaler, state)
    trainer.all_gather_parameters()


def _model(trainer):
    """The module whose layers run (stage 3's holds no weights between steps, but its generators)."""
    return trainer.module
