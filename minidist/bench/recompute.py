"""`python -m minidist.bench recompute`: what activation checkpointing saves and what it costs (chapter 11).

    python -m minidist.bench recompute [--modes none,selective,full] [--segments 1,2,4] [--steps 10]
                                       [--batch-size 16] [--n-layer 4 --n-embd 128 --n-head 4
                                       --block-size 64] [--json PATH]

One process, the demo's GPT by default (float32, batch 16, random tokens). For every setting —
no recomputation, selective (the attention cores rerun in backward), and full with each segment
count k (k checkpointed runs of consecutive blocks) — it prints:

- the activation bytes the graph keeps after forward (`kept`) and the most that exists at once
  in backward (`peak` = kept + the largest graph backward rebuilds), measured with
  `tensor.graph_bytes`, beside the formula of `recompute_cost.predicted_activation_bytes`
  (they must agree to the byte: the column says so);
- the training step's time: the fastest of --steps steps after a warm-up, counted in CPU seconds
  of this process on one BLAS thread, every setting taking its turn step by step so that a slow
  moment of a shared machine hits them all alike;
- each as a ratio to "none", measured in the same run: the yardstick.

First it prints one transformer layer's activation bytes for none, selective and full: the
measurement, minidist's formula and Korthikanti et al.'s sbh(34 + 5as/h) (fp16, 1-byte masks).

What to expect: full recomputation reruns every block's forward once more, so about a third more
work when backward costs two forwards; selective reruns only softmax(QK^T)V, a few per cent of
the step. Full recomputation keeps k block outputs and rebuilds one run of n/k blocks at a time:
for a transformer a block's graph is ~30 times its output, so the peak is lowest at k = n (one
block per run), not at Chen et al.'s sqrt(n).
"""
from __future__ import annotations

import time

from threadpoolctl import threadpool_limits

from minidist import cli
from minidist.core.model import GPTConfig
from minidist.core.recompute import MODES
from minidist.plan.recompute_cost import DEMO, RandomTokens, activation_bytes, ledger, predicted_activation_bytes
from minidist.runtime import tune_malloc
from minidist.core.tensor import default_dtype
from minidist.training.train import OptimSettings, SerialTrainer
from minidist.bench import write_records

BATCH = 16


def settings_of(modes: list[str], segments: list[int]) -> list[tuple[str, int | None]]:
    """(mode, segments) to measure: "none" first (the yardstick), full once per segment count."""
    rows = [("none", None)]
    for mode in modes:
        if mode == "selective":
            rows.append(("selective", None))
        elif mode == "full":
            rows += [("full", k) for k in segments]
    return rows


def trainer(config: GPTConfig, batch: int, mode: str, segments: int | None) -> SerialTrainer:
    with default_dtype("float32"):
        t = SerialTrainer(config, OptimSettings(), RandomTokens(config.vocab_size, config.block_size), batch, seed=0)
    t.model.set_recompute(mode, segments)
    return t


def step_seconds(trainers: dict, steps: int) -> dict:
    """The fastest of `steps` training steps of each trainer (after one warm-up), in CPU seconds,
    the trainers taking turns step by step."""
    times = {name: [] for name in trainers}
    for step in range(steps + 1):
        for name, t in trainers.items():
            start = time.process_time()
            t.step(step)
            if step:  # the first step warms caches and the allocator
                times[name].append(time.process_time() - start)
    return {name: min(seconds) for name, seconds in times.items()}


def measure(config: GPTConfig, batch: int, settings, steps: int) -> list[dict]:
    """One record per (mode, segments): bytes measured and predicted, seconds per step, ratios to "none"."""
    records = []
    for mode, k in settings:
        measured = activation_bytes(config, batch, mode, k)
        predicted = predicted_activation_bytes(config, batch, mode, k, itemsize=4)
        records.append({"recompute": mode, "segments": k, "kept_bytes": measured["kept"],
                        "recomputed_bytes": measured["recomputed"], "peak_bytes": measured["peak"],
                        "predicted_peak_bytes": predicted["peak"], "formula_matches": measured == predicted})
    names = [f"{mode}:{k}" for mode, k in settings]
    seconds = step_seconds({name: trainer(config, batch, mode, k) for name, (mode, k) in zip(names, settings)}, steps)
    none = records[0]
    for record, name in zip(records, names):
        record.update(step_seconds=seconds[name], kept_ratio=record["kept_bytes"] / none["kept_bytes"],
                      peak_ratio=record["peak_bytes"] / none["peak_bytes"],
                      time_ratio=seconds[name] / seconds[names[0]], config=config.to_dict(), batch_size=batch)
    return records


