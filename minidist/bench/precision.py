"""Benchmark: fp32, bf16 and fp16 training side by side — memory, traffic, time, loss (chapter 10).

    python -m minidist.bench precision [--steps 8] [--batch-size 16] [--json PATH]
    python -m minidist.bench precision --n-layer 2 --n-embd 32 --block-size 16 --n-head 2   # a tiny GPT

Launch it as ONE ordinary process (not under mpirun). It trains the demo GPT on the sort task
in each precision twice: serially in this process (`SerialTrainer`), and as 2-rank data
parallelism in one job it starts itself (`minidist.comm.launch.run`, `DataParallelTrainer` with
the ring all-reduce). In each, the three precisions take turns step by step, so a slow moment of
the machine hits them alike, and every number is printed beside fp32's from the same run:

    memory per rank     params, grads, optimizer (2 + 2 + 12 against 4 + 4 + 8 bytes per
                        parameter) and activations (what the autograd graph keeps for backward)
    dp bytes per step   the gradients' ring all-reduce, 2(N-1)/N x itemsize x parameters, plus
                        the small all-reduces of the logged loss and the overflow flag
    step time           median over the steps after the first
    final loss          the last step's, and the steps the loss scaler skipped

What to expect: model states equal in total (16 bytes per parameter either way, split
differently); dp bytes halved in 16 bits; activations *larger* in 16 bits, and steps *slower*:
minidist emulates the formats (each operation converts its 16-bit inputs to fp32, computes, saves
the fp32 copies for backward and rounds its output), so neither the tensor cores' speed nor the
halved activations of a GPU appear here. The chapter explains both.
"""
from __future__ import annotations

import json
import time

import numpy as np

from minidist import cli
from minidist.comm.launch import run

PRECISIONS = ("fp32", "bf16", "fp16")
DEFAULT_CONFIG = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)  # the demo's GPT


def train(trainers: dict, steps: int) -> dict:
    """Step every trainer in turn, `steps` times; per precision: seconds per step, losses, skips, ledger."""
    from minidist.comm import traffic

    out = {p: {"seconds": [], "bytes_sent": 0.0} for p in trainers}
    with np.errstate(over="ignore", invalid="ignore"):  # an fp16 overflow is the scaler's signal
        for s in range(steps):
            for precision, trainer in trainers.items():
                before = traffic.snapshot()["total"]["bytes_sent"]
                start = time.perf_counter()
                loss, _ = trainer.step(s)
                out[precision]["seconds"].append(time.perf_counter() - start)
                out[precision]["bytes_sent"] += (traffic.snapshot()["total"]["bytes_sent"] - before) / steps
                out[precision]["loss"] = loss
    for precision, trainer in trainers.items():
        history = trainer.scaler.history
        out[precision].update(memory=trainer.memory(), params=trainer.num_parameters(),
                              skipped=sum(1 for *_, skipped in history if skipped),
                              scale=history[-1][1] if history else 1.0)
    return out


def settings_for(steps: int):
    from minidist.training.train import OptimSettings

    return OptimSettings(lr=3e-3, steps=steps, warmup=min(2, steps - 1), min_lr=3e-4)


def serial(config: dict, steps: int, batch_size: int) -> dict:
    """The three precisions trained serially in this process."""
    from minidist.core.data import make_task
    from minidist.core.model import GPTConfig
    from minidist.training.train import SerialTrainer

    task = make_task("sort", config["block_size"], seed=0)
    return train({p: SerialTrainer(GPTConfig(**config), settings_for(steps), task, batch_size, precision=p)
                  for p in PRECISIONS}, steps)


def data_parallel(config: dict, steps: int, batch_size: int) -> dict:
    """Rank program: the three precisions as data parallelism over the job's ranks."""
    from minidist.comm import get_world
    from minidist.core.data import make_task
    from minidist.core.model import GPTConfig
    from minidist.parallel.data_parallel import DataParallelTrainer
    from minidist.runtime import limit_threads_per_rank

    limit_threads_per_rank()  # ranks share the machine's cores (chapter 2)
    task = make_task("sort", config["block_size"], seed=0)
    return train({p: DataParallelTrainer(GPTConfig(**config), settings_for(steps), task, batch_size,
                                         group=get_world(), algorithm="ring", bucket_cap_bytes=1 << 30, precision=p)
                  for p in PRECISIONS}, steps)


