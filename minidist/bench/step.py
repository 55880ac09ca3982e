"""`python -m minidist.bench step`: how fast is one training step of the demo GPT?

Chapter 1. Times forward + backward + AdamW step of the demo model (vocab 256, block 64,
n_embd 128, 4 layers, 4 heads, batch 16) in float32 and float64 and prints, side by side:

- minidist's step: median over the timed steps after warm-up, and tokens/s;
- the floor: the same matrix multiplications (every GEMM of forward and backward) done
  directly in NumPy, with nothing else — no framework can beat that on these BLAS calls;
- PyTorch's eager CPU step on the same model, when torch is installed (it is never a
  dependency of minidist: `pip install torch` to see it);
- where minidist's time goes, per operation (`minidist.tensor.profile`).

The three are timed in turns, step after step, so that they share the machine's conditions.

Run it with one BLAS thread (OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1): that is how ranks run.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from minidist.model import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.runtime import tune_malloc
from minidist.tensor import default_dtype, profile

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 16


def batch(config: GPTConfig, batch_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, config.vocab_size, (batch_size, config.block_size))
    y = rng.integers(0, config.vocab_size, (batch_size, config.block_size))
    return x, y


def interleaved_medians(fns: dict, steps: int, warmup: int) -> dict:
    """Median seconds of each function, timed in turns (a, b, c, a, b, c, ...).

    On a shared machine the speed drifts from one second to the next; timing the contenders in
    turns lets every one of them see the same conditions, so their ratio stays meaningful."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def minidist_step(config, batch_size, dtype):
    with default_dtype(dtype):
        model = GPT(config, seed=0)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    x, y = batch(config, batch_size)

    def step():
        _, loss = model(x, y)
        model.zero_grad()
        loss.backward()
        optimizer.step()

    return step, model, optimizer


def matmul_floor(config, batch_size, dtype):
    """Every GEMM of one training step, done directly in NumPy."""
    n, c, v = batch_size * config.block_size, config.n_embd, config.vocab_size
    h, t = config.n_head, config.block_size
    rng = np.random.default_rng(0)
    arrays = {}

    def a(*shape):
        key = shape
        if key not in arrays:
            arrays[key] = rng.standard_normal(shape).astype(dtype)
        return arrays[key]

    linears = [(c, c)] * 4 + [(c, 4 * c), (4 * c, c)]  # per block: q, k, v, proj, fc, proj
    shapes = linears * config.n_layer + [(c, v)]       # and the LM head
    q = a(batch_size, h, t, c // h)

    def step():
        for fan_in, fan_out in shapes:
            x, w, g = a(n, fan_in), a(fan_out, fan_in), a(n, fan_out)
            x @ w.T          # forward
            g @ w            # backward to the input
            g.T @ x          # backward to the weight
        for _ in range(config.n_layer):
            s = q @ np.swapaxes(q, -1, -2)  # scores, then weights @ v, and 4 GEMMs backward
            s @ q
            np.swapaxes(s, -1, -2) @ q
            q @ np.swapaxes(q, -1, -2)
            s @ q
            np.swapaxes(s, -1, -2) @ q

    return step


def torch_step(config, batch_size, dtype):
    """The same model in PyTorch eager mode, if torch is installed (None otherwise)."""
    try:
        import torch
    except ImportError:
        return None
    from minidist.bench._torch_gpt import make_torch_step

    torch.set_num_threads(1)
    return make_torch_step(config, batch_size, dtype)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minidist.bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "float64", "both"], default="both")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch even when installed")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    tune_malloc()
    dtypes = ["float32", "float64"] if args.dtype == "both" else [args.dtype]
    tokens = BATCH * CONFIG.block_size
    records = []
    for dtype in dtypes:
        step, model, _ = minidist_step(CONFIG, BATCH, dtype)
        contenders = {"minidist": step, "floor": matmul_floor(CONFIG, BATCH, dtype)}
        torch_fn = None if args.no_torch else torch_step(CONFIG, BATCH, dtype)
        if torch_fn:
            contenders["torch"] = torch_fn
        medians = interleaved_medians(contenders, args.steps, args.warmup)
        ours, floor, theirs = medians["minidist"], medians["floor"], medians.get("torch")
        with profile() as ops:
            step()
        record = {"benchmark": "step", "dtype": dtype, "batch": BATCH, "tokens": tokens,
                  "parameters": model.num_parameters(), "seconds": ours, "tokens_per_s": tokens / ours,
                  "matmul_floor_seconds": floor, "torch_seconds": theirs,
                  "ops": {k: {"forward": v[0], "backward": v[1], "calls": v[2]} for k, v in ops.items()}}
        records.append(record)
        print(f"\n{dtype}: minidist {ours * 1e3:7.1f} ms/step ({tokens / ours:,.0f} tokens/s)")
        print(f"         matmul floor {floor * 1e3:7.1f} ms   minidist / floor = {ours / floor:.2f}x")
        if theirs:
            print(f"         PyTorch      {theirs * 1e3:7.1f} ms   minidist / PyTorch = {ours / theirs:.2f}x")
        else:
            print("         PyTorch      (not installed: pip install torch to compare)")
        total = sum(v[0] + v[1] for v in ops.values())
        print(f"         {'operation':28s} {'forward':>9s} {'backward':>9s} {'share':>6s}")
        for name, (fwd, bwd, calls) in sorted(ops.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:10]:
            print(f"         {name:28s} {fwd * 1e3:7.2f}ms {bwd * 1e3:7.2f}ms {(fwd + bwd) / total:6.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0
