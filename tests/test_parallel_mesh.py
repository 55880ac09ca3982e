"""Composed layouts reproduce the serial run (chapter 9), under real mpiexec.

One launch on 4 ranks runs every factorisation of 4 into dp x tp x pp, with ZeRO where it is
allowed (stage 1 in any mesh; stages 2 and 3 over dp x tp), with sequence parallelism, the
interleaved schedule and untied embeddings; one launch on 8 ranks runs dp2 x tp2 x pp2, plain
and with ZeRO-1 and sequence parallelism. Each is compared with the serial run in float64:
losses, accuracies and the consolidated final weights, relative 1e-9. Gradient clipping is on
(the serial norms exceed 1), so the global norm over tp and pp is tested too.

Traffic per mesh axis, from the labelled counters, each beside its formula: dp sends the
rank's own shard (2(N-1)/N of its bytes, here N = 2), pp one activation per micro-batch, the
embedding group the tied weight's gradient once, tp what chapter 6's formula predicts.
"""
import numpy as np
import pytest

from conftest import check_against_serial, serial_run
from minidist.comm.launch import run
from minidist.core.model import GPTConfig
from minidist.parallel.composed import check_composed, mesh_name

CONFIG = dict(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=16)
SMALL = dict(CONFIG, n_layer=2, n_embd=8, n_head=2)  # 8 ranks on 2 cores: the smallest model
SETTINGS = dict(lr=1e-2, steps=3, warmup=1, min_lr=1e-3, clip=1.0)
STEPS, BATCH = 3, 8

FACTORISATIONS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
FOUR = ([dict(dp=dp, tp=tp, pp=pp) for dp, tp, pp in FACTORISATIONS]
        + [dict(dp=dp, tp=tp, pp=pp, zero=1) for dp, tp, pp in FACTORISATIONS if dp > 1]
        + [dict(dp=2, tp=2, zero=2), dict(dp=2, tp=2, zero=3),
           dict(dp=2, tp=2, zero=3, sequence_parallel=True, tied=False),
           dict(dp=2, tp=2, sequence_parallel=True), dict(tp=2, pp=2, sequence_parallel=True),
           dict(tp=2, pp=2, microbatches=4, schedule="interleaved"),
           dict(dp=2, pp=2, schedule="gpipe", tied=False)])
EIGHT = [dict(dp=2, tp=2, pp=2), dict(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True)]


def label(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items() if not (k in ("dp", "tp", "pp") and v == 1))


def mesh_rank_program(layouts, config):
    from minidist.comm import get_world, traffic
    from minidist.core.data import make_task
    from minidist.core.model import GPTConfig
    from minidist.parallel.composed import MeshTrainerFor
    from minidist.parallel.zero_tensor import STAGES
    from minidist.core.tensor import default_dtype
    from minidist.training.train import OptimSettings

    out = {}
    with default_dtype("float64"):
        task = make_task("sort", config["block_size"], seed=0)
        for layout in layouts:
            options = dict(layout)
            zero, tied = options.pop("zero", 0), options.pop("tied", True)
            if options.get("pp", 1) > 1:
                options.setdefault("microbatches", 2)
            trainer_class = STAGES[zero] if zero >= 2 else MeshTrainerFor(zero)
            trainer = trainer_class(GPTConfig(**config, tie_weights=tied), OptimSettings(**SETTINGS), task, BATCH,
                                    seed=0, group=get_world(), **options)
            traffic.reset()  # the steps' messages only (not the set-up's broadcasts)
            results = [trainer.step(s) for s in range(STEPS)]
            counts = traffic.snapshot()
            stage = getattr(trainer, "stage", None)
            out[label(layout)] = {
                "results": results, "state": trainer.state_dict(), "traffic": counts,
                "param_bytes": sum(p.data.nbytes for p in stage.parameters()) if not isinstance(stage, int) else None,
                "padded_bytes": sum(u.padded * 8 for u in trainer.units) if hasattr(trainer, "units") else None,
                "place": trainer.mesh.place}
    return out


