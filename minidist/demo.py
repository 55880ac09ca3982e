"""`python -m minidist.demo`: train the small GPT and watch it learn.

    python -m minidist.demo                           # serial, on the built-in sorting task
    python -m minidist.demo --data input.txt          # byte-level language model of any file
    mpirun -n 4 python -m minidist.demo               # under MPI (see below)

The flags and the `--json` keys are a contract (notebooks and checks read them): later
chapters add flags and keys, none is renamed or dropped.

JSON keys: world_size, layout {dp, tp, pp, zero}, dtype, config, losses (global mean loss of
every step), accuracies, tokens_per_s (median over steps after the first), step_seconds,
parameters, memory (one entry per rank: bytes of params, grads, optimizer, activations, peak),
comm (one entry per rank: bytes_sent, bytes_received, messages, ...).

Under `mpirun -n N` with no layout flags, the serial run trains on rank 0 and the other ranks
wait (politely, without spinning) until it is done; the parallel strategies arrive with the
chapters that teach them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

from minidist import dist
from minidist.data import accuracy, make_task
from minidist.dist import faults, traffic
from minidist.model import GPTConfig
from minidist.runtime import tune_malloc
from minidist.tensor import set_default_dtype
from minidist.train import OptimSettings, SerialTrainer


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        if dist.get_rank() == 0:
            print(f"minidist.demo: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="python -m minidist.demo", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch-size", type=int, default=16, help="global batch size (sequences per step)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warm-up then cosine)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--untied", action="store_true", help="separate LM head instead of tying it to the embedding")
    p.add_argument("--data", default="sort", help="'sort' (built-in task) or a path to any text file")
    p.add_argument("--log-every", type=int, default=0, help="steps between log lines (0: about 10 lines)")
    p.add_argument("--json", metavar="PATH", help="write the run's measurements as JSON (rank 0)")
    p.add_argument("--save", metavar="PATH.npz", help="write the final weights, keyed by parameter name")
    return p


def check_args(args, world_size: int) -> tuple[GPTConfig, object]:
    """Everything that can be wrong with the flags, found identically on every rank."""
    for name in ("steps", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    config = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd, dropout=args.dropout, tie_weights=not args.untied)
    task = make_task(args.data, args.block_size, seed=args.seed)
    return config, task


def train(args, trainer, task, show: bool):
    """The loop every strategy shares: batches, steps, progress, log lines."""
    log_every = args.log_every or max(1, args.steps // 10)
    losses, accuracies, seconds = [], [], []
    bar = tqdm(total=args.steps, disable=not show, desc=trainer.name, unit="step", dynamic_ncols=True)
    for step in range(args.steps):
        x, y = task.get_batch(step, args.batch_size)
        start = time.perf_counter()
        loss, logits = trainer.step(step, x, y)
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        accuracies.append(accuracy(logits, y))
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{accuracies[-1]:.2f}")
        if show and (step % log_every == 0 or step == args.steps - 1):
            bar.write(f"step {step:4d} | loss {loss:.4f} | acc {accuracies[-1]:.3f} | {sample(trainer, task, step)}")
    bar.close()
    return losses, accuracies, seconds


def sample(trainer, task, step: int) -> str:
    model = getattr(trainer, "model", None)
    if model is None:
        return ""
    prompt, expected = task.sample_prompt(step)
    out = model.generate(prompt[None], task.answer_length)[0]
    return task.format_sample(prompt, out[len(prompt):], expected)


def write_json(path: str, report: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as f:
        json.dump(report, f, indent=1)
    os.replace(f.name, path)  # atomic: a reader never sees half a file


def save_weights(path: str, state: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile(dir=directory, delete=False, suffix=".tmp") as f:
        np.savez(f, **state)
    os.replace(f.name, path)


def main(argv=None) -> int:
    faults.install()
    tune_malloc()
    world = dist.get_world()
    args = build_parser().parse_args(argv)
    try:
        config, task = check_args(args, world.size)
    except (ValueError, FileNotFoundError) as error:
        faults.fail(str(error))
    set_default_dtype(args.dtype)
    settings = OptimSettings(lr=args.lr, steps=args.steps, warmup=min(10, args.steps // 10), min_lr=args.lr / 10)

    trainer, report = None, None
    if world.rank == 0:
        if world.size > 1:
            print(f"minidist.demo: no layout flags, so the serial run trains on rank 0 while the other "
                  f"{world.size - 1} ranks wait.", flush=True)
        trainer = SerialTrainer(config, settings, seed=args.seed)
        losses, accuracies, seconds = train(args, trainer, task, show=True)
        tokens = args.batch_size * args.block_size
        report = {
            "world_size": world.size,
            "layout": {"dp": 1, "tp": 1, "pp": 1, "zero": 0},
            "dtype": args.dtype,
            "config": config.to_dict(),
            "losses": losses,
            "accuracies": accuracies,
            "step_seconds": seconds,
            "tokens_per_s": tokens / float(np.median(seconds[1:] if len(seconds) > 1 else seconds)),
            "parameters": trainer.model.num_parameters(),
        }
        print(f"done: final loss {losses[-1]:.4f}, accuracy {accuracies[-1]:.3f}, "
              f"{report['tokens_per_s']:.0f} tokens/s", flush=True)
    dist.barrier()  # the other ranks wait here, politely polling instead of spinning
    memory = world.comm.allgather(trainer.memory() if trainer else {
        "params": 0, "grads": 0, "optimizer": 0, "activations": 0, "peak": 0})
    comm = traffic.gather()
    if world.rank == 0:
        report["memory"] = memory
        report["comm"] = comm
        if args.json:
            write_json(args.json, report)
        if args.save:
            save_weights(args.save, trainer.state_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
