"""`python -m minidist.bench step`: how fast is one training step of the demo GPT?

Chapter 1. Times forward + backward + AdamW step of the demo model (vocab 256, block 64,
n_embd 128, 4 layers, 4 heads, batch 16) in float32 and float64 and prints, side by side:

- minidist's step on each kernel path (`minidist.core.kernels`): fast, and plain (fused.py's
  formulas as written): median over the timed steps after warm-up, and tokens/s;
- the floor: the same matrix multiplications (every GEMM of forward and backward) done
  directly in NumPy, with nothing else — no framework can beat that on these BLAS calls;
- PyTorch's eager CPU step on the same model, when torch is installed (it is never a
  dependency of minidist: `pip install torch` to see it), and PyTorch's own floor: the same
  GEMMs on its BLAS (often MKL, faster than NumPy's OpenBLAS), so that each framework's step can
  be set against its own matrix products ("torch_matmul_floor_seconds");
- where minidist's time goes, per operation (`minidist.core.tensor.profile`);
- the Linear layers' GEMMs timed inside the fast path's step and the same GEMMs alone, in a loop
  as the floor runs them (`minidist.lab.gemms_in_step`): inside a step their arrays come from
  memory, not the cache, so even a step with nothing but GEMMs would not reach the floor.

All are timed in turns, step after step, so that they share the machine's conditions. The JSON
record's "seconds", "tokens_per_s" and "ops" are those of the path named in "kernels" (fast,
unless only plain is timed); "plain_seconds" is the plain path's step (null when not timed);
"linear_gemms_in_step_seconds" and "linear_gemms_alone_seconds" are per step (null when the fast
path is not timed).

It runs NumPy's BLAS and PyTorch with one thread each: that is how ranks run.
"""
from __future__ import annotations

import json
import time

import numpy as np
from threadpoolctl import threadpool_limits

from minidist import cli
from minidist.core.kernels import kernels
from minidist.core.model import GPT, GPTConfig
from minidist.core.optim import AdamW
from minidist.runtime import tune_malloc
from minidist.core.tensor import default_dtype, profile
from minidist.lab.gemms_in_step import linear_gemms_in_step

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


def on_path(path, step):
    """`step` run on the kernel path `path` ("plain" or "fast")."""
    def run():
        with kernels(path):
            step()

    return run


def matmul_floor(config, batch_size, dtype, library="numpy"):
    """Every GEMM of one training step, done directly in NumPy (library="torch": in PyTorch, on
    its own BLAS, so that each framework's step can be set against its own floor)."""
    n, c, v = batch_size * config.block_size, config.n_embd, config.vocab_size
    h, t = config.n_head, config.block_size
    rng = np.random.default_rng(0)
    arrays = {}
    if library == "torch":
        import torch

    def a(*shape):
        if shape not in arrays:
            array = rng.standard_normal(shape).astype(dtype)
            arrays[shape] = torch.from_numpy(array) if library == "torch" else array
        return arrays[shape]

    def swap(m):  # the last two axes
        return m.transpose(-1, -2) if library == "torch" else np.swapaxes(m, -1, -2)

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
            s = q @ swap(q)  # scores, then weights @ v, and 4 GEMMs backward
            s @ q
            swap(s) @ q
            q @ swap(q)
            s @ q
            swap(s) @ q

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
    parser = cli.OneLineParser(prog="python -m minidist.bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=cli.integer(1), default=20, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=cli.integer(0), default=3)
    parser.add_argument("--dtype", choices=["float32", "float64", "both"], default="both")
    parser.add_argument("--kernels", choices=["fast", "plain", "both"], default="both",
                        help="which kernel path(s) of minidist to time (minidist.core.kernels)")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch even when installed")
    parser.add_argument("--json", metavar="PATH", type=cli.output_file)
    args = parser.parse_args(argv)
    tune_malloc()
    threadpool_limits(limits=1)  # one BLAS thread, as a rank has when ranks fill the cores (torch: the same)
    dtypes = ["float32", "float64"] if args.dtype == "both" else [args.dtype]
    paths = ["fast", "plain"] if args.kernels == "both" else [args.kernels]
    tokens = BATCH * CONFIG.block_size
    records = []
    for dtype in dtypes:
        built = {path: minidist_step(CONFIG, BATCH, dtype) for path in paths}  # (step, model, optimizer)
        steps = {path: on_path(path, built[path][0]) for path in paths}
        model = built[paths[0]][1]
        contenders = {**steps, "floor": matmul_floor(CONFIG, BATCH, dtype)}
        torch_fn = None if args.no_torch else torch_step(CONFIG, BATCH, dtype)
        if torch_fn:
            contenders["torch"] = torch_fn
            contenders["torch floor"] = matmul_floor(CONFIG, BATCH, dtype, library="torch")
        medians = interleaved_medians(contenders, args.steps, args.warmup)
        main_path = paths[0]  # fast, unless only plain is timed
        ours, floor, theirs = medians[main_path], medians["floor"], medians.get("torch")
        with profile() as ops:
            steps[main_path]()
        inside = alone = None
        if "fast" in built:
            inside, alone, _ = linear_gemms_in_step(built["fast"][0], steps=min(args.steps, 10),
                                                    warmup=min(args.warmup, 2))
        record = {"benchmark": "step", "dtype": dtype, "batch": BATCH, "tokens": tokens,
                  "parameters": model.num_parameters(), "seconds": ours, "tokens_per_s": tokens / ours,
                  "matmul_floor_seconds": floor, "torch_seconds": theirs,
                  "ops": {k: {"forward": v[0], "backward": v[1], "calls": v[2]} for k, v in ops.items()},
                  "kernels": main_path, "plain_seconds": medians.get("plain"),
                  "torch_matmul_floor_seconds": medians.get("torch floor"),
                  "linear_gemms_in_step_seconds": inside, "linear_gemms_alone_seconds": alone}
        records.append(record)
        print(f"\n{dtype}:")
        for path in paths:
            seconds = medians[path]
            print(f"         minidist {path:5s} {seconds * 1e3:7.1f} ms/step ({tokens / seconds:,.0f} tokens/s)")
        print(f"         matmul floor   {floor * 1e3:7.1f} ms   "
              + "   ".join(f"minidist {path} / floor = {medians[path] / floor:.2f}x" for path in paths))
        if theirs:
            print(f"         PyTorch        {theirs * 1e3:7.1f} ms   "
                  + "   ".join(f"minidist {path} / PyTorch = {medians[path] / theirs:.2f}x" for path in paths))
            their_floor = medians["torch floor"]
            print(f"         PyTorch's own matmul floor {their_floor * 1e3:7.1f} ms   PyTorch / its floor = "
                  f"{theirs / their_floor:.2f}x   (its BLAS / NumPy's on these GEMMs: {their_floor / floor:.2f}x)")
        else:
            print("         PyTorch        (not installed: pip install torch to compare)")
        if inside:
            print(f"         Linear's GEMMs inside the fast step {inside * 1e3:6.1f} ms, the same GEMMs alone "
                  f"{alone * 1e3:6.1f} ms ({inside / alone:.2f}x: inside a step their arrays come from memory)")
        print(f"         where the {main_path} path's time goes:")
        total = sum(v[0] + v[1] for v in ops.values())
        print(f"         {'operation':28s} {'forward':>9s} {'backward':>9s} {'share':>6s}")
        for name, (fwd, bwd, calls) in sorted(ops.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:10]:
            print(f"         {name:28s} {fwd * 1e3:7.2f}ms {bwd * 1e3:7.2f}ms {(fwd + bwd) / total:6.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0
