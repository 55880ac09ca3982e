"""What activation checkpointing saves and what it costs: measured, beside the formula.

Chapter 11 (with minidist/core/recompute.py, the mechanism). Four measurements, each fast on a small GPT:

- `activation_bytes`: what the autograd graph keeps after forward (graph_bytes of the loss), and
  the largest graph that backward rebuilds at once, for one recompute setting;
- `predicted_activation_bytes`: the same two numbers from the formula below;
- `ledger`: per layer, Korthikanti et al.'s sbh(34 + 5as/h) next to minidist's version of it and
  the measurement, for none, selective and full recomputation;
- `memory_time_curve` and `step_overheads`: memory against step time over segment counts
  (Chen et al. 2016's sqrt(n) trade-off), and the extra time of full and selective recomputation.

The ledger, per transformer layer (s sequence, b batch, h hidden, a heads; d = 1 with dropout).
Korthikanti et al. 2022 count fp16 activations (2 bytes) and 1-byte dropout masks:

    attention   LN input 2sbh, QKV input 2sbh, Q and K 4sbh, V 2sbh, projection input 2sbh,
                dropout mask sbh; softmax 2as²b, its dropout mask as²b, dropout output 2as²b
    MLP         LN input 2sbh, c_fc input 2sbh, GELU input 8sbh, c_proj input 8sbh, mask sbh
    total       sbh(34 + 5as/h) bytes

minidist keeps every array in the model's dtype (e bytes, masks too) and counts what its
Functions really keep (`memory.layer_activation_elements`): the same 16 sbh arrays as
Megatron's 2-byte ones, plus the two LayerNorms' xhat and 1/std (2sbh + 2sb: Megatron's kernel
recomputes them), attention's output before the heads are merged (sbh), the two projections'
outputs (2sbh: Megatron fuses bias, dropout and residual) and GELU's tanh (4sbh); with dropout,
each residual dropout's mask and output (4sbh). In the attention core it keeps the softmax and
the mask but not their product (backward multiplies again):

    none        e·sbh·(25 + 4d + 2/h + (1 + d)·as/h)       Megatron: sbh(34 + 5as/h)
    selective   e·sbh·(25 + 4d + 2/h)                       Megatron: 34 sbh
    full        e·sbh   (the block's output: the next one's input)   Megatron: 2 sbh

Full recomputation with k runs of n/k blocks keeps k block outputs after forward, and backward
rebuilds one run at a time: (n/k)·(none's per-layer bytes), once. Selective backward rebuilds
one attention core at a time: e·(sbh + (1 + d)·abs²).
"""
from __future__ import annotations

import time

import numpy as np

from minidist.plan import memory
from minidist.core.recompute import check_recompute, record_recomputation, segment_bounds
from minidist.core.tensor import default_dtype, graph_bytes
from minidist.training.train import OptimSettings, SerialTrainer

DEMO = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)  # the demo's model, batch 16


class RandomTokens:
    """Batches of random token ids, a function of (seed, step): memory and time do not depend on
    what the tokens say, and any vocabulary size will do."""

    def __init__(self, vocab_size: int, block_size: int, seed: int = 0):
        self.vocab_size, self.block_size, self.seed = vocab_size, block_size, seed

    def get_batch(self, step: int, batch: int):
        rng = np.random.default_rng([self.seed, step])
        ids = rng.integers(0, self.vocab_size, (batch, self.block_size + 1))
        return ids[:, :-1], ids[:, 1:]


def _trainer(config, batch, recompute="none", segments=None, seed=0, dtype=np.float32):
    with default_dtype(dtype):
        task = RandomTokens(config.vocab_size, config.block_size, seed)
        trainer = SerialTrainer(config, OptimSettings(), task, batch, seed=seed)
    trainer.model.set_recompute(recompute, segments)
    return trainer


def activation_bytes(config, batch: int, recompute: str = "none", segments: int | None = None,
                     seed: int = 0, dtype=np.float32) -> dict:
    """Measured: `kept`, graph_bytes of the loss right after forward; `recomputed`, the largest
    graph backward rebuilt at once (0 without recomputation); `peak`, their sum (the most that
    exists together, give or take what backward has already freed)."""
    check_recompute(recompute, segments, config.n_layer)
    trainer = _trainer(config, batch, recompute, segments, seed, dtype)
    x, y = trainer.task.get_batch(0, batch)
    with default_dtype(dtype):
        _, loss = trainer.model(x, y)
        kept = graph_bytes(loss)
        with record_recomputation() as sizes:
            loss.backward()
    recomputed = max(sizes, default=0)
    return {"kept": kept, "recomputed": recomputed, "peak": kept + recomputed}


