"""Expert parallelism on the mesh: MoE layers in pipeline stages and over tensor-parallel ranks
(chapter 11, part 3; minidist/parallel/expert_stage.py), under real mpiexec.

Each layout is compared in float64 over 3 steps with `MoETrainer` running the same micro-batches
(routing, capacity and the balance loss follow the micro-batch): losses, accuracies, the
consolidated weights (relative 1e-9, gradient clipping on, so the norm over tp, pp and ep is
checked too), and the routing's counts, dropped tokens included (capacity factor 1.0 drops some).
The all-to-all and the counts' all-gather are checked against their formula on every rank, and one
layout is saved after step 1 and resumed.
"""
import numpy as np
import pytest

from conftest import check_against_serial
from minidist.comm.launch import run
from minidist.core.data import make_task
from minidist.core.moe import MoEConfig
from minidist.core.tensor import default_dtype
from minidist.training.layout import Layout
from minidist.training.train import MoETrainer, OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=16, num_experts=4)
SETTINGS = dict(lr=1e-2, steps=3, warmup=1, min_lr=1e-3, clip=1.0)
STEPS, BATCH = 3, 12
TWO = [dict(pp=2, m=2, top_k=2), dict(tp=2, m=1, top_k=1), dict(dp=2, ep=2, m=2, top_k=2),
       dict(pp=2, m=2, top_k=1, schedule="interleaved", v=2), dict(dp=2, ep=2, m=2, top_k=1, zero=1)]
THREE = [dict(pp=3, m=3, top_k=1), dict(dp=3, m=2, top_k=2)]
FOUR = [dict(dp=2, pp=2, ep=2, m=2, top_k=2), dict(dp=2, tp=2, ep=2, m=1, top_k=1),
        dict(tp=2, pp=2, m=2, top_k=2), dict(dp=2, tp=2, ep=2, m=3, top_k=2), dict(dp=4, ep=2, m=3, top_k=1),
        dict(dp=2, tp=2, ep=2, m=2, top_k=2, zero=1), dict(dp=2, pp=2, ep=2, m=2, top_k=1, zero=1)]
RESUMED = FOUR[0]
RESUMED_ZERO = FOUR[-1]


def label(layout: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in layout.items())


def options(layout: dict) -> dict:
    """The trainer's arguments for a layout of this file."""
    return dict(dp=layout.get("dp", 1), tp=layout.get("tp", 1), pp=layout.get("pp", 1), ep=layout.get("ep", 1),
                microbatches=layout["m"], schedule=layout.get("schedule", "1f1b"), virtual_stages=layout.get("v"))


def mesh_rank_program(layouts, config, settings, steps, batch, resumed):
    from minidist.comm import get_world, traffic
    from minidist.core.data import make_task
    from minidist.core.moe import MoEConfig
    from minidist.core.tensor import default_dtype
    from minidist.parallel import checkpointing
    from minidist.parallel.expert_stage import ExpertMeshTrainer, ExpertMeshZero1Trainer
    from minidist.training.train import OptimSettings

    out = {}
    with default_dtype("float64"):
        task = make_task("sort", config["block_size"], seed=0)
        for layout in layouts:
            def make():
                kind = ExpertMeshZero1Trainer if layout.get("zero") else ExpertMeshTrainer
                return kind(MoEConfig(**config, top_k=layout["top_k"], capacity_factor=1.0),
                                         OptimSettings(**settings), task, batch, seed=0, group=get_world(),
                                         **options(layout))

            trainer = make()
            traffic.reset()
            results = [trainer.step(s) for s in range(steps)]
            counts = traffic.snapshot()
            out[label(layout)] = {"results": results, "report": trainer.report(), "traffic": counts,
                                  "state": trainer.state_dict(), "parameters": trainer.num_parameters()}
            if layout in resumed:  # a checkpoint after step 1, loaded into a fresh trainer
                first = make()
                first.step(0)
                saved = checkpointing.snapshot(first, get_world())
                again = make()
                again.load_global_state(saved)
                out[label(layout)]["resumed"] = [again.step(s) for s in range(1, steps)]
    return out


@pytest.fixture(scope="module")
def launched():
    return {}


def launch(launched, world):
    if world not in launched:
        layouts = {2: TWO, 3: THREE, 4: FOUR}[world]
        launched[world] = run(mesh_rank_program, world, layouts, CONFIG, SETTINGS, STEPS, BATCH,
                              [RESUMED, RESUMED_ZERO], timeout=300)
    return launched[world]


