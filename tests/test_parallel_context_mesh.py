"""Context parallelism inside the mesh reproduces the serial run (chapters 9, 11), under real mpiexec.

One launch on 4 ranks runs cp2 x tp2 (ring attention, zigzag split; then Ulysses; then with
sequence parallelism), cp2 x pp2 (2 micro-batches, the contiguous split: one cp rank holds no
counted target of the sort task, so its loss share is 0) and cp2 x dp2 with ZeRO-1; one launch
on 8 ranks runs cp2 x dp2 x tp2 and cp2 x tp2 x pp2. Each trains the tiny GPT 3 steps in float64 with clipping on
(the serial norms exceed 1) and is compared with the serial run: losses, accuracies and the
consolidated final weights, relative 1e-9.

Traffic per mesh axis, from the labelled counters, each beside its formula: cp sends one ring
(or Ulysses) attention per block of the rank's stage, on its H/tp heads
(`context_parallel_traffic_per_step`); tp sends chapter 6's all-reduces on T/cp tokens; pp one
(B/m, T/cp, C) activation per micro-batch; the dp x cp group the rank's own shard once per step.
"""
import pytest

from conftest import check_against_serial, serial_run
from minidist.comm.launch import run
from minidist.core.model import GPTConfig
from minidist.parallel.composed import check_composed, mesh_name

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=16)
SMALL = dict(CONFIG, n_head=2, n_embd=8)  # 8 ranks on 2 cores: the smallest model
SETTINGS = dict(lr=1e-2, steps=3, warmup=1, min_lr=1e-3, clip=1.0)
STEPS, BATCH = 3, 4

FOUR = [dict(cp=2, tp=2), dict(cp=2, tp=2, cp_algorithm="ulysses"), dict(cp=2, tp=2, sequence_parallel=True),
        dict(cp=2, pp=2, microbatches=2, cp_split="contiguous"), dict(cp=2, dp=2, zero=1)]
EIGHT = [dict(cp=2, dp=2, tp=2), dict(cp=2, tp=2, pp=2, microbatches=2)]


def label(layout: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items())


def degrees(layout: dict) -> tuple[int, int, int, int]:
    return tuple(layout.get(axis, 1) for axis in ("dp", "cp", "tp", "pp"))


def mesh_rank_program(layouts, config):
    from minidist.comm import get_world, traffic
    from minidist.core.data import make_task
    from minidist.parallel.composed import MeshTrainerFor
    from minidist.core.tensor import default_dtype
    from minidist.training.train import OptimSettings

    out = {}
    with default_dtype("float64"):
        task = make_task("sort", config["block_size"], seed=0)
        for layout in layouts:
            options = dict(layout)
            trainer = MeshTrainerFor(options.pop("zero", 0))(GPTConfig(**config), OptimSettings(**SETTINGS), task,
                                                             BATCH, seed=0, group=get_world(), **options)
            traffic.reset()  # the steps' messages only (not the set-up's)
            results = [trainer.step(s) for s in range(STEPS)]
            counts = traffic.snapshot()  # before the state dict's gathers
            out[label(layout)] = {
                "results": results, "state": trainer.state_dict(), "traffic": counts,
                "report": trainer.report(), "name": trainer.name, "place": trainer.mesh.place,
                "param_bytes": sum(p.data.nbytes for p in trainer.stage.parameters())}
    return out


@pytest.fixture(scope="module")
def four():
    return run(mesh_rank_program, 4, FOUR, CONFIG, timeout=240)


@pytest.fixture(scope="module")
def eight():
    return run(mesh_rank_program, 8, EIGHT, SMALL, timeout=240)


@pytest.fixture(scope="module")
def serial():
    return {"four": serial_run(CONFIG, SETTINGS, BATCH, STEPS), "eight": serial_run(SMALL, SETTINGS, BATCH, STEPS)}


@pytest.mark.parametrize("layout", FOUR, ids=label)
def test_cp_in_a_mesh_of_four_ranks_reproduces_serial(four, serial, layout):
    check_against_serial([rank[label(layout)] for rank in four], serial["four"])


@pytest.mark.parametrize("layout", EIGHT, ids=label)
def test_cp_in_a_mesh_of_eight_ranks_reproduces_serial(eight, serial, layout):
    check_against_serial([rank[label(layout)] for rank in eight], serial["eight"])


def bytes_sent(counts: dict, group: str) -> int:
    """Bytes this rank sent in its mesh group `group` ("cp", "tp", "pp", "dp-cp", "embedding")."""
    return sum(c["bytes_sent"] for kind, c in counts.items() if kind.endswith("@" + group))


def every_run(four, eight):
    for layouts, ranks, config in ((FOUR, four, CONFIG), (EIGHT, eight, SMALL)):
        for layout in layouts:
            for rank in ranks:
                yield layout, rank[label(layout)], config


