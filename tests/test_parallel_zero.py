"""ZeRO stages 1-3 reproduce the serial run (chapter 8), under real mpiexec with 2, 3, 4 ranks,
and with 4 ranks as 2 nodes x 2.

One launch per world size runs every stage for a few float64 steps, then a checkpoint round
trip (2 steps, save, a fresh trainer loads, 1 more step; one process resumes it too), and records
memory and traffic. The
serial reference runs here, in the test process, on the same global batches.
"""
import numpy as np
import pytest
from conftest import layout, relative_difference, serial_run

from minidist.comm.cost import zero_bytes_sent
from minidist.core.data import make_task
from minidist.comm.launch import run
from minidist.core.model import GPT, GPTConfig
from minidist.core.tensor import default_dtype
from minidist.training.train import OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
STEPS, BATCH = 3, 12  # 12 rows split evenly for dp = 2, 3, 4
SETTINGS = dict(lr=1e-2, steps=STEPS, warmup=1, min_lr=1e-3, clip=1.0)
STAGES = (1, 2, 3)


def zero_rank_program(checkpoint_root):
    from minidist.comm import CollectiveMismatch, get_world, traffic
    from minidist.parallel import checkpointing
    from minidist.parallel.zero import ZeroTrainer

    world = get_world()
    out = {}
    with default_dtype("float64"):
        task = make_task("sort", CONFIG["block_size"], seed=0)

        def trainer(stage):
            return ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, seed=0,
                               group=world, stage=stage)

        for stage in STAGES:
            t = trainer(stage)
            traffic.reset()  # the steps only, not the set-up's checks
            losses = [t.step(s)[0] for s in range(STEPS)]
            kinds = traffic.snapshot()
            # checkpoint round trip: 2 steps, save, a fresh trainer loads and takes the 3rd
            first = trainer(stage)
            for s in range(STEPS - 1):
                first.step(s)
            directory = f"{checkpoint_root}/dp{world.size}-zero{stage}"
            checkpointing.save(directory, STEPS - 1, first, {}, world)
            resumed = trainer(stage)
            checkpointing.resume(directory, resumed, {}, world)
            resumed_loss = resumed.step(STEPS - 1)[0]
            out[stage] = {
                "losses": losses,
                "state": t.state_dict(),
                "memory": t.memory(),
                "bytes_sent": {k: v["bytes_sent"] / STEPS for k, v in kinds.items() if k not in ("total", "check")},
                "padded": [u.padded for u in t.units],
                "chunks": [u.chunk for u in t.units],
                "resumed_loss": resumed_loss,
                "resumed_state": resumed.state_dict(),
                "has_model": t.model is not None,
                "class": type(t).__name__,
                "name": t.name,
            }
        try:  # 13 rows cannot be split evenly over 2, 3 or 4 ranks
            ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, 13, group=world, stage=2)
            out["bad_batch"] = None
        except ValueError as error:
            out["bad_batch"] = str(error)
        try:  # every rank seeds its own weights: refused when the trainer is built, on every rank
            ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, seed=world.rank,
                        group=world, stage=1)
            out["mismatch"] = None
        except CollectiveMismatch as error:
            out["mismatch"] = str(error)
    return out


@pytest.fixture(scope="module")
def serial():
    reference = serial_run(CONFIG, SETTINGS, BATCH, STEPS)
    return reference["losses"], reference["state"]


@pytest.fixture(scope="module", params=[layout(2), layout(3), layout(4), layout(4, nodes=2)])
def parallel(request, tmp_path_factory):
    n, nodes, tcp = request.param
    root = tmp_path_factory.mktemp(f"zero-dp{n}")
    return n, root, run(zero_rank_program, n, str(root), timeout=240, nodes=nodes, tcp=tcp)


@pytest.mark.parametrize("stage", STAGES)
def test_zero_equals_serial(serial, parallel, stage):
    n, _, results = parallel
    serial_losses, serial_state = serial
    assert len(results) == n
    for rank, result in enumerate(results):
        got = result[stage]
        np.testing.assert_allclose(got["losses"], serial_losses, rtol=1e-9, err_msg=f"dp={n} rank {rank} zero{stage}")
        assert set(got["state"]) == set(serial_state)
        for key, value in serial_state.items():
            diff = relative_difference(got["state"][key], value)
            assert diff <= 1e-9, f"dp={n} rank {rank} zero{stage}: {key} differs from serial by {diff:.2e}"
    assert results[0][stage]["has_model"] == (stage < 3)


@pytest.mark.parametrize("stage", STAGES)
def test_resume_from_sharded_checkpoint_is_bit_for_bit(parallel, stage):
    n, _, results = parallel
    assert len(results) == n
    for rank, result in enumerate(results):
        got = result[stage]
        assert got["resumed_loss"] == got["losses"][-1], (n, rank, stage)
        for key, value in got["state"].items():
            assert np.array_equal(got["resumed_state"][key], value), (n, rank, stage, key)


def test_consolidated_checkpoint_loads_into_the_serial_model(parallel):
    """The weights after 2 steps, consolidated from N part files, are the serial run's."""
    from minidist.training import checkpoint

    n, root, _ = parallel
    expected = serial_run(CONFIG, SETTINGS, BATCH, STEPS - 1)["state"]
    with default_dtype("float64"):
        for stage in STAGES:
            arrays = checkpoint.consolidate(checkpoint.latest(root / f"dp{n}-zero{stage}"))
            state = {k[len("param."):]: v for k, v in arrays.items() if k.startswith("param.")}
            model = GPT(GPTConfig(**CONFIG))
            model.load_state_dict(state)  # strict: exactly the serial keys and shapes
            assert len(state) == len(expected)
            for key, value in expected.items():
                assert relative_difference(state[key], value) <= 1e-9, (n, stage, key)


