"""Expert parallelism reproduces the serial MoE run (chapter 11, part 3), under real mpiexec.

One launch on 2 ranks (ep = 2) and one on 4 (ep = 4; ep = 2 inside dp = 4; ep = 1, the MoE GPT
data-parallel), top-1 and top-2, capacity factors 1.0 and 1.25, each compared with
`MoETrainer` in float64 over 3 steps: losses, accuracies, consolidated weights (relative 1e-9),
and the routing's counts (tokens per expert, dropped tokens: the capacity-1.0 runs drop some,
and exactly the serial ones). The all-to-all traffic is checked against its formula, with S
(rows per expert in the dispatch buffer) recomputed from the serial run's routing.
"""
import numpy as np
import pytest

from conftest import check_against_serial
from minidist.comm.launch import run
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.core.moe import MoEConfig
from minidist.training.train import MoETrainer
from minidist.plan.memory import moe_param_count
from minidist.parallel.expert_parallel import check_expert_parallel, expert_parallel_traffic
from minidist.core.tensor import default_dtype
from minidist.training.train import OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, num_experts=4)
SETTINGS = dict(lr=1e-2, steps=3, warmup=1, min_lr=1e-3, clip=1.0)
STEPS, BATCH = 3, 8
TWO = [dict(ep=2, top_k=1, capacity_factor=1.0), dict(ep=2, top_k=2, capacity_factor=1.25)]
FOUR = [dict(ep=4, top_k=1, capacity_factor=1.0), dict(ep=4, top_k=2, capacity_factor=1.0),
        dict(ep=4, top_k=1, capacity_factor=1.25), dict(ep=2, top_k=2, capacity_factor=1.0),
        dict(ep=2, top_k=1, capacity_factor=1.25), dict(ep=1, top_k=1, capacity_factor=1.0)]
RESUMED = dict(ep=2, top_k=2, capacity_factor=1.0)  # also checkpointed after step 1 and resumed


def label(layout: dict) -> str:
    return f"ep{layout['ep']} k{layout['top_k']} C{layout['capacity_factor']}"


def ep_rank_program(layouts, config, settings, steps, batch, resumed):
    from minidist.comm import get_world, traffic
    from minidist.core.data import make_task
    from minidist.core.moe import MoEConfig
    from minidist.parallel import checkpointing
    from minidist.parallel.expert_parallel import ExpertParallelTrainer
    from minidist.core.tensor import default_dtype
    from minidist.training.train import OptimSettings

    out = {}
    with default_dtype("float64"):
        task = make_task("sort", config["block_size"], seed=0)
        for layout in layouts:
            options = dict(layout)
            ep = options.pop("ep")

            def make():
                return ExpertParallelTrainer(MoEConfig(**config, **options), OptimSettings(**settings), task, batch,
                                             seed=0, group=get_world(), ep=ep)

            trainer = make()
            traffic.reset()
            results = [trainer.step(s) for s in range(steps)]
            counts = traffic.snapshot()
            out[label(layout)] = {"results": results, "report": trainer.report(), "traffic": counts,
                                  "state": trainer.state_dict(), "memory": trainer.memory(),
                                  "parameters": trainer.num_parameters()}
            if layout == resumed:  # a checkpoint after step 1, loaded into a fresh trainer
                first = make()
                first.step(0)
                saved = checkpointing.snapshot(first, get_world())  # the global arrays, whole
                again = make()
                again.load_global_state(saved)
                out[label(layout)]["resumed"] = [again.step(s) for s in range(1, steps)]
    return out


@pytest.fixture(scope="module")
def two():
    return run(ep_rank_program, 2, TWO, CONFIG, SETTINGS, STEPS, BATCH, RESUMED, timeout=240)


@pytest.fixture(scope="module")
def four():
    return run(ep_rank_program, 4, FOUR, CONFIG, SETTINGS, STEPS, BATCH, RESUMED, timeout=240)


@pytest.fixture(scope="module")
def serial():
    """The serial MoE run of every (top_k, capacity_factor), with each step's routing per layer."""
    runs = {}
    for top_k, capacity_factor in {(l["top_k"], l["capacity_factor"]) for l in TWO + FOUR}:
        with default_dtype("float64"):
            trainer = MoETrainer(MoEConfig(**CONFIG, top_k=top_k, capacity_factor=capacity_factor),
                                 OptimSettings(**SETTINGS), make_task("sort", CONFIG["block_size"], seed=0), BATCH)
            steps, routings = [], []
            for s in range(STEPS):
                steps.append(trainer.step(s))
                routings.append([block.mlp.routing for block in trainer.model.h])
        runs[top_k, capacity_factor] = {"steps": steps, "state": trainer.state_dict(), "routings": routings,
                                        "moe": trainer.report()["moe"]}
    return runs


