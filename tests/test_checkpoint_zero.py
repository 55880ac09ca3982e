"""ZeRO's own sharded checkpoints (parallel/zero_checkpoint.py) are crash-safe too: a save into
an existing directory never touches the checkpoint it replaces until layout.json points at the
new shards, and a damaged shard is refused by name. One 2-rank launch."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from minidist.comm.launch import run
from minidist.data import make_task
from minidist.model import GPTConfig
from minidist.tensor import default_dtype
from minidist.train import OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
SETTINGS = dict(lr=1e-2, steps=4, warmup=1, min_lr=1e-3)


def trainer(world):
    from minidist.parallel.zero import ZeroTrainer

    task = make_task("sort", CONFIG["block_size"], seed=0)
    return ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, 8, group=world, stage=2)


def save_twice(directory):
    """Save after step 1 and again after step 2 into the same directory; return the weights."""
    from minidist.comm import get_world

    world = get_world()
    with default_dtype("float64"):
        t = trainer(world)
        t.step(0)
        t.save_checkpoint(directory)
        first = json.loads((Path(directory) / "layout.json").read_text())["shards"]
        t.step(1)
        t.save_checkpoint(directory)
        return first, t.state_dict()


def load(directory):
    from minidist.comm import get_world

    world = get_world()
    with default_dtype("float64"):
        t = trainer(world)
        try:
            t.load_checkpoint(directory)
        except ValueError as error:
            return str(error)
        return t.state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zero") / "ckpt"
    first, state = run(save_twice, 2, str(directory), timeout=120)[0]
    return directory, first, state


def test_a_second_save_replaces_the_first_only_once_complete(saved):
    directory, first, state = saved
    layout = json.loads((directory / "layout.json").read_text())
    assert layout["step"] == 2 and layout["shards"] != first
    assert sorted(p.name for p in directory.iterdir()) == sorted(["layout.json", layout["shards"]])
    # a later save that died half-way: its folder exists, layout.json still points at step 2
    stray = directory / "shards-000003-deadbeef"
    stray.mkdir()
    (stray / "shard-00000-of-00002.npz").write_bytes(b"half a file")
    loaded = run(load, 2, str(directory), timeout=120)[0]
    assert set(loaded) == set(state) and all(np.array_equal(loaded[k], state[k]) for k in state)


def test_a_damaged_shard_is_refused_by_name_on_every_rank(saved, tmp_path):
    directory, _, _ = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy)
    shard = copy / json.loads((copy / "layout.json").read_text())["shards"] / "shard-00001-of-00002.npz"
    shard.write_bytes(shard.read_bytes()[:-10])
    errors = run(load, 2, str(copy), timeout=60)  # every rank refuses: none waits for the others
    assert len(errors) == 2
    for error in errors:
        assert "shard-00001-of-00002.npz: " in error and "the manifest says" in error