@pytest.fixture(scope="module")
def serial():
    """MoETrainer with each (top_k, micro-batches) of the layouts: the reference."""
    runs = {}
    for top_k, m in {(l["top_k"], l["m"]) for l in TWO + THREE + FOUR}:
        with default_dtype("float64"):
            trainer = MoETrainer(MoEConfig(**CONFIG, top_k=top_k, capacity_factor=1.0), OptimSettings(**SETTINGS),
                                 make_task("sort", CONFIG["block_size"], seed=0), BATCH, microbatches=m)
            steps = [trainer.step(s) for s in range(STEPS)]
        runs[top_k, m] = {"steps": steps, "state": trainer.state_dict(), "moe": trainer.report()["moe"]}
    return runs


CASES = [pytest.param(2, layout, id=f"2-{label(layout)}") for layout in TWO]
CASES += [pytest.param(w, layout, id=f"{w}-{label(layout)}", marks=pytest.mark.full)
          for w, layouts in ((3, THREE), (4, FOUR)) for layout in layouts]


@pytest.mark.parametrize("world, layout", CASES)
def test_the_mesh_reproduces_the_serial_moe_run(launched, serial, world, layout):
    results = [rank[label(layout)] for rank in launch(launched, world)]
    reference = serial[layout["top_k"], layout["m"]]
    check_against_serial(results, reference)
    moe = results[0]["report"]["moe"]
    for key in ("tokens_per_expert", "dropped_per_expert", "dropped_tokens", "capacity"):
        assert moe[key] == reference["moe"][key], key
    np.testing.assert_allclose(moe["aux_loss"], reference["moe"]["aux_loss"], rtol=1e-9)
    assert all(r["parameters"] == results[0]["parameters"] for r in results)


def test_capacity_one_drops_tokens_in_every_reference(serial):
    for key, reference in serial.items():
        assert all(d > 0 for d in reference["moe"]["dropped_tokens"]), key


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.full)])
def test_traffic_is_the_formula_on_every_rank(launched, world):
    """Each rank sends, per pass of a micro-batch through one of its stage's MoE layers, 4 x
    (ep - 1) chunks of E/ep x S x C float64 over its ep group and (dp - 1) x k x E counts."""
    for layout in {2: TWO, 4: FOUR}[world]:
        dp, ep = layout.get("dp", 1), layout.get("ep", 1)
        for rank in launch(launched, world):
            r = rank[label(layout)]
            formula = r["report"]["expert_parallel"]["bytes_sent_per_step"]
            sent = r["traffic"].get("all_to_all.pairwise@ep", {"bytes_sent": 0})["bytes_sent"]
            assert sent == sum(f["all_to_all"] for f in formula), label(layout)
            counts = r["traffic"].get("all_gather.ring@dp", {"bytes_sent": 0})["bytes_sent"]
            if not layout.get("zero"):  # (ZeRO-1's all-gather of the weights runs over dp too)
                assert counts == sum(f["counts"] for f in formula), label(layout)
            passes = CONFIG["n_layer"] // layout.get("pp", 1) * layout["m"]
            for f in formula:  # the counts' share, from the layout alone
                assert f["counts"] == passes * (dp - 1) * layout["top_k"] * CONFIG["num_experts"] * 8
            if ep == 1:
                assert sent == 0


@pytest.mark.full
def test_resumed_from_a_checkpoint_continues_exactly(launched):
    for rank in launch(launched, 4):
        for layout in (RESUMED, RESUMED_ZERO):
            r = rank[label(layout)]
            assert r["resumed"] == r["results"][1:], label(layout)


def test_layouts_with_experts_pass_the_one_rule():
    config = MoEConfig(**CONFIG)
    for world, layouts in ((2, TWO), (3, THREE), (4, FOUR)):
        for layout in layouts:
            o = options(layout)
            name = Layout(dp=o["dp"], tp=o["tp"], pp=o["pp"], ep=o["ep"], microbatches=o["microbatches"],
                          zero=layout.get("zero", 0),
                          schedule=layout.get("schedule", "1f1b") if o["pp"] > 1 else None,
                          virtual_stages=o["virtual_stages"] or 1)
            assert name.why_invalid(config, world, BATCH) is None, name
    for change, words in ((dict(dp=2, zero=2), "--zero 2"), (dict(cp=2), "--cp"),
                          (dict(tp=2, sequence_parallel=True), "--sequence-parallel")):
        why = Layout(**change).why_invalid(config, 2, BATCH)
        assert why is not None and words in why and "\n" not in why
