"""`python -m minidist.bench context_parallel`: ring attention and Ulysses, zigzag and contiguous (chapter 11).

    python -m minidist.bench context_parallel [--cp 2,4] [--batch-size 1] [--n-head 4] [--seq-length 1024]
                                              [--head-dim 16] [--repeats 3] [--timeout 300] [--json PATH]

How it runs: launch it as ONE ordinary process (not under mpirun). For each cp = N it starts a job
of N real MPI ranks (`minidist.comm.launch.run`). In the job, every rank draws the same float64
q, k, v of shape (B, H, T, D), keeps its T/N tokens of them, and runs causal attention forward
and backward over the whole sequence four ways — ring attention and DeepSpeed-Ulysses, each with
the contiguous and the zigzag split (`parallel/context_parallel.py`, `parallel/ulysses.py`) —
--repeats times, after one untimed run. Per way it prints:

- the unmasked score entries each rank computes (query i sees keys 0..i), and max / mean over
  the ranks: 1.00 is perfect balance; the slowest rank sets the pace of every layer;
- each rank's CPU seconds per attention (forward + backward, messages included; CPU time, so
  that ranks sharing a core are not charged for each other, and waits sleep at once instead of
  yielding the core, so that waiting costs next to none), max / mean over ranks, and the
  slowest rank's time as a multiple of the serial kernel's on the whole sequence, timed in the
  same job (the yardstick: 1/N would be a perfect split);
- the bytes a rank sends per attention, measured by the traffic counters, against the formula:
  ring 3(N-1) x 2·B·H·(T/N)·D elements (K and V forward; K, V and their gradients backward),
  Ulysses 8(N-1)/N x B·H·(T/N)·D (q, k, v and the output, each way);
- the largest relative difference from the serial kernel's output and gradients.

What to expect: with the contiguous split the last rank's queries see the whole sequence and the
first rank's almost nothing, so its work is near 2N/(N+1) times the mean; zigzag gives every rank
an early and a late chunk and the same work. Ulysses is balanced by construction (every rank runs
all tokens of H/N heads) and sends less — 4/(3N) of the ring's bytes — but needs N to divide H,
and keeps its heads' T x T weights where the ring keeps none.
"""
from __future__ import annotations

import time

import numpy as np

from minidist import cli
from minidist.comm.launch import run
from minidist.parallel.context_parallel import ALGORITHMS, check_sequence_split, ring_attention_traffic
from minidist.parallel.ulysses import check_ulysses, ulysses_traffic
from minidist.bench import write_records

WAYS = [(algorithm, split) for algorithm in ALGORITHMS for split in ("contiguous", "zigzag")]