def test_cp_traffic_is_one_attention_per_block_of_the_stage(four, eight):
    """Ring: 3(cp-1) K/V-sized blocks (B/dp, H/tp, T/cp, D) per attention; Ulysses: four
    all-to-alls each way. Micro-batches split the rows, not the bytes."""
    from minidist.parallel.context_parallel import context_parallel_traffic_per_step

    # cp2 x tp2 by hand: 2 blocks x 3 K/V blocks of 2 x (B=4, H/tp=2, T/cp=8, D=4) float64
    assert context_parallel_traffic_per_step(GPTConfig(**CONFIG), BATCH, 2, tp=2) == 2 * 3 * 2 * (4 * 2 * 8 * 4) * 8
    for layout, result, config in every_run(four, eight):
        dp, cp, tp, pp = degrees(layout)
        want = context_parallel_traffic_per_step(GPTConfig(**config), BATCH // dp, cp,
                                                 layout.get("cp_algorithm", "ring"), 8, tp=tp,
                                                 layers=config["n_layer"] // pp)
        assert bytes_sent(result["traffic"], "cp") == STEPS * want > 0, layout
        assert result["report"]["context_parallel"]["cp_bytes_per_step"] == want


def test_tp_traffic_is_chapter_6_formula_on_the_ranks_tokens(four, eight):
    """Without a pipeline, each tp group runs chapter 6's step on B/dp rows of T/cp tokens."""
    from minidist.comm.cost import tensor_parallel_traffic_per_step

    for layout, result, config in every_run(four, eight):
        dp, cp, tp, pp = degrees(layout)
        if tp > 1 and pp == 1:
            want = tensor_parallel_traffic_per_step(GPTConfig(**config), BATCH // dp, tp, 8,
                                                    seq=config["block_size"] // cp, one_machine=True,
                                                    sequence_parallel=layout.get("sequence_parallel", False))
            assert bytes_sent(result["traffic"], "tp") == STEPS * want["bytes_sent"], layout


def test_pp_sends_the_ranks_tokens_once_per_microbatch(four, eight):
    """m messages of (B/dp/m, T/cp, C) per step: activations forward (stage 0) or their gradients
    backward (stage 1); the tied embedding's (V/tp, C) gradient once over the embedding group."""
    for layout, result, config in every_run(four, eight):
        dp, cp, tp, pp = degrees(layout)
        if pp > 1:
            T, C, V = config["block_size"], config["n_embd"], config["vocab_size"]
            counts = result["traffic"]
            assert counts["pipeline@pp"]["bytes_sent"] == STEPS * (BATCH // dp) * (T // cp) * C * 8
            assert counts["pipeline@pp"]["messages"] == STEPS * layout["microbatches"]
            assert bytes_sent(counts, "embedding") == STEPS * V // tp * C * 8


def test_gradients_are_averaged_once_over_dp_x_cp(four):
    """Two ranks hold each weight (dp x cp = 2): the all-reduce sends the rank's own shard, once
    per step, plus the loss's 2 numbers; nothing goes over a dp-only group."""
    for layout in FOUR[:4]:
        for rank in four:
            result = rank[label(layout)]
            assert bytes_sent(result["traffic"], "dp-cp") == STEPS * (result["param_bytes"] + 16), layout
            assert bytes_sent(result["traffic"], "dp") == 0


def test_report_and_name(four):
    for rank in four:
        result = rank[label(FOUR[1])]
        assert result["name"] == "tp2-cp2-ulysses"
        assert result["report"]["mesh"]["shape"] == {"pp": 1, "dp": 1, "tp": 2, "cp": 2}
        assert result["report"]["context_parallel"]["positions"] == (
            [0, 1, 2, 3, 12, 13, 14, 15] if result["place"].cp == 0 else list(range(4, 12)))
    assert mesh_name(2, 2, 2, zero=1, cp=2, cp_split="contiguous") == "dp2-tp2-pp2-cp2-zero1-contiguous"
    assert mesh_name(2, 2, 1) == "dp2-tp2"


@pytest.mark.parametrize("changes, message", [
    (dict(dropout=0.1), "dropout=0.1 is not supported"),
    (dict(cp_algorithm="ulysses", heads=2), "n_head/tp = 2/2 = 1 heads are not divisible by cp=2"),
    (dict(sequence_parallel=True, block=12, tp=4, world_size=8), "T/cp = 12/2 = 6 tokens are not divisible by tp=4"),
    (dict(cp=3, tp=1, world_size=3), "T=16 is not divisible by 2 x cp = 6"),
    (dict(world_size=8), "pp=1 x dp=1 x cp=2 x tp=2 = 4 ranks, but the world has 8"),
    (dict(zero=2), "stages 2 and 3 shard the gradients"),
])
def test_bad_layouts_fail_in_one_line_before_any_message(changes, message):
    changes = dict(changes)
    config = GPTConfig(**dict(CONFIG, n_head=changes.pop("heads", 4), block_size=changes.pop("block", 16),
                              dropout=changes.pop("dropout", 0.0)))
    kwargs = {**dict(world_size=4, dp=1, tp=2, pp=1, cp=2, batch_size=BATCH), **changes}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as error:
        check_composed(config, **kwargs)
    assert "\n" not in str(error.value)