def records(mode: str, ranks: list[dict], steps: int) -> list[dict]:
    """One record per precision: rank 0's ledger, the slowest rank's step times, ratios to fp32."""
    out = []
    for precision in PRECISIONS:
        r = ranks[0][precision]
        per_step = np.max([rank[precision]["seconds"] for rank in ranks], axis=0)  # a step ends with its slowest rank
        memory = {k: r["memory"][k] for k in ("params", "grads", "optimizer", "activations")}
        memory["model_states"] = memory["params"] + memory["grads"] + memory["optimizer"]
        out.append({"benchmark": "precision", "mode": mode, "ranks": len(ranks), "precision": precision,
                    "num_params": r["params"], "steps": steps, "memory": memory,
                    "bytes_sent_per_step": max(rank[precision]["bytes_sent"] for rank in ranks),
                    "step_seconds": float(np.median(per_step[1:])), "final_loss": r["loss"],
                    "skipped_steps": r["skipped"], "final_scale": r["scale"]})
    fp32 = out[0]
    for rec in out:  # everything against fp32 from the same run
        rec["x_fp32"] = {
            **{k: rec["memory"][k] / fp32["memory"][k] for k in rec["memory"] if fp32["memory"][k]},
            "bytes_sent": rec["bytes_sent_per_step"] / fp32["bytes_sent_per_step"] if fp32["bytes_sent_per_step"] else None,
            "step_seconds": rec["step_seconds"] / fp32["step_seconds"]}
    return out


def print_table(recs: list[dict]) -> None:
    print(f"{'mode':6s} {'precision':9s} {'params':>9s} {'grads':>9s} {'optimizer':>10s} {'states':>14s} "
          f"{'activations':>18s} {'dp bytes/step':>18s} {'step ms':>14s} {'final loss':>10s} {'skipped':>7s}")
    for r in recs:
        m, x = r["memory"], r["x_fp32"]
        sent = (f"{r['bytes_sent_per_step']:>10,.0f} ({x['bytes_sent']:.2f}x)" if r["mode"] != "serial" else
                f"{'-':>18s}")
        print(f"{r['mode']:6s} {r['precision']:9s} {m['params']:>9,} {m['grads']:>9,} {m['optimizer']:>10,} "
              f"{m['model_states']:>9,} ({x['model_states']:.2f}x) {m['activations']:>11,} ({x['activations']:.2f}x) "
              f"{sent} {r['step_seconds'] * 1e3:>7.1f} ({x['step_seconds']:.1f}x) {r['final_loss']:>10.4f} "
              f"{r['skipped_steps']:>7d}")


def main(argv=None) -> int:
    positive = cli.integer(1)
    parser = cli.OneLineParser(prog="python -m minidist.bench precision", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=cli.integer(2), default=8, help="steps per precision (the first is not timed)")
    parser.add_argument("--batch-size", type=positive, default=16, help="global batch (sequences per step)")
    parser.add_argument("--n-layer", type=positive, default=DEFAULT_CONFIG["n_layer"])
    parser.add_argument("--n-head", type=positive, default=DEFAULT_CONFIG["n_head"])
    parser.add_argument("--n-embd", type=positive, default=DEFAULT_CONFIG["n_embd"])
    parser.add_argument("--block-size", type=positive, default=DEFAULT_CONFIG["block_size"])
    parser.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the records as a JSON list")
    args = parser.parse_args(argv)
    ranks = 2
    if args.batch_size % ranks:
        parser.error(f"--batch-size {args.batch_size} is not divisible by the {ranks} data-parallel ranks")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if args.block_size < 16:
        parser.error(f"--block-size {args.block_size}: the sort task needs at least 16 (8 digits, '=', the answer)")
    config = dict(DEFAULT_CONFIG, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                  block_size=args.block_size)

    print(f"precision benchmark: GPT {config}, global batch {args.batch_size}, {args.steps} steps per "
          f"precision (median step time of steps 2-{args.steps}); ratios against fp32 of the same run")
    started = time.perf_counter()
    recs = records("serial", [serial(config, args.steps, args.batch_size)], args.steps)
    recs += records("dp2", run(data_parallel, ranks, config, args.steps, args.batch_size, timeout=600, echo=False),
                    args.steps)
    print_table(recs)
    psi = recs[0]["num_params"]
    print(f"Ψ = {psi:,} parameters; model states per rank: fp32 4 + 4 + 8, 16-bit 2 + 2 + 12 bytes per parameter "
          f"(= {16 * psi:,} both); dp ring bytes 2(N-1)/N x itemsize x Ψ = {4 * psi:,} (fp32), {2 * psi:,} (16-bit), "
          f"plus the small all-reduces. ({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1)
        print(f"wrote {len(recs)} records to {args.json}")
    return 0
