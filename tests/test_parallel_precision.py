"""Mixed precision in parallel layouts (chapter 10), under real mpiexec.

In low precision a parallel layout cannot reproduce the serial run bit for bit: its sums run in
another order, and every operation rounds to a format with epsilon 2^-7 (bf16) or 2^-10 (fp16).
The bounds used here, derived rather than fitted:

- loss, per step: each operation rounds its result once, a relative error of eps/2, and the
  loss is a chain of a few dozen such roundings that mostly cancel; 8 eps of the loss bounds
  what two orders of summation can make of them (measured: under 1 eps);
- weights, after k steps: AdamW moves an element by at most about lr per step (|m^|/sqrt(v^) is
  near 1 at most), so two runs whose gradients differ by round-off drift apart by at most
  2 x (sum of the learning rates) per element, plus one rounding of the final weight to the
  format, eps x max|w|.

And the one thing that must be exact: an inf in one rank's gradient makes every rank skip the
step and halve its scale, and changes no weight anywhere.
"""
import numpy as np
import pytest

from minidist.comm.launch import run
from minidist.precision import FORMATS

CONFIG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
SETTINGS = dict(lr=3e-3, steps=10, warmup=2, min_lr=3e-4)
STEPS, BATCH = 10, 16
LAYOUTS = [dict(dp=2, tp=2), dict(tp=2, pp=2, microbatches=2), dict(dp=2, pp=2, microbatches=2),
           dict(dp=4, zero=1), dict(dp=4, zero=2), dict(dp=4, zero=3), dict(dp=2, tp=2, zero=3),
           dict(dp=2, pp=2, microbatches=2, zero=1)]


def name(layout):
    return "-".join(f"{k}{v}" for k, v in layout.items())


def build(layout: dict, precision: str):
    """The trainer of a layout: ZeRO over all ranks, ZeRO-2/3 over dp x tp, or the mesh."""
    from minidist.comm import get_world
    from minidist.core.data import make_task
    from minidist.core.model import GPTConfig
    from minidist.parallel.composed import MeshTrainerFor
    from minidist.parallel.zero import ZeroTrainer
    from minidist.parallel.zero_tensor import STAGES
    from minidist.training.train import OptimSettings

    options, zero = dict(layout), layout.get("zero", 0)
    options.pop("zero", None)
    common = (GPTConfig(**CONFIG), OptimSettings(**SETTINGS), make_task("sort", 16, seed=0), BATCH)
    if zero and options == {"dp": 4}:
        return ZeroTrainer(*common, group=get_world(), stage=zero, precision=precision)
    if zero >= 2:
        return STAGES[zero](*common, group=get_world(), precision=precision, **options)
    return MeshTrainerFor(zero)(*common, group=get_world(), precision=precision, **options)


def serial(precision):
    from minidist.core.data import make_task
    from minidist.core.model import GPTConfig
    from minidist.training.train import OptimSettings, SerialTrainer

    trainer = SerialTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), make_task("sort", 16, seed=0), BATCH,
                            precision=precision)
    losses = [trainer.step(s)[0] for s in range(STEPS)]
    return losses, {k: v.astype(np.float32) for k, v in trainer.model.state_dict().items()}


def mesh_program(layouts, precisions):
    from minidist.comm import traffic

    out = {}
    for precision in precisions:
        for layout in layouts:
            trainer = build(layout, precision)
            traffic.reset()
            losses = [trainer.step(s)[0] for s in range(STEPS)]
            state = trainer.state_dict()
            units = getattr(trainer, "units", None)
            out[precision, name(layout)] = {
                "losses": losses, "memory": trainer.memory(), "traffic": traffic.by_label(traffic.snapshot()),
                "state": None if state is None else {k: v.astype(np.float32) for k, v in state.items()},
                "params": sum(p.size for p in trainer.stage.parameters()) if units is None else None,
                "padded": None if units is None else [u.padded for u in units],
                "numel": None if units is None else sum(u.numel for u in units),
                "ranks": None if units is None else trainer.optimizer.units[0].padded // trainer.optimizer.units[0].chunk}
    return out


def overflow_program():
    """fp16, tp2 x pp2: at step 2, rank 3 alone finds an inf in one gradient of its shard."""
    from minidist.comm import get_world
    from minidist.core.data import make_task
    from minidist.core.model import GPTConfig
    from minidist.parallel.composed import MeshTrainer
    from minidist.training.train import OptimSettings

    world = get_world()
    trainer = MeshTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), make_task("sort", 16, seed=0), BATCH,
                          group=world, precision="fp16", tp=2, pp=2, microbatches=2)
    finish = trainer.finish_gradients

    def poisoned():
        finish()
        if trainer.step_index == 2 and world.rank == 3:
            trainer.stage.parameters()[0].grad.flat[0] = np.inf

    trainer.finish_gradients = poisoned
    weights = []
    for step in range(5):
        trainer.step(step)
        weights.append({k: np.array(p.array, copy=True) for k, p in trainer.global_state().items() if not p.local})
    return {"history": trainer.scaler.history, "weights": weights}