def test_checkpoint_from_another_layout_is_resharded(parallel):
    """A single-process (dp=1) ZeRO-1 trainer resumes each stage's dp=N checkpoint: it cuts its
    one chunk from the saved pieces and takes the 3rd step as the N ranks did. A directory with
    no complete checkpoint gives None: nothing to resume."""
    from minidist.parallel import checkpointing
    from minidist.parallel.zero import ZeroTrainer

    n, root, results = parallel
    with default_dtype("float64"):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        for stage in STAGES:
            trainer = ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, stage=1)
            assert checkpointing.resume(root / f"dp{n}-zero{stage}", trainer, {}, trainer.group) == STEPS - 1
            loss = trainer.step(STEPS - 1)[0]
            assert abs(loss - results[0][stage]["resumed_loss"]) <= 1e-10 * loss, (n, stage)
            for key, value in results[0][stage]["resumed_state"].items():
                assert relative_difference(trainer.state_dict()[key], value) <= 1e-9, (n, stage, key)
        (root / "incomplete").mkdir(exist_ok=True)
        assert checkpointing.resume(root / "incomplete", trainer, {}, trainer.group) is None


def test_memory_per_stage_matches_the_formulas(parallel):
    """fp64 AdamW keeps 8 + 8 + 16 bytes per parameter; each stage divides its piles by N
    (of the padded units): stage 1 the optimizer, stage 2 also the gradients, stage 3 all."""
    n, _, results = parallel
    assert len(results) == n
    for result in results:
        padded = sum(result[1]["padded"]) * 8  # bytes of one full copy, padding included
        for stage in STAGES:
            m = result[stage]["memory"]
            assert m["optimizer"] == 2 * padded // n
            assert m["grads"] == (padded if stage == 1 else padded // n)
            assert m["params"] == (padded if stage < 3 else padded // n)
            assert m["peak"] == sum(m[k] for k in ("params", "grads", "optimizer", "activations", "transient"))
        # stage 3 gathers the root unit and one block at a time, never the whole model
        assert result[3]["memory"]["gathered"] == (result[3]["padded"][0] + max(result[3]["padded"][1:])) * 8
        assert result[3]["memory"]["transient"] >= result[3]["memory"]["gathered"]
        states = [sum(result[s]["memory"][k] for k in ("params", "grads", "optimizer")) for s in STAGES]
        assert states[0] > states[1] > states[2]
        for pile in ("params", "grads", "optimizer"):  # each stage keeps no pile bigger than the last
            kept = [result[s]["memory"][pile] for s in STAGES]
            assert kept[0] >= kept[1] >= kept[2], (n, pile, kept)


def test_each_stage_is_its_own_class(parallel):
    """ZeroTrainer(stage=S) builds ZeroSTrainer, named zeroS; a layout that differs between
    ranks (here: each rank seeds its own weights) or a batch that does not split is refused."""
    from minidist.parallel.zero import Zero1Trainer, Zero2Trainer, Zero3Trainer

    n, _, results = parallel
    assert len(results) == n
    assert issubclass(Zero3Trainer, Zero2Trainer) and issubclass(Zero2Trainer, Zero1Trainer)
    for result in results:
        assert [(result[s]["class"], result[s]["name"]) for s in STAGES] == \
            [("Zero1Trainer", "zero1"), ("Zero2Trainer", "zero2"), ("Zero3Trainer", "zero3")]
        assert result["mismatch"] is not None and "the ZeRO units: not the same on every rank" in result["mismatch"]
        assert result["bad_batch"] == f"global batch 13 is not divisible by dp={n}"


def test_traffic_stage_1_and_2_equal_data_parallel_stage_3_half_more(parallel):
    """Per rank per step: stages 1-2 reduce-scatter + all-gather = one ring all-reduce,
    2(N-1)/N x S; stage 3 gathers the blocks twice and the root once: (N-1)/N x (2S + S_blocks)."""
    n, _, results = parallel
    assert len(results) == n
    for result in results:
        padded = result[1]["padded"]
        full, blocks = sum(padded) * 8, sum(padded[1:]) * 8
        for stage in STAGES:
            sent = result[stage]["bytes_sent"]
            moved = sent.get("reduce_scatter.ring", 0) + sent.get("all_gather.ring", 0)
            expected = (n - 1) / n * (2 * full if stage < 3 else 2 * full + blocks)
            assert moved == pytest.approx(expected, rel=1e-12), (n, stage, sent)
            assert zero_bytes_sent(stage, n, padded, 8) == pytest.approx(expected, rel=1e-12)
            # and nothing else but the small all-reduces of the norm and the (loss, accuracy)
            others = sum(v for k, v in sent.items() if not k.startswith(("reduce_scatter", "all_gather")))
            assert others <= 2 * 16 * n


def test_bad_stage_and_batch_are_refused():
    from minidist.parallel.zero import ZeroTrainer

    task = make_task("sort", CONFIG["block_size"], seed=0)
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, stage=0)
    trainer = ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, stage=3)
    assert trainer.report() == {} and trainer.model is None  # the face every trainer has (train.Trainer)
