"""Sharded checkpoints for ZeRO: every rank writes only what it owns (chapter 8).

Under ZeRO no rank holds the whole training state, so no rank can write it alone. Each rank
writes its chunk of every unit — weights, AdamW's two moments — to `shard-R-of-N.npz`, and rank 0
writes `layout.json`: how the units were cut (names, shapes, padding), N, the stage, the step.

    trainer.save_checkpoint("ckpt/step-100")    # collective: every rank calls it
    trainer.load_checkpoint("ckpt/step-100")    # resume on the same layout, bit for bit
    state = consolidate_checkpoint("ckpt/step-100")   # full weights, serial keys, one process
    GPT(config).load_state_dict(state)

Atomic, in two senses. Each file is written to a temporary name and renamed into place
(`os.replace` is atomic), so a crash never leaves a half-written file under the real name. And
`layout.json` is removed first and written last, after a barrier: a directory holding a
`layout.json` is a complete checkpoint; one without it is not, and loading it fails clearly.

A checkpoint only fits the layout that wrote it: rank r's file holds chunk r of units padded
for N ranks. Loading one on another N (or another model) is refused with a message; use
`consolidate_checkpoint` to get the full weights instead (resharding optimizer states is not
implemented). The stage does not change the chunks, so stages 1, 2 and 3 can resume each other.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from minidist.comm import barrier

FORMAT = "minidist-zero-v1"


def _shard_name(rank: int, n: int) -> str:
    return f"shard-{rank:05d}-of-{n:05d}.npz"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename makes it visible
    os.replace(tmp, path)


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
    if world.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "layout.json").unlink(missing_ok=True)  # incomplete until written again
    barrier(world)
    arrays = {"step": np.array(opt.step_count)}
    for u in range(len(trainer.units)):
        arrays[f"param.{u}"] = opt.params[u]
        arrays[f"exp_avg.{u}"] = opt.exp_avg[u]
        arrays[f"exp_avg_sq.{u}"] = opt.exp_avg_sq[u]
    _atomic_write(directory / _shard_name(world.rank, world.size), lambda f: np.savez(f, **arrays))
    barrier(world)  # every shard is in place ...
    if world.rank == 0:  # ... so the layout file can say: complete
        layout = dict(layout_of(trainer), step=opt.step_count)
        _atomic_write(directory / "layout.json", lambda f: f.write(json.dumps(layout, indent=1).encode()))
    barrier(world)


def read_layout(directory) -> dict:
    path = Path(directory) / "layout.json"
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a complete ZeRO checkpoint: no layout.json "
                                "(it is written last, so the save did not finish)")
    layout = json.loads(path.read_text())
    if layout.get("format") != FORMAT:
        raise ValueError(f"{path}: format {layout.get('format')!r}, expected {FORMAT!r}")
    return layout


def check_layout(saved: dict, mine: dict, directory) -> None:
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
    check_layout(saved, layout_of(trainer), directory)
    with np.load(Path(directory) / _shard_name(world.rank, world.size)) as shard:
        for u in range(len(trainer.units)):
            opt.params[u][...] = shard[f"param.{u}"]
            opt.exp_avg[u][...] = shard[f"exp_avg.{u}"]
            opt.exp_avg_sq[u][...] = shard[f"exp_avg_sq.{u}"]
        opt.step_count = int(shard["step"])
    trainer.all_gather_parameters()  # stages 1-2 keep the full weights: rebuilt from the chunks
    barrier(world)


def consolidate_checkpoint(directory) -> dict[str, np.ndarray]:
    """The full weights of a sharded checkpoint, keyed like the serial model (no MPI needed):
    unit u is the concatenation of every rank's chunk u, padding cut off, split into params."""
    layout = read_layout(directory)
    n = layout["dp"]
    shards = [np.load(Path(directory) / _shard_name(r, n)) for r in range(n)]
    state = {}
    try:
        for u, unit in enumerate(layout["units"]):
            flat = np.concatenate([s[f"param.{u}"] for s in shards])[:unit["numel"]]
            offset = 0
            for name, shape in unit["params"]:
                size = int(np.prod(shape, dtype=np.int64))
                state[name] = flat[offset:offset + size].reshape(shape).copy()
                offset += size
    finally:
        for s in shards:
            s.close()
    return state