def predicted_activation_bytes(config, batch: int, recompute: str = "none", segments: int | None = None,
                               itemsize: int = 4) -> dict:
    """`activation_bytes`'s three numbers from the formula (module docstring)."""
    check_recompute(recompute, segments, config.n_layer)
    s, h, a = config.block_size, config.n_embd, config.n_head
    d = int(config.dropout > 0)
    plain = memory.activation_bytes(config, batch, bytes_per_element=itemsize)
    core = (1 + d) * a * batch * s * s * itemsize  # softmax weights and their dropout mask
    if recompute == "none":
        kept, recomputed = plain["total"], 0
    elif recompute == "selective":
        kept = plain["total"] - config.n_layer * core
        recomputed = batch * s * h * itemsize + core  # one core: its output and the two (s, s) arrays
    else:
        runs = segment_bounds(config.n_layer, segments or config.n_layer)
        kept = plain["outside"] + len(runs) * batch * s * h * itemsize  # each run's output
        recomputed = max(end - start for start, end in runs) * plain["per_layer"]
    return {"kept": kept, "recomputed": recomputed, "peak": kept + recomputed}


def ledger(config, batch: int, dtype=np.float32) -> list[dict]:
    """Per layer, for none / selective / full (one block per run): Megatron's formula in bytes
    (fp16, 1-byte masks), minidist's adaptation (`predicted`) and the measurement: graph_bytes
    of a model one layer deeper minus this one's (`measured`)."""
    s, h, a = config.block_size, config.n_embd, config.n_head
    sbh, e, d = s * batch * h, np.dtype(dtype).itemsize, int(config.dropout > 0)
    deeper = type(config)(**{**config.to_dict(), "n_layer": config.n_layer + 1})
    megatron = {"none": memory.megatron_activation_bytes(batch, s, h, a), "selective": 34 * sbh, "full": 2 * sbh}
    predicted = {"none": e * sbh * (25 + 4 * d + 2 / h + (1 + d) * a * s / h),
                 "selective": e * sbh * (25 + 4 * d + 2 / h), "full": e * sbh}
    rows = []
    for mode in ("none", "selective", "full"):
        measured = (activation_bytes(deeper, batch, mode, dtype=dtype)["kept"]
                    - activation_bytes(config, batch, mode, dtype=dtype)["kept"])
        rows.append({"recompute": mode, "megatron": megatron[mode], "predicted": round(predicted[mode]),
                     "measured": measured})
    return rows


def _step_times(trainers: dict, steps: int, clock) -> dict:
    """Seconds per training step of each trainer: the fastest of `steps` (after one warm-up),
    the trainers taking turns so that a slow moment of the machine hits them all alike.

    The default clock, `time.process_time`, counts this process's CPU seconds: with NumPy on one
    thread (OMP_NUM_THREADS=1) that is the step's time, whatever else shares the machine; with
    threaded BLAS pass `time.perf_counter`."""
    times = {name: [] for name in trainers}
    for step in range(steps + 1):
        for name, trainer in trainers.items():
            start = clock()
            trainer.step(step)
            if step:
                times[name].append(clock() - start)
    return {name: min(t) for name, t in times.items()}


def memory_time_curve(config, batch: int, segment_counts=None, steps: int = 3, dtype=np.float32,
                      clock=time.process_time) -> list[dict]:
    """Memory against time over segment counts k of full recomputation (and no recomputation
    for reference): measured and predicted peak, kept bytes, and seconds per training step."""
    counts = list(segment_counts or range(1, config.n_layer + 1))
    settings = [("none", None)] + [("full", k) for k in counts]
    trainers = {f"{mode}:{k}": _trainer(config, batch, mode, k, dtype=dtype) for mode, k in settings}
    seconds = _step_times(trainers, steps, clock)
    itemsize = np.dtype(dtype).itemsize
    rows = []
    for mode, k in settings:
        measured = activation_bytes(config, batch, mode, k, dtype=dtype)
        predicted = predicted_activation_bytes(config, batch, mode, k, itemsize)
        rows.append({"recompute": mode, "segments": k, "kept": measured["kept"], "peak": measured["peak"],
                     "predicted_peak": predicted["peak"], "step_s": seconds[f"{mode}:{k}"]})
    return rows


def step_overheads(config, batch: int, steps: int = 3, dtype=np.float32, clock=time.process_time) -> dict:
    """Seconds per training step without, with full and with selective recomputation, and the
    extra time of each as a fraction of the plain step (`full_extra`, `selective_extra`)."""
    trainers = {mode: _trainer(config, batch, mode, dtype=dtype) for mode in ("none", "full", "selective")}
    seconds = _step_times(trainers, steps, clock)
    return {**seconds, "full_extra": seconds["full"] / seconds["none"] - 1,
            "selective_extra": seconds["selective"] / seconds["none"] - 1}
