"""Low-precision formats and the autocast policy (chapter 10), in one process.

The formats' facts are checked against NumPy's and ml_dtypes' own tables; rounding against
hand-worked cases; the policy by the dtypes each operation produces and by the numbers of a
matrix product (fp16 multiply, fp32 accumulate, output rounded); training by the memory ledger
(2 + 2 + 12 bytes per parameter) and by what master weights keep that an fp16 weight loses.
"""
import ml_dtypes
import numpy as np
import pytest

from minidist.core import functional as F
from minidist.core.data import make_task
from minidist.precision.mixed_precision import MixedPrecisionAdamW, to_low_precision
from minidist.core.model import GPT, GPTConfig
from minidist.core.nn import Parameter
from minidist.precision import FORMATS, autocast, round_to
from minidist.core.tensor import Tensor
from minidist.training.train import OptimSettings, SerialTrainer

CONFIG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
BF16, FP16, FP32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)


@pytest.mark.parametrize("name, eps, largest, normal", [
    ("fp32", 2.0**-23, float(np.finfo(np.float32).max), 2.0**-126),
    ("bf16", 2.0**-7, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), 2.0**-126),
    ("fp16", 2.0**-10, 65504.0, 2.0**-14),
    ("fp8_e4m3", 2.0**-3, 448.0, 2.0**-6),
    ("fp8_e5m2", 2.0**-2, 57344.0, 2.0**-14),
])
def test_the_formats_table(name, eps, largest, normal):
    fmt = FORMATS[name]
    assert fmt.eps == eps and fmt.max == largest and fmt.smallest_normal == normal
    assert fmt.eps == float(ml_dtypes.finfo(fmt.dtype).eps) and fmt.bits == 8 * fmt.itemsize


def test_rounding_follows_the_formats():
    # bf16 keeps 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7, and goes to the even one, 1
    assert float(round_to(np.float32(1 + 2**-8), "bf16")) == 1.0
    assert float(round_to(np.float32(1 + 3 * 2**-8), "bf16")) == 1 + 2**-6
    # fp16: 65504 is the largest; 65520 rounds up to inf; 2^-24 is the smallest subnormal, 2^-26 flushes to 0
    assert float(round_to(np.float32(65504), "fp16")) == 65504.0
    assert np.isinf(round_to(np.float32(65520), "fp16"))
    assert float(round_to(np.float32(2.0**-24), "fp16")) == 2.0**-24
    assert float(round_to(np.float32(2.0**-26), "fp16")) == 0.0
    # bf16 has fp32's range: 1e-30 survives (with 8 bits), 1e38 too
    assert float(round_to(np.float32(1e-30), "bf16")) == pytest.approx(1e-30, rel=2**-8)
    # e4m3 has no inf: past 448 it saturates (ml_dtypes alone would give NaN)
    assert float(round_to(np.float32(500), "fp8_e4m3")) == 448.0
    assert np.isnan(np.float32(500).astype(ml_dtypes.float8_e4m3fn))


def test_policy_gives_each_operation_its_format():
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((4, 8)).astype(FP16), requires_grad=True)
    w = Tensor(rng.standard_normal((6, 8)).astype(FP16), requires_grad=True)
    gamma, beta = Tensor(np.ones(6, dtype=FP16)), Tensor(np.zeros(6, dtype=FP16))
    with autocast("fp16"):
        y = F.linear(x, w)                      # low
        z = F.layer_norm(y, gamma, beta)        # fp32
        s = y + y                               # promote: low + low -> low
        t = s + z                               # promote: low + fp32 -> fp32
        loss = F.sum(t * t)                     # fp32
    assert (y.dtype, z.dtype, s.dtype, t.dtype, loss.dtype) == (FP16, FP32, FP16, FP32, FP32)
    loss.backward()
    assert x.grad.dtype == FP16 and w.grad.dtype == FP16  # each gradient in its tensor's format
    # outside autocast nothing changes, and float64 is never lowered
    with autocast("bf16"):
        assert F.linear(Tensor(rng.standard_normal((4, 8))), Tensor(np.ones((6, 8)))).dtype == np.float64


def test_matrix_product_is_low_multiply_fp32_accumulate():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((16, 64)).astype(np.float32), rng.standard_normal((64, 8)).astype(np.float32)
    for name in ("fp16", "bf16"):
        low = FORMATS[name].dtype
        with autocast(name):
            out = F.matmul(Tensor(a), Tensor(b))
        expected = (a.astype(low).astype(np.float32) @ b.astype(low).astype(np.float32)).astype(low)
        assert out.dtype == low
        np.testing.assert_array_equal(out.data.astype(np.float32), expected.astype(np.float32))


