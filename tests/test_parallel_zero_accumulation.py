"""ZeRO stages 1-3 with gradient accumulation reproduce the serial run (chapter 8), under real
mpiexec with 2 and 4 ranks.

With `accumulation=k` each rank's B/N rows run as k micro-batches; the step must still be the
serial step on the whole batch, in float64 to 1e-9. Stage 1 adds the micro-batches' gradients up
in full and reduce-scatters once, so its traffic is that of k = 1; stages 2 and 3 reduce-scatter
every micro-batch's gradients into the chunk (and stage 3 gathers the weights for every one).
One launch per world size runs every case; the serial reference runs here, in the test process.
"""
import numpy as np
import pytest
from conftest import check_against_serial, relative_difference, serial_run

from minidist.comm.launch import run
from minidist.core.data import make_task
from minidist.core.model import GPTConfig
from minidist.precision import FORMATS
from minidist.core.tensor import default_dtype
from minidist.training.train import OptimSettings

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
STEPS, BATCH = 3, 16  # 16 rows: dp=2 x k=4 and dp=4 x k=2 micro-batches of 2 rows
SETTINGS = dict(lr=1e-2, steps=STEPS, warmup=1, min_lr=1e-3, clip=1.0)
STAGES = (1, 2, 3)
LOW = [("bf16", stage, k) for stage in STAGES for k in (1, 2)] + [("fp16", 2, 1), ("fp16", 2, 2)]


