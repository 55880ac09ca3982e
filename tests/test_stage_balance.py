"""Pipeline stages cut by measured cost (minidist/parallel/stage_balance.py, chapter 5).

The cut is checked against every possible cut (brute force), and a pipeline built from an
uneven cut still reproduces the serial run under real mpiexec (2 and 3 ranks). The simulated
bubble of a run with equal stages is the formula's."""
import itertools

import numpy as np
import pytest

from conftest import check_against_serial, serial_run
from test_demo import demo
from minidist.comm.launch import run
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.core.tensor import default_dtype
from minidist.parallel import schedules as S
from minidist.parallel.pipeline import check_pipeline_layout
from minidist.parallel.stage_balance import cut_by_cost, piece_costs, stage_costs
from minidist.training.train import OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=16)
SETTINGS = dict(lr=1e-2, steps=3, warmup=1, min_lr=1e-3, clip=1.0)
STEPS, BATCH = 3, 8


def every_cut(blocks: int, stages: int):
    """Each way to cut `blocks` consecutive blocks into `stages` non-empty stages."""
    for cuts in itertools.combinations(range(1, blocks), stages - 1):
        bounds = (0, *cuts, blocks)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(40))
def test_the_cut_is_the_best_of_every_cut(seed):
    rng = np.random.default_rng(seed)
    blocks, stages = int(rng.integers(1, 9)), None
    stages = int(rng.integers(1, blocks + 1))
    costs = list(rng.uniform(0.1, 3.0, blocks + 2))
    best = min(max(stage_costs(costs, cut)) for cut in every_cut(blocks, stages))
    cut = cut_by_cost(costs, stages)
    assert sum(cut) == blocks and len(cut) == stages and min(cut) >= 1
    assert max(stage_costs(costs, cut)) == pytest.approx(best, rel=1e-12)


def test_a_heavy_head_moves_blocks_to_the_first_stages():
    # embedding 0.1, four blocks of 1, head 2.5: by count 2 + 2 costs 4.5 on the last stage
    assert cut_by_cost([0.1, 1, 1, 1, 1, 2.5], 2) == [3, 1]
    assert stage_costs([0.1, 1, 1, 1, 1, 2.5], [3, 1]) == pytest.approx([3.1, 3.5])
    assert cut_by_cost([0.1, 1, 1, 1, 1, 1, 1, 3.0], 3) == [3, 2, 1]


def test_equal_pieces_cut_as_the_count_does():
    # light embedding and head: the even cut, as partition() makes it
    assert cut_by_cost([0.0, 1, 1, 1, 1, 0.0], 2) == [2, 2]
    assert cut_by_cost([0.0] + [1] * 8 + [0.0], 4) == [2, 2, 2, 2]


def test_a_cut_that_cannot_be_made_says_why():
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3 stages"):
        cut_by_cost([0, 1, 1, 0], 3)
    config = GPTConfig(**CONFIG)
    for bad in ([3, 2], [4, 0], [2, 1, 1]):
        with pytest.raises(ValueError, match="stage_blocks"):
            check_pipeline_layout(config, BATCH, 2, 2, "1f1b", 1, bad)
    with pytest.raises(ValueError, match="one chunk per rank"):
        check_pipeline_layout(config, BATCH, 2, 2, "interleaved", 2, [3, 1])


def test_the_head_of_a_large_vocabulary_is_measured_heavier_than_a_block():
    costs = piece_costs(GPTConfig(vocab_size=8192, block_size=32, n_layer=4, n_head=2, n_embd=32), rows=4)
    assert len(costs) == 6 and all(c > 0 for c in costs)
    assert costs[1:5] == [costs[1]] * 4  # one block timed, standing for all
    assert costs[-1] > costs[1]  # 32 x 8192 logits per token against a block of width 32


def test_equal_stage_costs_simulate_to_the_formula():
    for schedule, p, m in (("gpipe", 2, 4), ("1f1b", 2, 8), ("1f1b", 4, 4)):
        events = S.simulate(S.all_ranks(schedule, p, m), forward=lambda r, c: 0.003, backward=lambda r, c: 0.006)
        assert S.bubble_fraction(events) == pytest.approx(S.bubble_theory(p, m))


def cut_rank_program(cut, m):
    from minidist.comm import get_world
    from minidist.parallel.pipeline import PipelineTrainer
    from minidist.parallel.stage_balance import balanced_blocks

    with default_dtype("float64"):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        trainer = PipelineTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, seed=0,
                                  group=get_world(), microbatches=m, schedule="1f1b", stage_blocks=cut,
                                  explain_bubble=True)
        results = [trainer.step(s) for s in range(STEPS)]
        held = sorted(name for name, _ in trainer.stage.named_parameters() if name.startswith("h."))
        agreed = balanced_blocks(GPTConfig(**dict(CONFIG, vocab_size=4096)), get_world().size, 2, get_world())
        state = trainer.state_dict()  # collective; the whole model on rank 0 (the others: their stage)
        return {"results": results, "state": state if get_world().rank == 0 else None, "report": trainer.pipeline_report(),
                "blocks": sorted({int(name.split(".")[1]) for name in held}), "agreed": agreed}


@pytest.mark.parametrize("n, cut", [(2, [3, 1]), (2, [1, 3]), (3, [2, 1, 1])])
def test_an_uneven_cut_still_equals_serial(n, cut):
    serial = serial_run(CONFIG, SETTINGS, BATCH, STEPS)
    out = run(cut_rank_program, n, cut, 4, timeout=180)
    starts = np.cumsum([0, *cut])
    for rank, result in enumerate(out):
        assert result["blocks"] == list(range(starts[rank], starts[rank + 1]))
        assert result["agreed"] == out[0]["agreed"]  # every rank measured, and all cut alike
    check_against_serial(out, serial)
    report = out[0]["report"]
    assert report["stage_blocks"] == cut
    assert len(report["stage_seconds"]) == n
    for key in ("bubble_measured", "bubble_replayed", "bubble_modelled", "bubble_simulated"):
        assert 0 <= report[key] < 1, key


@pytest.mark.parametrize("flags, ranks", [(["--pp", "2"], 2),
                                          pytest.param(["--dp", "2", "--pp", "2"], 4, marks=pytest.mark.full)])
def test_the_demo_cuts_by_time_and_still_equals_serial(tmp_path, flags, ranks):
    import json
    common = ["--steps", "3", "--dtype", "float64", "--n-layer", "3", "--n-embd", "32", "--n-head", "2",
              "--block-size", "16", "--batch-size", "8", "--log-every", "-1"]
    assert demo(*common, "--save", str(tmp_path / "s.npz")).returncode == 0
    proc = demo(*common, *flags, "--microbatches", "2", "--balance-stages", "time", "--json", str(tmp_path / "p.json"),
                "--save", str(tmp_path / "p.npz"), nprocs=ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocks = json.loads((tmp_path / "p.json").read_text())["pipeline"]["stage_blocks"]
    assert sum(blocks) == 3 and min(blocks) >= 1  # 2 + 1 or 1 + 2: which, the measurement says
    got, want = dict(np.load(tmp_path / "p.npz")), dict(np.load(tmp_path / "s.npz"))
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12, err_msg=name)