@pytest.fixture(scope="module")
def four():
    return run(mesh_program, 4, LAYOUTS, ["bf16", "fp16"], timeout=300)


@pytest.mark.full
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=name)
def test_composed_layouts_follow_serial_within_the_formats_bounds(four, precision, layout):
    want_losses, want_state = serial(precision)
    got = four[0][precision, name(layout)]
    eps = FORMATS[precision].eps
    for step, (g, w) in enumerate(zip(got["losses"], want_losses)):
        assert abs(g - w) <= 8 * eps * w, (step, g, w)
    from minidist.training.train import OptimSettings

    drift = 2 * sum(OptimSettings(**SETTINGS).lr_at(s) for s in range(STEPS))
    for key, value in want_state.items():
        bound = drift + eps * float(np.max(np.abs(value)))
        assert float(np.max(np.abs(got["state"][key] - value))) <= bound, key


@pytest.mark.full
def test_ledger_is_2_2_12_bytes_per_parameter_of_each_shard(four):
    """2 + 2 + 12 bytes per parameter of a rank's shard; under ZeRO with K = 12 over N ranks (of
    the padded units: each a multiple of N): stage 1 2 + 2 + 12/N, stage 2 2 + (2 + 12)/N,
    stage 3 (2 + 2 + 12)/N."""
    for rank in four:
        for (precision, layout), r in rank.items():
            got = (r["memory"]["params"], r["memory"]["grads"], r["memory"]["optimizer"])
            if r["padded"] is None:
                n = r["params"]
                assert got == (2 * n, 2 * n, 12 * n), layout
                assert (r["memory"]["master_weights"], r["memory"]["moments"]) == (4 * n, 8 * n)
                continue
            psi, n = sum(r["padded"]), r["ranks"]
            stage = int(layout[layout.index("zero") + 4])
            want = {1: (2 * psi, 2 * psi, 12 * psi // n), 2: (2 * psi, 2 * psi // n, 12 * psi // n),
                    3: (2 * psi // n, 2 * psi // n, 12 * psi // n)}[stage]
            if "pp" in layout:  # the mesh's ZeRO-1 accumulates micro-batches in the parameters' own .grad
                want = (want[0], 2 * r["numel"], want[2])
            assert got == want, (layout, got, want)
            assert (r["memory"]["master_weights"], r["memory"]["moments"]) == (4 * psi // n, 8 * psi // n)


@pytest.mark.full
def test_sixteen_bit_gradients_halve_the_dp_traffic(four):
    """dp = 2 sends this rank's gradient bytes once per step, plus the loss's 16 bytes (test_parallel_mesh);
    in 16 bits the gradient bytes are 2 per parameter."""
    for rank in four:
        for precision in ("bf16", "fp16"):
            r = rank[precision, "dp2-tp2"]
            assert r["traffic"]["dp"] == STEPS * (2 * r["params"] + 16)


@pytest.mark.full
def test_an_inf_on_one_rank_skips_the_step_on_every_rank():
    ranks = run(overflow_program, 4, timeout=300)
    for rank in ranks:
        history = rank["history"]
        assert [skipped for _, _, skipped in history] == [False, False, True, False, False]
        assert [scale for _, scale, _ in history] == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15]
        before, after = rank["weights"][1], rank["weights"][2]
        for key in before:  # step 2 changed nothing: no weight, no moment, no master, no step count
            if not key.startswith("scaler."):
                np.testing.assert_array_equal(after[key], before[key], err_msg=key)
        assert any(not np.array_equal(rank["weights"][3][k], after[k]) for k in after if k.startswith("param."))


def sixteen_bit_sums():
    from minidist.comm import all_reduce, get_world

    world = get_world()
    out = {}
    for dtype in ("float16", "bfloat16"):  # minidist imported ml_dtypes: NumPy knows "bfloat16"
        eps = 2.0**-10 if dtype == "float16" else 2.0**-7
        x = np.array([1.0 if world.rank == 0 else eps / 2] * 4, dtype=np.dtype(dtype))
        all_reduce(x, op="sum", group=world, algorithm="shared_memory")
        out[dtype] = x.astype(np.float32)
    return out


def test_sixteen_bit_all_reduce_sums_in_fp32_and_rounds_once():
    """1 + 3 x eps/2 on 4 ranks. Added one at a time in 16 bits, each eps/2 is a tie that rounds
    back to the even neighbour, 1: the sum would stay 1. Summed in fp32 it is 1 + 1.5 eps, a tie
    between 1 + eps and 1 + 2 eps, rounded once to the even one, 1 + 2 eps."""
    for rank in run(sixteen_bit_sums, 4, timeout=120):
        for dtype, eps in (("float16", 2.0**-10), ("bfloat16", 2.0**-7)):
            np.testing.assert_array_equal(rank[dtype], np.float32(1 + 2 * eps))


def fp32_gradient_program():
    from minidist.comm import traffic

    out = {}
    for fp32_grads in (False, True):
        trainer = build(dict(dp=2, pp=2, microbatches=2, fp32_grads=fp32_grads), "bf16")
        traffic.reset()
        losses = [trainer.step(s)[0] for s in range(STEPS)]
        out[fp32_grads] = {"losses": losses, "memory": trainer.memory(), "traffic": traffic.by_label(traffic.snapshot()),
                           "params": sum(p.size for p in trainer.stage.parameters())}
    return out


@pytest.mark.full
def test_fp32_gradients_of_16_bit_weights_cost_4_bytes_and_twice_the_dp_traffic():
    """Megatron-LM's --accumulate-allreduce-grads-in-fp32: micro-batches accumulate, and replicas
    average, in fp32. The gradients take 4 bytes per parameter instead of 2, and so do the bytes
    each rank sends over dp; the weights stay 16-bit."""
    for rank in run(fp32_gradient_program, 4, timeout=120):
        n = rank[False]["params"]
        assert rank[False]["memory"]["grads"] == 2 * n and rank[True]["memory"]["grads"] == 4 * n
        assert rank[True]["memory"]["params"] == 2 * n
        assert rank[False]["traffic"]["dp"] == STEPS * (2 * n + 16)
        assert rank[True]["traffic"]["dp"] == STEPS * (4 * n + 16)
        for a, b in zip(rank[True]["losses"], rank[False]["losses"]):
            assert abs(a - b) <= 8 * FORMATS["bf16"].eps * b


def context_parallel_program(precisions):
    from minidist.comm import get_world
    from minidist.core.data import make_task
    from minidist.core.model import GPTConfig
    from minidist.parallel.context_parallel import ContextParallelTrainer
    from minidist.training.train import OptimSettings

    out = {}
    for precision in precisions:
        trainer = ContextParallelTrainer(GPTConfig(**CONFIG), OptimSettings(**SETTINGS), make_task("sort", 16, seed=0),
                                         BATCH, group=get_world(), cp=2, dp=2, precision=precision)
        losses = [trainer.step(s)[0] for s in range(STEPS)]
        state = trainer.state_dict()
        out[precision] = {"losses": losses, "memory": trainer.memory(), "params": trainer.num_parameters(),
                          "state": None if state is None else {k: v.astype(np.float32) for k, v in state.items()}}
    return out


@pytest.mark.full
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_context_parallel_follows_serial_within_the_formats_bounds(precision):
    """Each sequence split over cp = 2 ranks, dp = 2 replicas, in 16 bits: the same bounds."""
    want_losses, want_state = serial(precision)
    ranks = run(context_parallel_program, 4, [precision], timeout=240)
    got, eps = ranks[0][precision], FORMATS[precision].eps
    for g, w in zip(got["losses"], want_losses):
        assert abs(g - w) <= 8 * eps * w
    from minidist.training.train import OptimSettings

    drift = 2 * sum(OptimSettings(**SETTINGS).lr_at(s) for s in range(STEPS))
    for key, value in want_state.items():
        assert float(np.max(np.abs(got["state"][key] - value))) <= drift + eps * float(np.max(np.abs(value))), key
    for rank in ranks:
        n, ledger = rank[precision]["params"], rank[precision]["memory"]
        assert (ledger["params"], ledger["grads"], ledger["optimizer"]) == (2 * n, 2 * n, 12 * n)


MOE = dict(CONFIG, num_experts=4, top_k=2, capacity_factor=1.25)


def moe_program(precisions):
    from minidist.comm import get_world
    from minidist.core.data import make_task
    from minidist.core.moe import MoEConfig
    from minidist.parallel.expert_parallel import ExpertParallelTrainer
    from minidist.training.train import OptimSettings

    out = {}
    for precision in precisions:
        trainer = ExpertParallelTrainer(MoEConfig(**MOE), OptimSettings(**SETTINGS), make_task("sort", 16, seed=0), BATCH,
                                        group=get_world(), ep=2, precision=precision)
        losses = [trainer.step(s)[0] for s in range(STEPS)]
        out[precision] = {"losses": losses, "memory": trainer.memory(),
                          "params": sum(p.size for p in trainer.local_model.parameters())}
    return out


@pytest.mark.full
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_expert_parallelism_follows_the_serial_mixture_within_the_formats_bounds(precision):
    """Experts over ep = 2 of 2 ranks in 16 bits: the router's softmax runs in fp32 (autocast's
    policy), so the routing of the serial 16-bit run repeats; losses within 8 eps."""
    from minidist.core.data import make_task
    from minidist.core.moe import MoEConfig
    from minidist.training.train import MoETrainer
    from minidist.training.train import OptimSettings

    serial_moe = MoETrainer(MoEConfig(**MOE), OptimSettings(**SETTINGS), make_task("sort", 16, seed=0), BATCH,
                            precision=precision)
    want = [serial_moe.step(s)[0] for s in range(STEPS)]
    ranks = run(moe_program, 2, [precision], timeout=240)
    for g, w in zip(ranks[0][precision]["losses"], want):
        assert abs(g - w) <= 8 * FORMATS[precision].eps * w
    for rank in ranks:
        n, ledger = rank[precision]["params"], rank[precision]["memory"]
        assert (ledger["params"], ledger["grads"], ledger["optimizer"]) == (2 * n, 2 * n, 12 * n)


# ----------------------------------------------------------------------------- one strategy alone


def alone_program(precisions):
    """Chapter 6's TensorParallelTrainer and chapter 5's PipelineTrainer in 16 bits on 2 ranks:
    each holds the same Precision object as every other trainer (not the mesh's code path)."""
    from minidist.comm import get_world
    from minidist.core.data import make_task
    from minidist.core.model import GPTConfig
    from minidist.parallel.pipeline import PipelineTrainer
    from minidist.parallel.tensor_parallel import TensorParallelTrainer
    from minidist.training.train import OptimSettings

    out = {}
    for precision in precisions:
        common = (GPTConfig(**CONFIG), OptimSettings(**SETTINGS), make_task("sort", 16, seed=0), BATCH)
        for label, trainer in (("tp2", TensorParallelTrainer(*common, group=get_world(), precision=precision)),
                               ("pp2", PipelineTrainer(*common, group=get_world(), microbatches=2, precision=precision))):
            losses = [trainer.step(s)[0] for s in range(STEPS)]
            state = trainer.state_dict()
            out[precision, label] = {"losses": losses, "report": trainer.report(), "kind": type(trainer).__name__,
                                     "dtype": str(trainer.optimizer.params()[0].data.dtype),
                                     "state": None if state is None else {k: v.astype(np.float32)
                                                                          for k, v in state.items()}}
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tensor_and_pipeline_parallelism_alone_run_their_own_trainers_in_16_bits(precision):
    from minidist.training.layout import Layout, strategy
    from minidist.training.train import OptimSettings

    assert strategy(Layout(tp=2, precision=precision)) == "tp"  # not the mesh's tp2
    assert strategy(Layout(pp=2, microbatches=2, precision=precision)) == "pp-1f1b"
    got = run(alone_program, 2, [precision], timeout=240)[0]
    want_losses, want_state = serial(precision)
    eps = FORMATS[precision].eps
    drift = 2 * sum(OptimSettings(**SETTINGS).lr_at(s) for s in range(STEPS))
    for label in ("tp2", "pp2"):
        run_ = got[precision, label]
        assert run_["dtype"] == precision.replace("bf16", "bfloat16").replace("fp16", "float16")  # 16-bit weights
        assert run_["report"]["precision"] == precision and len(run_["report"]["loss_scale"]) == STEPS
        for step, (g, w) in enumerate(zip(run_["losses"], want_losses)):
            assert abs(g - w) <= 8 * eps * w, (label, step, g, w)
        for key, value in want_state.items():
            bound = drift + eps * float(np.max(np.abs(value)))
            assert float(np.max(np.abs(run_["state"][key] - value))) <= bound, (label, key)