def print_ledger(config: GPTConfig, batch: int) -> None:
    rows = ledger(config, batch)
    print("one layer's activations (bytes): measured = minidist's formula; Megatron's sbh(34 + 5as/h) for fp16")
    for r in rows:
        print(f"  {r['recompute']:9s} measured {r['measured']:>10,}  formula {r['predicted']:>10,}  "
              f"Megatron {r['megatron']:>12,.0f}")


def print_table(records) -> None:
    print(f"{'recompute':10s} {'k':>3s} {'kept MB':>8s} {'x none':>7s} {'peak MB':>8s} {'x none':>7s} "
          f"{'= formula':>9s} {'step ms':>8s} {'x none':>7s}")
    for r in records:
        k = "" if r["segments"] is None else str(r["segments"])
        print(f"{r['recompute']:10s} {k:>3s} {r['kept_bytes'] / 1e6:8.2f} {r['kept_ratio']:7.3f} "
              f"{r['peak_bytes'] / 1e6:8.2f} {r['peak_ratio']:7.3f} {'yes' if r['formula_matches'] else 'NO':>9s} "
              f"{r['step_seconds'] * 1e3:8.1f} {r['time_ratio']:7.2f}")


def main(argv=None) -> int:
    positive = cli.integer(1)
    parser = cli.OneLineParser(prog="python -m minidist.bench recompute", description=__doc__.split("\n")[0])
    parser.add_argument("--modes", type=cli.listof(cli.one_of(MODES)), default=["none", "selective", "full"],
                        help="recompute settings to measure beside none (the yardstick, always measured)")
    parser.add_argument("--segments", type=cli.listof(positive), default=None,
                        help="with full: checkpointed runs of consecutive blocks (default 1, 2, 4, ... up to n_layer)")
    parser.add_argument("--steps", type=positive, default=10, help="timed steps per setting (after one warm-up)")
    parser.add_argument("--batch-size", type=positive, default=BATCH)
    parser.add_argument("--n-layer", type=positive, default=DEMO["n_layer"])
    parser.add_argument("--n-embd", type=positive, default=DEMO["n_embd"])
    parser.add_argument("--n-head", type=positive, default=DEMO["n_head"])
    parser.add_argument("--block-size", type=positive, default=DEMO["block_size"])
    parser.add_argument("--json", type=cli.output_file, help="write the records as a JSON list")
    args = parser.parse_args(argv)
    try:
        config = GPTConfig(vocab_size=DEMO["vocab_size"], block_size=args.block_size, n_layer=args.n_layer,
                           n_head=args.n_head, n_embd=args.n_embd)
    except ValueError as error:
        parser.error(f"--n-embd {args.n_embd} --n-head {args.n_head}: {error}")
    segments = args.segments or sorted({min(2 ** i, args.n_layer) for i in range(args.n_layer.bit_length() + 1)})
    too_many = [k for k in segments if k > args.n_layer]
    if too_many:
        parser.error(f"--segments {too_many[0]}: a model of --n-layer {args.n_layer} has at most {args.n_layer} runs")

    tune_malloc()
    settings = settings_of(args.modes, segments)
    print(f"activation checkpointing: GPT {config.to_dict()}, float32, batch {args.batch_size}; "
          f"step time = fastest of {args.steps} steps, CPU seconds on 1 thread")
    with threadpool_limits(limits=1):  # CPU seconds are the step's time only on one thread
        print_ledger(config, args.batch_size)
        records = measure(config, args.batch_size, settings, args.steps)
    print_table(records)
    write_records(args.json, records)
    return 0
