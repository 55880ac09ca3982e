"""Context parallelism reproduces serial attention and the serial run (chapter 11), under real mpiexec.

Ring attention and DeepSpeed-Ulysses, with the contiguous and the zigzag split: one launch on 4
ranks compares their outputs and gradients with the serial kernel's (cp = 4 over the world, and
cp = 2 over each half), counts their messages against the formulas, and their score entries and
saved bytes against T²/N. A second launch trains the tiny GPT for 3 float64 steps with cp = 4,
cp = 2 and cp = 2 x dp = 2, every algorithm and split, and compares losses, accuracies and
final weights with the serial run to 1e-9.
"""
import numpy as np
import pytest

from conftest import relative_difference, serial_run
from minidist.comm.launch import run
from minidist.core.model import GPTConfig
from minidist.parallel.context_parallel import (ALGORITHMS, SPLITS, SequenceSplit, check_context_parallel,
                                                context_parallel_name, context_parallel_traffic_per_step,
                                                parse_context_parallel_name, ring_attention_traffic)
from minidist.parallel.ulysses import ulysses_traffic

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=16)
SETTINGS = dict(lr=1e-2, steps=3, warmup=1, min_lr=1e-3, clip=1.0)
STEPS, BATCH = 3, 4
SHAPE = (2, 4, 16, 3)  # (B, H, T, D) of the attention tests
LAYOUTS = [dict(cp=cp, dp=dp, algorithm=algorithm, split=split) for cp, dp in ((4, 1), (2, 1), (2, 2))
           for algorithm in ALGORITHMS for split in SPLITS]


def label(layout: dict) -> str:
    return context_parallel_name(**layout)


