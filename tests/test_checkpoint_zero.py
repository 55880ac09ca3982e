"""ZeRO's chunks in the one checkpoint format (parallel/checkpointing.py), through the library's
calls rather than the demo: a second save replaces the first only once it is complete, a save that
died half-way is ignored, the consolidated arrays are the trainer's whole weights, and a damaged
part is refused by name on every rank. One 2-rank launch."""
import os
import shutil

import numpy as np
import pytest

from minidist.training import checkpoint
from minidist.comm.launch import run
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.core.tensor import default_dtype
from minidist.training.train import OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
SETTINGS = dict(lr=1e-2, steps=4, warmup=1, min_lr=1e-3)
RUN = {"test": "zero2, 8 rows"}  # what the checkpoint belongs to (the demo's run facts)


def trainer(world):
    from minidist.parallel.zero import ZeroTrainer

    task = make_task("sort", CONFIG["block_size"], seed=0)
    return ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, 8, group=world, stage=2)


def save_twice(directory):
    """Save after step 1 and again after step 2 into the same directory; return the weights."""
    from minidist.comm import get_world
    from minidist.parallel import checkpointing

    world = get_world()
    with default_dtype("float64"):
        t = trainer(world)
        t.step(0)
        checkpointing.save(directory, 1, t, RUN, world)
        first = sorted(os.listdir(directory))
        t.step(1)
        checkpointing.save(directory, 2, t, RUN, world)
        return first, t.state_dict()


def load(directory):
    from minidist.comm import get_world
    from minidist.parallel import checkpointing

    world = get_world()
    with default_dtype("float64"):
        t = trainer(world)
        try:
            step = checkpointing.resume(directory, t, RUN, world)
        except ValueError as error:
            return str(error)
        return step, t.state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zero") / "ckpt"
    first, state = run(save_twice, 2, str(directory), timeout=120)[0]
    return directory, first, state


def test_a_second_save_replaces_the_first_only_once_complete(saved):
    directory, first, state = saved
    assert first == ["step-000001"]
    assert sorted(p.name for p in directory.iterdir()) == ["step-000002"]
    # a later save that died half-way: its staging folder exists, half written, never read
    stray = directory / "step-000003.partial"
    stray.mkdir()
    (stray / checkpoint.part_name(0, 2)).write_bytes(b"half a file")
    step, loaded = run(load, 2, str(directory), timeout=120)[0]
    assert step == 2
    assert set(loaded) == set(state) and all(np.array_equal(loaded[k], state[k]) for k in state)


def test_the_consolidated_checkpoint_holds_the_whole_weights(saved):
    """Each rank wrote its chunks; put together they are the trainer's full weights, serial keys."""
    directory, _, state = saved
    arrays = checkpoint.consolidate(directory / "step-000002")
    weights = {k[len("param."):]: v for k, v in arrays.items() if k.startswith("param.")}
    assert set(weights) == set(state) and all(np.array_equal(weights[k], state[k]) for k in state)
    assert set(arrays) == {f"{kind}.{k}" for k in state for kind in ("param", "exp_avg", "exp_avg_sq")} | {"step"}


def test_a_damaged_part_is_refused_by_name_on_every_rank(saved, tmp_path):
    directory, _, _ = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("*.partial"))
    part = copy / "step-000002" / checkpoint.part_name(1, 2)
    part.write_bytes(part.read_bytes()[:-10])
    errors = run(load, 2, str(copy), timeout=60)  # every rank refuses: none waits for the others
    assert len(errors) == 2
    for error in errors:
        assert f"{checkpoint.part_name(1, 2)}: " in error and "the manifest says" in error