@pytest.fixture(scope="module")
def four():
    return run(mesh_rank_program, 4, FOUR, CONFIG, timeout=240)


@pytest.fixture(scope="module")
def eight():
    return run(mesh_rank_program, 8, EIGHT, SMALL, timeout=240)


@pytest.fixture(scope="module")
def serial():
    return {(name, tied): serial_run(config, SETTINGS, BATCH, STEPS, tie_weights=tied)
            for name, config in (("four", CONFIG), ("eight", SMALL)) for tied in (True, False)}


@pytest.mark.parametrize("layout", FOUR, ids=label)
def test_every_factorisation_of_four_ranks_reproduces_serial(four, serial, layout):
    check_against_serial([rank[label(layout)] for rank in four], serial["four", layout.get("tied", True)])


@pytest.mark.full
@pytest.mark.parametrize("layout", EIGHT, ids=label)
def test_dp2_tp2_pp2_on_eight_ranks_reproduces_serial(eight, serial, layout):
    check_against_serial([rank[label(layout)] for rank in eight], serial["eight", True])


def bytes_sent(counts: dict, group: str) -> int:
    """Bytes this rank sent in its mesh group `group` ("dp", "tp", "pp", "embedding")."""
    return sum(c["bytes_sent"] for kind, c in counts.items() if kind.endswith("@" + group))


def test_dp_traffic_is_the_ranks_own_shard(four):
    """dp = 2: an all-reduce of S bytes sends 2(N-1)/N x S = S per rank, once per step (not per
    micro-batch), of this rank's stage-and-shard only; plus the loss's 2 numbers."""
    for layout in (dict(dp=2, tp=2), dict(dp=2, pp=2)):
        for rank in four:
            r = rank[label(layout)]
            assert bytes_sent(r["traffic"], "dp") == STEPS * (r["param_bytes"] + 16), (layout, r["place"])
    for rank in four:  # ZeRO-1: reduce-scatter + all-gather of the padded units, plus the norm and the loss
        r = rank[label(dict(dp=2, pp=2, zero=1))]
        assert bytes_sent(r["traffic"], "dp") == STEPS * (r["padded_bytes"] + 8 + 16)