def relative_difference(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def measure(shape: tuple, repeats: int) -> dict:
    """Rank program: {(algorithm, split): this rank's counts, CPU seconds, bytes, error}, and the
    serial kernel's CPU seconds on the whole sequence ("serial")."""
    from minidist.core import functional as F
    from minidist.comm import get_world, set_wait_policy, traffic
    from minidist.parallel.context_parallel import AttentionStats, SequenceSplit, ring_attention
    from minidist.parallel.ulysses import ulysses_attention
    from minidist.runtime import tune_malloc
    from minidist.core.tensor import Tensor, default_dtype

    tune_malloc()
    set_wait_policy(spin=0.0)  # a waiting rank sleeps: its CPU seconds are its own work, not its waiting
    world = get_world()
    group = world.split(color=0, label="cp").verify("the benchmark's shape", list(shape))
    q, k, v, w = np.random.default_rng(0).normal(size=(4, *shape))  # the same numbers on every rank

    def timed(run_once):
        run_once()  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.process_time()
            result = run_once()
            seconds.append(time.process_time() - start)
        return result, min(seconds)

    out = {}
    with default_dtype("float64"):
        def serial():
            x = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
            y = F.scaled_dot_product_attention(*x, causal=True)
            (y * Tensor(w)).sum().backward()
            return y.data, [t.grad for t in x]

        (y_ref, grads_ref), out["serial"] = timed(serial)
        for algorithm, kind in WAYS:
            split = SequenceSplit(shape[2], group.size, kind)
            mine = split.positions(group.rank)
            stats = AttentionStats()

            def parallel():
                x = [Tensor(np.ascontiguousarray(a[:, :, mine]), requires_grad=True) for a in (q, k, v)]
                stats.reset()
                traffic.reset()
                if algorithm == "ring":
                    y = ring_attention(*x, group, split, stats=stats)
                else:
                    y = ulysses_attention(*x, group, split.order(), stats=stats)
                (y * Tensor(w[:, :, mine])).sum().backward()
                return y.data, [t.grad for t in x]

            (y, grads), seconds = timed(parallel)
            error = max(relative_difference(a, b[:, :, mine]) for a, b in zip([y, *grads], [y_ref, *grads_ref]))
            out[algorithm, kind] = {"unmasked": stats.unmasked, "scores": stats.scores, "cpu_seconds": seconds,
                                    "bytes_sent": traffic.snapshot()["total"]["bytes_sent"], "error": error}
    return out


def records_of(cp: int, ranks: list[dict], shape: tuple) -> list[dict]:
    b, h, t, d = shape
    serial = max(rank["serial"] for rank in ranks)  # the kernel on the whole sequence, on the slowest rank
    records = []
    for algorithm, kind in WAYS:
        per_rank = [rank[algorithm, kind] for rank in ranks]
        unmasked = [r["unmasked"] for r in per_rank]
        seconds = [r["cpu_seconds"] for r in per_rank]
        sent = [r["bytes_sent"] for r in per_rank]
        formula = (ring_attention_traffic if algorithm == "ring" else ulysses_traffic)(b, h, t, d, cp)["bytes"]
        records.append({
            "cp": cp, "algorithm": algorithm, "split": kind, "shape": list(shape),
            "unmasked_scores_per_rank": unmasked, "computed_scores_per_rank": [r["scores"] for r in per_rank],
            "score_balance": max(unmasked) / np.mean(unmasked),
            "cpu_seconds_per_rank": seconds, "cpu_balance": max(seconds) / float(np.mean(seconds)),
            "serial_seconds": serial, "slowest_over_serial": max(seconds) / serial,
            "bytes_sent_per_rank": sent, "formula_bytes": formula, "bytes_match": all(s == formula for s in sent),
            "max_relative_error": max(r["error"] for r in per_rank)})
    return records


def print_table(records) -> None:
    print(f"{'cp':>3s} {'algorithm':9s} {'split':10s} {'unmasked scores per rank':>30s} {'max/mean':>8s} "
          f"{'cpu ms per rank':>24s} {'max/mean':>8s} {'x serial':>8s} {'KB sent':>8s} {'formula':>8s} {'error':>8s}")
    for r in records:
        scores = " ".join(f"{u:,}" for u in r["unmasked_scores_per_rank"])
        cpu = " ".join(f"{s * 1e3:.1f}" for s in r["cpu_seconds_per_rank"])
        sent = max(r["bytes_sent_per_rank"]) / 1e3
        print(f"{r['cp']:3d} {r['algorithm']:9s} {r['split']:10s} {scores:>30s} {r['score_balance']:8.2f} "
              f"{cpu:>24s} {r['cpu_balance']:8.2f} {r['slowest_over_serial']:8.2f} {sent:8.1f} "
              f"{'= ' if r['bytes_match'] else '!= '}{r['formula_bytes'] / 1e3:.1f} {r['max_relative_error']:8.1e}")


def main(argv=None) -> int:
    positive = cli.integer(1)
    parser = cli.OneLineParser(prog="python -m minidist.bench context_parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=cli.listof(cli.integer(2)), default=[2, 4],
                        help="context-parallel degrees, one job of that many ranks each")
    parser.add_argument("--batch-size", type=positive, default=1)
    parser.add_argument("--n-head", type=positive, default=4)
    parser.add_argument("--seq-length", type=positive, default=1024)
    parser.add_argument("--head-dim", type=positive, default=16)
    parser.add_argument("--repeats", type=positive, default=3, help="timed runs of each way (the fastest counts)")
    parser.add_argument("--timeout", type=cli.number(0, lo_open=True), default=300.0, help="seconds per job")
    parser.add_argument("--json", type=cli.output_file, help="write the records as a JSON list")
    args = parser.parse_args(argv)
    for cp in args.cp:  # every way runs for every cp: both splits and both algorithms must fit
        try:
            check_sequence_split(args.seq_length, cp, "zigzag")
            check_ulysses(args.n_head, cp)
        except ValueError as error:
            parser.error(f"--cp {cp} with --seq-length {args.seq_length} --n-head {args.n_head}: {error}")

    shape = (args.batch_size, args.n_head, args.seq_length, args.head_dim)
    print(f"context parallelism: causal attention of (B, H, T, D) = {shape}, float64, forward + backward; "
          f"fastest of {args.repeats} runs, CPU seconds per rank")
    records = []
    for cp in args.cp:
        ranks = run(measure, cp, shape, args.repeats, timeout=args.timeout, echo=False)
        records += records_of(cp, ranks, shape)
    print_table(records)
    write_records(args.json, records)
    return 0