def accumulation_program(ks, tensor_parallel=(), low_precision=()):
    """Every stage with each k in `ks` over the whole world (float64), then ZeRO over dp2 x tp2
    for each (stage, k) of `tensor_parallel`, then the 16-bit runs of `low_precision`."""
    from minidist.comm import get_world, traffic
    from minidist.parallel.zero import ZeroTrainer
    from minidist.parallel.composed import MeshTrainerFor
    from minidist.parallel.zero_tensor import STAGES as TP_STAGES

    world = get_world()
    out = {}

    def common(batch=BATCH):
        return GPTConfig(**CONFIG), OptimSettings(**SETTINGS), make_task("sort", CONFIG["block_size"], seed=0), batch

    with default_dtype("float64"):
        for stage in STAGES:
            for k in ks:
                t = ZeroTrainer(*common(), group=world, stage=stage, accumulation=k)
                traffic.reset()  # the steps only, not the set-up's checks
                results = [t.step(s) for s in range(STEPS)]
                kinds = traffic.snapshot()
                state = t.state_dict()  # collective for stage 3
                out[stage, k] = {
                    "results": results, "state": state if world.rank == 0 else None, "memory": t.memory(),
                    "bytes_sent": {n: v["bytes_sent"] / STEPS for n, v in kinds.items() if n not in ("total", "check")},
                    "padded": [u.padded for u in t.units]}
            # no accumulation, on one micro-batch's rows: the activations of the largest k's step
            small = ZeroTrainer(*common(BATCH // max(ks)), group=world, stage=stage)
            small.step(0)
            out[stage, "one micro-batch"] = small.memory()
        for stage, k in tensor_parallel:
            if stage == 1:  # ZeRO-1 over a mesh: the mesh's own, accumulating as a one-stage pipeline
                t = MeshTrainerFor(1)(*common(), group=world, dp=2, tp=2, microbatches=k)
            else:
                t = TP_STAGES[stage](*common(), group=world, dp=2, tp=2, accumulation=k)
            results = [t.step(s) for s in range(STEPS)]
            out["dp2-tp2", stage, k] = {"results": results, "state": t.state_dict()}  # rank 0 only
    for precision, stage, k in low_precision:
        t = ZeroTrainer(*common(), group=world, stage=stage, precision=precision, accumulation=k)
        losses = [t.step(s)[0] for s in range(STEPS)]
        state = t.state_dict()
        out[precision, stage, k] = {"losses": losses, "history": list(t.scaler.history),
                                    "state": {n: v.astype(np.float32) for n, v in state.items()}}
    return out


@pytest.fixture(scope="module")
def serial():
    return serial_run(CONFIG, SETTINGS, BATCH, STEPS)


@pytest.fixture(scope="module")
def two():
    return run(accumulation_program, 2, (1, 2, 4), (), LOW, timeout=240)


@pytest.fixture(scope="module")
def four():
    return run(accumulation_program, 4, (2,), ((1, 2), (3, 2)), timeout=240)


def max_difference(result, reference) -> float:
    """The largest relative difference from the serial run: of any step's loss, of any weight."""
    losses = np.array([loss for loss, _ in result["results"]])
    worst = float(np.max(np.abs(losses - reference["losses"]) / np.abs(reference["losses"])))
    return max([worst] + [relative_difference(result["state"][n], v) for n, v in reference["state"].items()])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("n, k", [(2, 2), (2, 4), (4, 2)])
def test_accumulation_equals_serial(serial, two, four, n, k, stage):
    """Losses and accuracies of every step, on every rank, and the final weights: the serial
    run's, to 1e-9 relative in float64."""
    results = [rank[stage, k] for rank in (two if n == 2 else four)]
    check_against_serial(results, serial)
    print(f"dp={n} k={k} zero{stage}: max relative difference from serial {max_difference(results[0], serial):.1e}")


@pytest.mark.parametrize("stage", (1, 3))
def test_accumulation_over_a_dp_tp_mesh_equals_serial(serial, four, stage):
    """ZeRO over dp2 x tp2 shards with accumulation: stage 3 from zero_tensor.py, stage 1 the
    mesh's MeshZero1Trainer (the same partition, zero_partition.make_units, over a stage shard)."""
    results = [rank["dp2-tp2", stage, 2] for rank in four]
    check_against_serial(results, serial)
    print(f"dp2-tp2 k=2 zero{stage}: max relative difference from serial {max_difference(results[0], serial):.1e}")


@pytest.mark.parametrize("n", (2, 4))
def test_dp_traffic_per_step(two, four, n):
    """Per rank per step, of padded units of S bytes (S_blocks without the root), with
    (N-1)/N x S per ring reduce-scatter or all-gather of everything:
    stage 1: (N-1)/N x 2S, as without accumulation (one reduce-scatter after the last micro-batch);
    stage 2: (N-1)/N x (k + 1) S (a reduce-scatter per micro-batch, one all-gather);
    stage 3: (N-1)/N x k (2S + S_blocks) (each micro-batch gathers for forward and backward)."""
    ranks, ks = (two, (1, 2, 4)) if n == 2 else (four, (2,))
    for rank in ranks:
        padded = rank[1, ks[0]]["padded"]
        full, blocks = sum(padded) * 8, sum(padded[1:]) * 8
        for stage in STAGES:
            for k in ks:
                sent = rank[stage, k]["bytes_sent"]
                moved = sent.get("reduce_scatter.ring", 0) + sent.get("all_gather.ring", 0)
                expected = (n - 1) / n * {1: 2 * full, 2: (k + 1) * full, 3: k * (2 * full + blocks)}[stage]
                assert moved == pytest.approx(expected, rel=1e-12), (n, stage, k, sent)
                if stage == 1:  # unchanged from k = 1
                    assert moved == pytest.approx((n - 1) / n * 2 * full, rel=1e-12)
                others = sum(v for name, v in sent.items() if not name.startswith(("reduce_scatter", "all_gather")))
                assert others <= 2 * 16 * n  # the norm's and the (loss, accuracy)'s all-reduces: once per step


def test_memory_is_one_micro_batchs_activations(two):
    """Accumulation keeps the piles of k = 1 and the activations of one micro-batch: exactly those
    of a step without accumulation on B/k rows."""
    for rank in two:
        for stage in STAGES:
            plain, micro = rank[stage, 1]["memory"], rank[stage, "one micro-batch"]
            for k in (2, 4):
                m = rank[stage, k]["memory"]
                for pile in ("params", "grads", "optimizer"):
                    assert m[pile] == plain[pile], (stage, k, pile)
                assert m["activations"] < plain["activations"]
                if stage == 3:
                    assert m["gathered"] == plain["gathered"]  # still a root and one block at a time
            assert rank[stage, 4]["memory"]["activations"] == micro["activations"], stage


@pytest.mark.parametrize("precision, stage", [(p, s) for p, s, k in LOW if k == 2])
def test_sixteen_bit_accumulation_follows_the_run_without(two, precision, stage):
    """In bf16 or fp16 (loss scaler) the micro-batches' sums round differently, so k = 2 follows
    k = 1 within test_parallel_precision's bounds: 8 eps on the loss, and per weight twice the sum
    of the learning rates plus one rounding. The scaler decides once per step, not per micro-batch."""
    eps = FORMATS[precision].eps
    drift = 2 * sum(OptimSettings(**SETTINGS).lr_at(s) for s in range(STEPS))
    for rank in two:
        got, want = rank[precision, stage, 2], rank[precision, stage, 1]
        for g, w in zip(got["losses"], want["losses"]):
            assert np.isfinite(g) and abs(g - w) <= 8 * eps * w, (g, w)
        for name, value in want["state"].items():
            bound = drift + eps * float(np.max(np.abs(value)))
            assert float(np.max(np.abs(got["state"][name] - value))) <= bound, name
        assert [s for s, _, _ in got["history"]] == list(range(STEPS))  # one decision per step


def test_accumulation_that_does_not_split_is_refused():
    """Before any message, naming the sizes: 16 rows are not 3 micro-batches, nor 0 micro-batches."""
    from minidist.parallel.zero import ZeroTrainer

    with default_dtype("float64"):
        task = make_task("sort", CONFIG["block_size"], seed=0)
        with pytest.raises(ValueError, match=r"global batch 16 is not divisible by dp=1 x accumulation steps=3 = 3"):
            ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, stage=2, accumulation=3)
        with pytest.raises(ValueError, match="accumulation must be an integer >= 1"):
            ZeroTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), task, BATCH, stage=1, accumulation=0)