def test_pp_traffic_is_one_activation_per_microbatch(four):
    """Each rank of a 2-stage pipeline sends m messages of (B/dp/m) x T x C float64 per step:
    activations forward (stage 0) or their gradients backward (stage 1); with sequence
    parallelism, 1/t of the sequence."""
    T, C = CONFIG["block_size"], CONFIG["n_embd"]
    for layout, rows, tokens in ((dict(dp=2, pp=2), BATCH // 2, T), (dict(tp=2, pp=2), BATCH, T),
                                 (dict(tp=2, pp=2, sequence_parallel=True), BATCH, T // 2)):
        for rank in four:
            r = rank[label(layout)]
            assert r["traffic"]["pipeline@pp"]["bytes_sent"] == STEPS * rows * tokens * C * 8, layout
            assert r["traffic"]["pipeline@pp"]["messages"] == STEPS * 2  # m = 2 micro-batches


def test_tied_embedding_gradient_crosses_the_embedding_group_once_per_step(four):
    V, C = CONFIG["vocab_size"], CONFIG["n_embd"]
    for layout, tp in ((dict(dp=2, pp=2), 1), (dict(tp=2, pp=2), 2), (dict(pp=4), 1)):
        for rank in four:
            r = rank[label(layout)]
            holds = r["place"].embedding is not None and len(r["place"].embedding) == 2
            assert bytes_sent(r["traffic"], "embedding") == (STEPS * V // tp * C * 8 if holds else 0), layout
    for rank in four:  # untied: nothing to share
        assert bytes_sent(rank[label(dict(dp=2, pp=2, schedule="gpipe", tied=False))]["traffic"], "embedding") == 0


def test_tp_traffic_matches_chapter_6_formula(four):
    """dp x tp: each tp group runs chapter 6's step on its replica's B/dp rows."""
    from minidist.comm.cost import tensor_parallel_traffic_per_step

    want = tensor_parallel_traffic_per_step(GPTConfig(**CONFIG), BATCH // 2, 2, itemsize=8, one_machine=True)
    for rank in four:
        assert bytes_sent(rank[label(dict(dp=2, tp=2))]["traffic"], "tp") == STEPS * want["bytes_sent"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=4, dp=2, tp=1, pp=1), "pp=1 x dp=2 x tp=1 = 2 ranks, but the world has 4"),
    (dict(world_size=4, dp=1, tp=4, pp=1, heads=2), "tp=4 does not divide n_head=2"),
    (dict(world_size=4, dp=2, tp=1, pp=2, batch=7), "global batch 7 does not split over dp=2"),
    (dict(world_size=4, dp=2, tp=1, pp=2, microbatches=3), "does not split into 3 micro-batches"),
    (dict(world_size=4, dp=2, tp=1, pp=2, zero=2), "stages 2 and 3 shard the gradients"),
    (dict(world_size=8, dp=1, tp=1, pp=8), "pp=8 stages but n_layer=4"),
])
def test_bad_meshes_fail_in_one_line_before_any_message(kwargs, message):
    kwargs = dict(kwargs)
    config = GPTConfig(**dict(CONFIG, n_head=kwargs.pop("heads", CONFIG["n_head"])))
    batch = kwargs.pop("batch", BATCH)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as error:
        check_composed(config, batch_size=batch, **kwargs)
    assert "\n" not in str(error.value)


def test_mesh_names_list_the_degrees_above_one():
    assert mesh_name(2, 2, 1) == "dp2-tp2" and mesh_name(1, 2, 2) == "tp2-pp2"
    assert mesh_name(2, 2, 2, zero=1, sequence_parallel=True) == "dp2-tp2-pp2-sp-zero1"


def recompute_in_a_mesh():
    """tp2 x pp2 with dropout, with and without sequence parallelism: full recomputation of each
    stage's blocks (chapter 11) against none."""
    from minidist.comm import get_world
    from minidist.core.data import make_task
    from minidist.parallel.composed import MeshTrainer
    from minidist.core.tensor import default_dtype
    from minidist.training.train import OptimSettings

    out = {}
    with default_dtype("float64"):
        for sequence_parallel in (False, True):
            for mode in ("none", "full"):
                trainer = MeshTrainer(GPTConfig(**dict(SMALL, dropout=0.1)), OptimSettings(**SETTINGS),
                                      make_task("sort", SMALL["block_size"], seed=0), BATCH, group=get_world(), tp=2,
                                      pp=2, microbatches=2, sequence_parallel=sequence_parallel)
                if mode == "full":
                    trainer.stage.set_recompute("full")
                results = [trainer.step(s) for s in range(STEPS)]
                out[sequence_parallel, mode] = (results, trainer.memory()["activations"], trainer.state_dict())
    return out


@pytest.mark.full
def test_recomputation_composes_with_tensor_and_sequence_parallelism():
    """The recomputed blocks issue their tensor-parallel collectives again in backward, on every
    rank alike; dropout's masks are replayed: the same numbers bit for bit, fewer activations."""
    for rank in run(recompute_in_a_mesh, 4, timeout=240):
        for sequence_parallel in (False, True):
            (plain, plain_bytes, plain_state), (again, again_bytes, again_state) = (
                rank[sequence_parallel, "none"], rank[sequence_parallel, "full"])
            assert again == plain and again_bytes < plain_bytes
            if plain_state is not None:
                assert all(np.array_equal(again_state[k], v) for k, v in plain_state.items())