def check_moe_against_serial(results, reference):
    check_against_serial(results, reference)
    moe, serial_moe = results[0]["report"]["moe"], reference["moe"]
    for key in ("tokens_per_expert", "dropped_per_expert", "dropped_tokens", "capacity"):
        assert moe[key] == serial_moe[key], key
    np.testing.assert_allclose(moe["aux_loss"], serial_moe["aux_loss"], rtol=1e-9)


@pytest.mark.parametrize("layout", TWO, ids=label)
def test_two_ranks_reproduce_the_serial_moe_run(two, serial, layout):
    check_moe_against_serial([rank[label(layout)] for rank in two], serial[layout["top_k"], layout["capacity_factor"]])


@pytest.mark.full
@pytest.mark.parametrize("layout", FOUR, ids=label)
def test_four_ranks_reproduce_the_serial_moe_run(four, serial, layout):
    check_moe_against_serial([rank[label(layout)] for rank in four], serial[layout["top_k"], layout["capacity_factor"]])


def test_capacity_one_drops_tokens_and_parallel_drops_the_same(serial):
    for (top_k, capacity_factor), reference in serial.items():
        if capacity_factor == 1.0:
            assert all(d > 0 for d in reference["moe"]["dropped_tokens"]), (top_k, reference["moe"]["dropped_tokens"])


def slots_from_serial(routings, world: int, ep: int, rank: int) -> list[list[int]]:
    """S of every step and layer for `rank`'s ep group, from the serial routing: the most rows
    one rank of the group sends one expert (rank r owns tokens [r N/W, (r+1) N/W))."""
    first = rank - rank % ep
    slots = []
    for layers in routings:
        row = []
        for routing in layers:
            n = len(routing.experts)
            sent = np.zeros((world, routing.counts.shape[2]), int)
            for token, choice in zip(*np.nonzero(routing.kept)):
                sent[token // (n // world), routing.experts[token, choice]] += 1
            row.append(max(1, int(sent[first:first + ep].max())))
        slots.append(row)
    return slots


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.full)])
def test_all_to_all_traffic_is_its_formula(request, serial, world):
    """Per step and MoE layer, each rank sends 4 (dispatch, combine; forward, backward) x (ep-1)
    chunks of E/ep x S x C float64, and (W-1) x k x E int64 counts."""
    launched = request.getfixturevalue("two" if world == 2 else "four")  # only the launch this world needs
    for layout in (TWO if world == 2 else FOUR):
        ep, config = layout["ep"], MoEConfig(**CONFIG, top_k=layout["top_k"], capacity_factor=layout["capacity_factor"])
        routings = serial[layout["top_k"], layout["capacity_factor"]]["routings"]
        for rank, results in enumerate(launched):
            r, expected_slots = results[label(layout)], slots_from_serial(routings, world, ep, rank)
            assert r["report"]["expert_parallel"]["slots_per_expert"] == expected_slots, label(layout)
            formula = [expert_parallel_traffic(config, world, ep, s, 8) for s in expected_slots]
            sent = r["traffic"].get("all_to_all.pairwise@ep", {"bytes_sent": 0})["bytes_sent"]
            assert sent == sum(f["all_to_all"] for f in formula), label(layout)
            assert r["traffic"]["all_gather.ring@dp"]["bytes_sent"] == sum(f["counts"] for f in formula)
            assert r["report"]["expert_parallel"]["bytes_sent_per_step"] == formula
            if ep > 1:  # never more than the worst case: a whole capacity, or every token of the rank
                capacity, tokens = r["report"]["moe"]["capacity"], BATCH * CONFIG["block_size"] // world
                assert max(map(max, expected_slots)) <= min(capacity, tokens)


@pytest.mark.full
def test_resumed_from_a_checkpoint_continues_exactly(four):
    for rank in four:
        r = rank[label(RESUMED)]
        assert r["resumed"] == r["results"][1:]


@pytest.mark.full
def test_memory_holds_only_this_ranks_experts(four):
    config = MoEConfig(**CONFIG)
    h, E = CONFIG["n_embd"], CONFIG["num_experts"]
    expert = 8 * h * h + 5 * h
    for layout in FOUR:
        r = four[0][label(layout)]
        assert r["parameters"] == moe_param_count(config)
        held = moe_param_count(config) - CONFIG["n_layer"] * (E - E // layout["ep"]) * expert
        assert r["memory"]["params"] == held * 8, label(layout)


def test_bad_layouts_fail_in_one_line():
    config = MoEConfig(**CONFIG)
    for args, words in (((GPTConfig(), 4, 2), "MoE"), ((config, 4, 3), "does not divide"),
                        ((MoEConfig(**{**CONFIG, "num_experts": 6}), 4, 4), "num_experts=6"),
                        ((config, 4, 2, 6), "global batch 6"), ((config, 4, 0), "ep must be")):
        with pytest.raises(ValueError, match=words) as error:
            check_expert_parallel(*args)
        assert "\n" not in str(error.value)