# ----------------------------------------------------------------------------- arithmetic, no messages


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    split = SequenceSplit(16, 2, "zigzag")
    assert split.positions(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert split.positions(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert SequenceSplit(16, 2, "contiguous").positions(1).tolist() == list(range(8, 16))
    assert sorted(SequenceSplit(16, 4).order().tolist()) == list(range(16))


def test_zigzag_balances_the_causal_scores():
    """Query i sees i+1 keys. Contiguous: rank r sees r·(T/N)² + (T/N)(T/N+1)/2; zigzag: all equal."""
    contiguous, zigzag = SequenceSplit(16, 4, "contiguous"), SequenceSplit(16, 4, "zigzag")
    assert [contiguous.unmasked_scores(r) for r in range(4)] == [10, 26, 42, 58]
    assert [zigzag.unmasked_scores(r) for r in range(4)] == [34] * 4
    assert sum(zigzag.unmasked_scores(r) for r in range(4)) == 16 * 17 // 2
    # the ring computes whole blocks of chunks: zigzag 2N+1 blocks of (T/2N)² per rank, contiguous r+1 of (T/N)²
    assert [zigzag.computed_scores(r) for r in range(4)] == [9 * 4] * 4
    assert [contiguous.computed_scores(r) for r in range(4)] == [16, 32, 48, 64]
    assert contiguous.computed_scores(3, causal=False) == 16 * 16 // 4  # T²/N without a mask


@pytest.mark.parametrize("changes, message", [
    (dict(cp=3), "T=16 is not divisible by 2 x cp = 6"),
    (dict(cp=3, split="contiguous"), "T=16 is not divisible by cp=3"),
    (dict(cp=8, algorithm="ulysses", world_size=8), "n_head=4 is not divisible by cp=8"),
    (dict(cp=2, dp=2, world_size=8), "cp=2 x dp=2 = 4 ranks, but the world has 8"),
    (dict(cp=2, dp=3, world_size=6, batch_size=4), "global batch 4 does not split over dp=3"),
    (dict(cp=2, algorithm="flash"), "algorithm 'flash'"),
    (dict(cp=2, dropout=0.1), "dropout=0.1 is not supported"),
])
def test_bad_layouts_fail_in_one_line(changes, message):
    changes = dict(changes)
    config = GPTConfig(**CONFIG, dropout=changes.pop("dropout", 0.0))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as error:
        check_context_parallel(config, **changes)
    assert "\n" not in str(error.value)


def test_traffic_formulas():
    # ring, N = 4: a K/V block is 2 x B·H·(T/N)·D = 2 x 2·4·4·3 = 192 elements
    ring = ring_attention_traffic(2, 4, 16, 3, 4, itemsize=8)
    assert ring == {"forward": 3 * 192 * 8, "backward": 6 * 192 * 8, "bytes": 9 * 192 * 8, "messages": 9}
    # Ulysses, N = 4: 4 all-to-alls of S = 96 (q, k, v count 3), each sending 3/4 of it
    assert ulysses_traffic(2, 4, 16, 3, 4, itemsize=8) == {"forward": 3 * 96 * 8, "backward": 3 * 96 * 8,
                                                          "bytes": 6 * 96 * 8, "messages": 12}
    config = GPTConfig(**CONFIG)
    assert context_parallel_traffic_per_step(config, 2, 2) == 2 * ring_attention_traffic(2, 4, 16, 4, 2)["bytes"]


def test_names():
    assert [label(layout) for layout in LAYOUTS[:4]] == ["cp4", "cp4-contiguous", "cp4-ulysses",
                                                        "cp4-ulysses-contiguous"]
    assert label(dict(cp=2, dp=2)) == "dp2-cp2"
    for layout in LAYOUTS:  # the name says the layout: the demo builds the trainer from it
        assert parse_context_parallel_name(label(layout)) == layout
    assert [parse_context_parallel_name(kind) for kind in ("dp2", "dp2-tp2", "cp", "cp2-ring")] == [None] * 4


# ----------------------------------------------------------------------------- attention on 4 ranks


def attention_rank_program(shape):
    from minidist.comm import get_world, traffic
    from minidist.parallel.context_parallel import AttentionStats, SequenceSplit, ring_attention
    from minidist.parallel.ulysses import ulysses_attention
    from minidist.core.tensor import Tensor, default_dtype, graph_bytes

    world = get_world()
    groups = {4: world.split(color=0, label="cp").verify("test", shape),
              2: world.split(color=world.rank // 2, label="cp").verify("test", shape)}
    q, k, v, w = np.random.default_rng(0).normal(size=(4, *shape))  # the same on every rank
    out = {}
    with default_dtype("float64"):
        for cp, group in groups.items():
            for algorithm in ("ring", "ulysses"):
                for kind in ("zigzag", "contiguous"):
                    for causal in (True, False):
                        split = SequenceSplit(shape[2], cp, kind)
                        positions = split.positions(group.rank)
                        mine = [Tensor(np.ascontiguousarray(a[:, :, positions]), requires_grad=True) for a in (q, k, v)]
                        stats = AttentionStats()
                        traffic.reset()
                        if algorithm == "ring":
                            y = ring_attention(*mine, group, split, causal=causal, stats=stats)
                        else:
                            y = ulysses_attention(*mine, group, split.order(), causal=causal, stats=stats)
                        forward = traffic.snapshot()["total"]
                        saved = graph_bytes(y)
                        (y * Tensor(w[:, :, positions])).sum().backward()
                        out[cp, algorithm, kind, causal] = {
                            "positions": positions, "y": y.data, "grads": [t.grad for t in mine],
                            "forward_bytes": forward["bytes_sent"], "traffic": traffic.snapshot(),
                            "stats": vars(stats), "saved": saved}
    return out


@pytest.fixture(scope="module")
def attention():
    return run(attention_rank_program, 4, SHAPE, timeout=120)


@pytest.fixture(scope="module")
def serial_attention():
    from minidist.core import functional as F
    from minidist.core.tensor import Tensor, default_dtype, graph_bytes

    q, k, v, w = np.random.default_rng(0).normal(size=(4, *SHAPE))
    out = {}
    with default_dtype("float64"):
        for causal in (True, False):
            tensors = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
            y = F.scaled_dot_product_attention(*tensors, causal=causal)
            saved = graph_bytes(y)
            (y * Tensor(w)).sum().backward()
            out[causal] = {"y": y.data, "grads": [t.grad for t in tensors], "saved": saved}
    return out


CASES = [(cp, algorithm, kind, causal) for cp in (4, 2) for algorithm in ALGORITHMS for kind in SPLITS
         for causal in (True, False)]


@pytest.mark.full  # the quick tier trains every layout instead (below)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"cp{c[0]}-{c[1]}-{c[2]}-{'causal' if c[3] else 'full'}")
def test_attention_and_its_gradients_equal_serial(attention, serial_attention, case):
    reference = serial_attention[case[3]]
    for rank in attention:
        mine = rank[case]
        positions = mine["positions"]
        assert relative_difference(mine["y"], reference["y"][:, :, positions]) < 1e-12
        for grad, full in zip(mine["grads"], reference["grads"]):  # dq, dk, dv of my tokens
            assert relative_difference(grad, full[:, :, positions]) < 1e-12


@pytest.mark.full  # the quick tier trains every layout instead (below)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"cp{c[0]}-{c[1]}-{c[2]}-{'causal' if c[3] else 'full'}")
def test_attention_traffic_matches_the_formula(attention, case):
    cp, algorithm = case[0], case[1]
    formula = (ring_attention_traffic if algorithm == "ring" else ulysses_traffic)(*SHAPE[:2], SHAPE[2], SHAPE[3], cp)
    for rank in attention:
        counts = rank[case]["traffic"]
        cp_kinds = {kind: c for kind, c in counts.items() if kind.endswith("@cp")}
        assert set(cp_kinds) == ({"ring_attention.kv@cp", "ring_attention.dkv@cp"} if algorithm == "ring"
                                 else {"all_to_all.pairwise@cp"})
        assert rank[case]["forward_bytes"] == formula["forward"]
        assert counts["total"]["bytes_sent"] == formula["bytes"]
        assert counts["total"]["messages"] == formula["messages"]
        assert counts["total"]["bytes_received"] == formula["bytes"]  # a ring: as much in as out


@pytest.mark.full  # the quick tier trains every layout instead (below)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"cp{c[0]}-{c[1]}-{c[2]}-{'causal' if c[3] else 'full'}")
def test_attention_scores_and_memory_per_rank(attention, serial_attention, case):
    """Scores: the ring computes B·H·T²/N entries without a mask, whole blocks with one; Ulysses
    B·(H/N)·T² always. Saved for backward: the ring keeps no scores at all (its output and lse),
    Ulysses its heads' weights, 1/N of the serial kernel's B·H·T²."""
    cp, algorithm, kind, causal = case
    b, h, t, d = SHAPE
    split = SequenceSplit(t, cp, kind)
    serial_scores = b * h * t * t
    assert serial_attention[causal]["saved"] == 8 * (serial_scores + b * h * t * d)  # weights and output
    for r, rank in enumerate(attention):
        group_rank = r % cp
        stats, saved = rank[case]["stats"], rank[case]["saved"]
        if algorithm == "ring":
            assert stats["unmasked"] == b * h * split.unmasked_scores(group_rank, causal)
            assert stats["scores"] == b * h * split.computed_scores(group_rank, causal)
            if not causal:
                assert stats["scores"] == serial_scores // cp
            assert stats["peak_bytes"] == 8 * b * h * split.chunk ** 2  # one block of chunks at a time
            assert saved == 8 * b * h * (t // cp) * (d + 1)  # output and lse: O(T/N), no scores
        else:
            assert stats["scores"] == serial_scores // cp  # every token, H/N heads: balanced by construction
            assert stats["unmasked"] == b * (h // cp) * (t * (t + 1) // 2 if causal else t * t)
            # the weights (B, H/N, T, T), the gathered q, k, v and the output, before and after the all-to-all
            assert saved == 8 * (serial_scores // cp + 5 * b * (h // cp) * t * d)
    if causal and algorithm == "ring":
        unmasked = [rank[case]["stats"]["unmasked"] for rank in attention[:cp]]
        assert sum(unmasked) == b * h * t * (t + 1) // 2
        assert (max(unmasked) == min(unmasked)) == (kind == "zigzag")


def test_ring_attention_refuses_a_wrong_shape():
    from minidist.comm import get_world
    from minidist.parallel.context_parallel import ring_attention
    from minidist.core.tensor import Tensor

    q = Tensor(np.zeros((1, 2, 8, 4)))
    with pytest.raises(ValueError, match=r"expected one shape \(B, H, 16, D\)"):
        ring_attention(q, q, q, get_world(), SequenceSplit(16, 1))


# ----------------------------------------------------------------------------- training on 4 ranks


def training_rank_program(layouts, config):
    from minidist.comm import get_world, traffic
    from minidist.core.data import make_task
    from minidist.parallel import checkpointing
    from minidist.parallel.context_parallel import ContextParallelTrainer, context_parallel_traffic_per_step
    from minidist.core.tensor import default_dtype
    from minidist.training.train import OptimSettings

    world = get_world()
    halves = world.split(color=world.rank // 2)
    out = {}
    with default_dtype("float64"):
        task = make_task("sort", config["block_size"], seed=0)
        for layout in layouts:
            group = world if layout["cp"] * layout["dp"] == world.size else halves
            trainer = ContextParallelTrainer(GPTConfig(**config), OptimSettings(**SETTINGS), task, BATCH, seed=0,
                                             group=group, **layout)
            traffic.reset()  # the steps' messages only (not the set-up's broadcast)
            results = [trainer.step(s) for s in range(STEPS)]
            counts = traffic.snapshot()
            out[label(layout)] = {
                "results": results, "state": trainer.state_dict(), "report": trainer.report(),
                "memory": trainer.memory(),
                "cp_bytes": sum(c["bytes_sent"] for kind, c in counts.items() if kind.endswith("@cp")),
                "formula": STEPS * context_parallel_traffic_per_step(GPTConfig(**config), BATCH // layout["dp"],
                                                                     layout["cp"], layout["algorithm"])}
            if label(layout) == "dp2-cp2":  # a checkpoint resumes the same run
                resumed = ContextParallelTrainer(GPTConfig(**config), OptimSettings(**SETTINGS), task, BATCH, seed=0,
                                                 group=group, **layout)
                resumed.load_global_state(checkpointing.snapshot(trainer, group))
                out["resumed"] = (trainer.step(STEPS), resumed.step(STEPS))
    return out


@pytest.fixture(scope="module")
def training():
    return run(training_rank_program, 4, LAYOUTS, CONFIG, timeout=240)


@pytest.fixture(scope="module")
def serial():
    return serial_run(CONFIG, SETTINGS, BATCH, STEPS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=label)
def test_training_reproduces_serial(training, serial, layout):
    results = [rank[label(layout)] for rank in training]
    steps = np.array(results[0]["results"])
    np.testing.assert_allclose(steps[:, 0], serial["losses"], rtol=1e-9)
    np.testing.assert_allclose(steps[:, 1], [acc for _, acc in serial["steps"]], rtol=1e-9)
    for rank in results[1:]:
        np.testing.assert_allclose(rank["results"], results[0]["results"], rtol=1e-12)
    holders = [r for r, rank in enumerate(results) if rank["state"] is not None]
    assert holders == ([0] if layout["cp"] * layout["dp"] == 4 else [0, 2])  # rank 0 of each trainer's group
    for r in holders:
        state = results[r]["state"]
        assert set(state) == set(serial["state"])
        for name, value in serial["state"].items():
            assert relative_difference(state[name], value) < 1e-9, name


@pytest.mark.parametrize("layout", LAYOUTS, ids=label)
def test_training_traffic_and_balance(training, layout):
    """Every rank sends in its cp group exactly what the formula says; the ring's measured visible
    scores per rank follow the split (equal with zigzag, growing with the rank when contiguous)."""
    cp, rows = layout["cp"], BATCH // layout["dp"]
    split = SequenceSplit(CONFIG["block_size"], cp, layout["split"])
    for r, rank in enumerate(training):
        result = rank[label(layout)]
        assert result["cp_bytes"] == result["formula"] > 0
        report = result["report"]["context_parallel"]
        assert report["positions"] == split.positions(r % cp).tolist()
        if layout["algorithm"] == "ring":
            per_call = rows * CONFIG["n_head"] * split.unmasked_scores(r % cp)
            assert report["attention"]["unmasked"] == STEPS * CONFIG["n_layer"] * per_call
        assert result["memory"]["activations"] > 0


def test_a_checkpoint_resumes_the_same_run(training):
    for rank in training:
        original, resumed = rank["resumed"]
        assert original == resumed