def test_mixed_precision_ledger_is_2_2_12_bytes_per_parameter():
    task = make_task("sort", CONFIG.block_size, seed=0)
    for precision in ("bf16", "fp16"):
        trainer = SerialTrainer(CONFIG, OptimSettings(lr=3e-3, steps=4, warmup=1), task, 8, precision=precision)
        for step in range(2):
            trainer.step(step)
        psi = trainer.num_parameters()
        ledger = trainer.memory()
        assert (ledger["params"], ledger["grads"], ledger["optimizer"]) == (2 * psi, 2 * psi, 12 * psi), precision
        assert (ledger["master_weights"], ledger["moments"]) == (4 * psi, 8 * psi)  # the 12, apart


def test_master_weights_keep_updates_an_fp16_weight_loses():
    """An fp16 weight of 1.0 cannot move by less than half its epsilon, 2^-11: a step of 2^-13
    is lost. Its fp32 master keeps it, and after 8 such steps the weight moves by one fp16 ulp."""
    p = Parameter(np.ones(4, dtype=np.float32))
    masters = {id(p): p.data.copy()}
    p.data = round_to(p.data, "fp16")
    optimizer = MixedPrecisionAdamW([p], masters, lr=2.0**-13, betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)
    naive = np.ones(4, dtype=np.float16)
    for _ in range(8):  # Adam with beta = 0 and eps = 0 moves by exactly lr * sign(g)
        optimizer.step([np.full(4, -1.0, dtype=np.float32)])
        naive += np.float16(2.0**-13)  # the same step on the fp16 weight itself
    assert float(naive[0]) == 1.0  # every step lost
    assert float(masters[id(p)][0]) == 1.0 + 8 * 2.0**-13
    assert float(p.data[0]) == 1.0 + 2.0**-10  # the master, rounded: one ulp of fp16 above 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_training_follows_fp32_within_its_epsilon(precision):
    """Every operation rounds to the format once, so a step's loss carries a relative error of a
    few epsilon; 20 steps of training compound it only mildly. The bound: 8 eps of the loss."""
    task = make_task("sort", CONFIG.block_size, seed=0)
    settings = OptimSettings(lr=3e-3, steps=20, warmup=2, min_lr=3e-4)
    ref = SerialTrainer(CONFIG, settings, task, 16)
    low = SerialTrainer(CONFIG, settings, task, 16, precision=precision)
    eps = FORMATS[precision].eps
    for step in range(20):
        (want, _), (got, _) = ref.step(step), low.step(step)
        assert abs(got - want) <= 8 * eps * want, (step, got, want)
    assert low.report()["precision"] == precision and len(low.report()["loss_scale"]) == 20


def test_to_low_precision_keeps_the_fp32_masters():
    model = GPT(CONFIG, seed=0)
    before = {id(p): p.data.copy() for p in model.parameters()}
    masters = to_low_precision(model, "bf16")
    for p in model.parameters():
        assert p.dtype == BF16
        np.testing.assert_array_equal(masters[id(p)], before[id(p)])
    with pytest.raises(ValueError, match="computes in bf16 or fp16"):
        to_low_precision(model, "fp8_e4m3")


def test_a_resumed_fp16_run_continues_bit_for_bit():
    """The training state of 16-bit training holds the fp32 masters and the loss scale too."""
    task = make_task("sort", CONFIG.block_size, seed=0)
    settings = OptimSettings(lr=3e-3, steps=6, warmup=1)
    from minidist.precision.loss_scale import DynamicLossScaler
    from minidist.parallel import checkpointing

    def trainer():  # a small growth interval, so the scale changes within the run
        return SerialTrainer(CONFIG, settings, task, 8, precision="fp16", scaler=DynamicLossScaler(growth_interval=2))

    straight = trainer()
    losses = [straight.step(s)[0] for s in range(6)]
    first = trainer()
    for s in range(3):
        first.step(s)
    saved = checkpointing.snapshot(first)  # as a checkpoint holds it: whole arrays by global name
    assert any(k.startswith("master.") for k in saved.arrays) and "scaler.scale" in saved.arrays
    resumed = trainer()
    resumed.load_global_state(saved)
    assert [resumed.step(s)[0] for s in range(3, 6)] == losses[3:]
    assert resumed.scaler.scale == straight.scaler.scale and resumed.scaler.history == straight.scaler.history[3:]
    assert len({scale for _, scale, _ in straight.scaler.history}) > 1  # the scale moved during the run
    for name, value in straight.model.state_dict().items():
        np.testing.assert_array_equal(resumed.model.state_dict()[name], value)
