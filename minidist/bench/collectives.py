"""Benchmark: hand-written collectives against MPI's own, and the alpha-beta fit (chapter 07).

    mpirun -n 4 python -m minidist.bench collectives [--json PATH] [--quick] [--sizes 1K,64K,1M]
    mpirun -n 4 python -m minidist.bench collectives --wait-demo
    mpirun -n 2 python -m minidist.bench collectives --tune tuning.json [--sizes ...]

For every size and algorithm it prints the time per call, the bus bandwidth, MPI's own
Allreduce / Reduce_scatter / Allgather measured in the same run, the ratio (ours / MPI, lower
is better) and the alpha-beta prediction. Timing: every rank runs `reps` calls back to back;
a call's time is the slowest rank's mean; ours and MPI's alternate for `rounds` rounds and the
best round of each is kept (these machines are noisy and shared). The all-reduce algorithms of
one size take their turns together (`compare_many`: each of them, then MPI's, round after round),
so that they can be compared with each other as well as with MPI.

Fair comparison: both run in the same processes, on the same float32 buffers, after a warm-up,
with the mismatch check off (MPI does not check either) and with the malloc tuning of
minidist.runtime (MPICH allocates temporaries on every large call; without the tuning each
costs page faults that have nothing to do with either algorithm).

Bus bandwidth follows nccl-tests: algbw = S / t, busbw = algbw x 2(N-1)/N for all-reduce,
x (N-1)/N for reduce-scatter and all-gather (S = the full array), so a bandwidth-optimal
algorithm's busbw is the link's bandwidth whatever N is.

`--tune PATH` times every all-reduce algorithm at each size (the default sizes, or --sizes),
prints each one's time against MPI's, and writes the fastest per size to the tuning table at PATH
(minidist/comm/tuning.py; a table per number of ranks and machines, the others in the file kept).
On one machine it first times the shared-memory all-reduce's piece size (`tune_piece`) and keeps
the fastest in the table too.
With `MINIDIST_TUNING=PATH` in the environment, `all_reduce(algorithm="auto")` then takes the
measured choice.

On several machines (chapter 07, topology), e.g. two made-up ones over TCP on this machine:

    MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=lo \
        mpiexec -launcher fork -hosts a,b -ppn 2 -n 4 python -m minidist.bench collectives --quick

it also times exchanges between two ranks of one machine and between machines, fits alpha and
beta of both levels (keys alpha_inside, beta_inside, alpha_between, beta_between), adds the
hierarchical all-reduce to the algorithms, and predicts the flat ring and the hierarchical
all-reduce with the two-level model (key predicted_two_level_seconds).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

import minidist.comm as dist
from minidist import cli
from minidist.comm import cost, faults, traffic, tuning
from minidist.comm.algorithms import chunk_bounds
from minidist.runtime import limit_threads_per_rank, tune_malloc
from minidist.bench import write_records

DEFAULT_SIZES = ["1K", "4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M"]
QUICK_SIZES = ["1K", "16K", "64K", "1M", "16M"]
ALL_REDUCE_ALGOS = ["naive", "tree", "recursive_doubling", "halving_doubling", "ring", "auto"]
ALGORITHM_NAMES = [*ALL_REDUCE_ALGOS, "shared_memory", "hierarchical"]
ALGORITHM_NAMES += [name + "+spin" for name in ALGORITHM_NAMES]
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
       "all_gather": lambda n: (n - 1) / n}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def size_flag(text: str) -> int:
    """--sizes: one size, whole float32 elements (a multiple of 4 bytes), at most 1G."""
    try:
        nbytes = parse_size(text)
    except (ValueError, KeyError, IndexError):
        nbytes = -1
    if not (4 <= nbytes <= 1 << 30 and nbytes % 4 == 0):
        raise argparse.ArgumentTypeError(f"expected a size in bytes (a multiple of 4 from 4 to 1G, e.g. 64K), "
                                         f"got {text!r}")
    return nbytes


def human(nbytes: float) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g}{unit}"
    return f"{nbytes:g}"


def timed(fn, reps: int, comm) -> float:
    """Seconds per call of the slowest rank, `reps` calls back to back."""
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    mine = np.array([(time.perf_counter() - t) / reps])
    slowest = np.empty(1)
    comm.Allreduce(mine, slowest, op=MPI.MAX)
    return float(slowest[0])


def reps_for(fn, comm, budget: float, most: int = 2000) -> int:
    """How many calls of `fn` back to back fill about `budget` seconds, after a warm-up call
    (buffers touched, communicators made); rank 0's count, so that every rank makes as many."""
    fn()
    once = np.array([timed(fn, 1, comm)])
    comm.Bcast(once, root=0)
    return int(max(1, min(most, budget / max(once[0], 1e-7))))


def compare(ours, theirs, comm, budget: float, rounds: int) -> tuple[float, float]:
    """(our seconds, MPI's seconds) per call: alternate rounds, keep each one's best
    (`compare_many` with one call of ours)."""
    best, best_mpi = compare_many({"ours": ours}, theirs, comm, budget, rounds)
    return best["ours"], best_mpi


def compare_many(calls: dict, theirs, comm, budget: float, rounds: int, policies: dict | None = None):
    """({name: our seconds}, MPI's seconds) per call, for several of ours side by side: in every
    round each of ours and then MPI's in turn, each one's best kept, so that algorithms compared
    with each other met the same minutes of a noisy machine (timed one after another, a busy
    minute could fall on one and spare the next). `policies`: the wait policy each call runs under
    (`dist.set_wait_policy` keywords; the polite wait otherwise)."""
    policies = policies or {}
    reps = {}
    for name, fn in calls.items():
        with dist.waiting_as(**policies.get(name, {"polite": True})):
            reps[name] = reps_for(fn, comm, budget)
    mpi_reps = reps_for(theirs, comm, budget)
    best, best_mpi = dict.fromkeys(calls, float("inf")), float("inf")
    for _ in range(rounds):
        for name, fn in calls.items():
            with dist.waiting_as(**policies.get(name, {"polite": True})):
                best[name] = min(best[name], timed(fn, reps[name], comm))
            best_mpi = min(best_mpi, timed(theirs, mpi_reps, comm))
    return best, best_mpi


def sent_per_call(call, comm) -> float:
    """The most bytes any rank sends in one call (from minidist's traffic counters)."""
    traffic.reset()
    call()
    mine = np.array([float(traffic.snapshot()["total"]["bytes_sent"])])
    most = np.empty(1)
    comm.Allreduce(mine, most, op=MPI.MAX)
    return float(most[0])


def fit_link(comm, sizes, budget, rounds, peer=None, algorithm="pairwise"):
    """Time one exchange (sendrecv) between rank pairs (0,1), (2,3), ... (or with `peer`) and
    fit alpha, beta."""
    n, r = comm.size, comm.rank
    if peer is None:
        peer = r ^ 1 if (r ^ 1) < n else r  # an odd rank out exchanges with itself
    records = []
    for nbytes in sizes:
        a, b = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        ours = lambda: dist.sendrecv(a, peer, b, peer, tag=1)  # noqa: E731
        mpi = lambda: comm.Sendrecv(a, peer, 1, b, peer, 1)  # noqa: E731
        t, t_mpi = compare(ours, mpi, comm, budget, rounds)
        records.append(dict(collective="sendrecv", algorithm=algorithm, world_size=n, bytes=nbytes,
                            seconds=t, mpi_seconds=t_mpi, bytes_sent_per_rank=float(nbytes)))
    alpha, beta = cost.fit_alpha_beta([x["bytes"] for x in records], [x["seconds"] for x in records])
    x = np.ones(1 << 22, np.float32)
    t = time.perf_counter()
    for _ in range(5):
        np.add(x, x, out=x)
    gamma = (time.perf_counter() - t) / 5 / x.nbytes
    return records, alpha, beta, gamma


def node_layout(comm) -> list[list[int]]:
    """[[ranks of machine 0], [ranks of machine 1], ...] as MPI sees the machines (the ranks
    that share memory, `Split_type`), machines in the order of their lowest rank."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    first = node.allreduce(comm.rank, op=MPI.MIN)
    node.Free()
    machines = {}
    for rank, lowest in enumerate(comm.allgather(first)):
        machines.setdefault(lowest, []).append(rank)
    return [machines[lowest] for lowest in sorted(machines)]


def level_peers(layout, rank) -> tuple[int, int]:
    """(peer on my machine, peer on the next machine): the i-th rank of machine j exchanges
    with the (i XOR 1)-th of machine j, and with the i-th of machine j XOR 1; with itself
    where there is none."""
    j = next(k for k, ranks in enumerate(layout) if rank in ranks)
    mine, i = layout[j], layout[j].index(rank)
    other = layout[j ^ 1] if (j ^ 1) < len(layout) else []
    return (mine[i ^ 1] if (i ^ 1) < len(mine) else rank), (other[i] if i < len(other) else rank)


def fit_two_levels(comm, layout, sizes, budget, rounds):
    """Exchanges inside a machine and between machines, and alpha, beta fitted to each."""
    inside, between = level_peers(layout, comm.rank)
    records_in, alpha_in, beta_in, _ = fit_link(comm, sizes, budget, rounds, inside, "inside_node")
    records_out, alpha_out, beta_out, _ = fit_link(comm, sizes, budget, rounds, between, "between_nodes")
    fit = dict(alpha_inside=alpha_in, beta_inside=beta_in, alpha_between=alpha_out, beta_between=beta_out)
    for x in records_in:
        x.update(ratio=x["seconds"] / x["mpi_seconds"], predicted_seconds=alpha_in + x["bytes"] * beta_in)
    for x in records_out:
        x.update(ratio=x["seconds"] / x["mpi_seconds"], predicted_seconds=alpha_out + x["bytes"] * beta_out)
    return records_in + records_out, fit


TWO_LEVEL = ("ring", "hierarchical")  # the all-reduces cost.predict_two_level knows


def auto_against_fastest(records) -> list[dict]:
    """Mark each `auto` all-reduce record with minidist's fastest other algorithm of its size in the
    same run (`fastest_algorithm`) and auto's time over that one's (`of_fastest`): a choice
    should lose little to the best it could have made. Returns the marked records (none where
    auto or nothing to set it against was timed)."""
    marked = []
    for x in records:
        if x["collective"] != "all_reduce" or x["algorithm"] != "auto":
            continue
        others = [y for y in records if y["collective"] == "all_reduce" and y["bytes"] == x["bytes"]
                  and not y["algorithm"].startswith("auto")]
        if others:
            fastest = min(others, key=lambda y: y["seconds"])
            x.update(fastest_algorithm=fastest["algorithm"], of_fastest=x["seconds"] / fastest["seconds"])
            marked.append(x)
    return marked


def two_level_prediction(algorithm, layout, nbytes, fit) -> float:
    """The two-level model's seconds for `algorithm` on `layout`; on one machine the inside
    level is the pairwise fit."""
    per_node = max(len(ranks) for ranks in layout)  # the largest machine sets the tree's depth
    inside = fit.get("alpha_inside", fit["alpha"]), fit.get("beta_inside", fit["beta"])
    between = fit.get("alpha_between", fit["alpha"]), fit.get("beta_between", fit["beta"])
    return cost.predict_two_level(algorithm, per_node, len(layout), nbytes, *inside, *between, fit["gamma"])


def bench_size(comm, nbytes, budget, rounds, algorithms):
    n, r = comm.size, comm.rank
    count = nbytes // 4
    rng = np.random.default_rng(r)
    x = rng.standard_normal(count).astype(np.float32)
    work, mpi_out = x.copy(), np.empty_like(x)
    bounds = chunk_bounds(count, n)
    counts = [b - a for a, b in bounds]
    a, b = bounds[r]
    chunk, mpi_chunk = np.empty(b - a, np.float32), np.empty(b - a, np.float32)
    gathered = np.empty(count, np.float32)
    mpi_allreduce = lambda: comm.Allreduce(x, mpi_out, op=MPI.SUM)  # noqa: E731
    out = []
    # every all-reduce algorithm side by side, round by round ('+spin': MPI's spinning wait)
    calls = {algo: (lambda name=algo.replace("+spin", ""): dist.all_reduce(work, algorithm=name))
             for algo in algorithms}
    policies = {algo: {"polite": False} for algo in algorithms if algo.endswith("+spin")}
    seconds, t_mpi = compare_many(calls, mpi_allreduce, comm, budget, rounds, policies)
    for algo, ours in calls.items():
        with dist.waiting_as(**policies.get(algo, {"polite": True})):
            out.append(("all_reduce", algo, (seconds[algo], t_mpi), sent_per_call(ours, comm)))
    ours = lambda: dist.reduce_scatter(x, out=chunk)  # noqa: E731
    mpi = lambda: comm.Reduce_scatter(x, mpi_chunk, counts, op=MPI.SUM)  # noqa: E731
    out.append(("reduce_scatter", "ring", compare(ours, mpi, comm, budget, rounds), sent_per_call(ours, comm)))
    displs = [a for a, _ in bounds]
    ours = lambda: dist.all_gather(x[a:b], out=gathered)  # noqa: E731
    mpi = lambda: comm.Allgatherv(x[a:b], [mpi_out, counts, displs, MPI.FLOAT])  # noqa: E731
    out.append(("all_gather", "ring", compare(ours, mpi, comm, budget, rounds), sent_per_call(ours, comm)))
    return out


def tune(comm, sizes, budget, rounds, machines: int) -> list[dict]:
    """Every all-reduce algorithm timed at each size (with MPI's beside it): a row per size
    with each one's seconds and the fastest, as the tuning table keeps them (tuning.py)."""
    from minidist.comm import shared_memory
    from minidist.comm.collectives import ALL_REDUCE

    world = dist.get_world()
    candidates = [name for name in ALL_REDUCE
                  if (name != "shared_memory" or shared_memory.window_or_none(world) is not None)
                  and (name != "hierarchical" or machines > 1)]
    rows = []
    for nbytes in sizes:
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        work, mpi_out = x.copy(), np.empty_like(x)
        calls = {name: (lambda name=name: dist.all_reduce(work, algorithm=name)) for name in candidates}
        seconds, t_mpi = compare_many(calls, lambda: comm.Allreduce(x, mpi_out, op=MPI.SUM),  # noqa: B023
                                      comm, budget, rounds)
        rows.append({"bytes": nbytes, "algorithm": min(seconds, key=seconds.get), "seconds": seconds,
                     "mpi_seconds": t_mpi})
    return rows


PIECE_FACTORS = (0.5, 1, 2, 4, 8, 16)  # --tune times the built-in piece (128 KB x N^2) times each
PIECE_SIZES = (1 << 20, 4 << 20, 16 << 20)  # on arrays of these sizes


def tune_piece(comm, budget, rounds) -> tuple[int | None, dict]:
    """(the fastest piece, {piece: {array bytes: seconds}}) of the shared-memory all-reduce, pieces
    from half to 16 times the built-in one, rounds alternating between them (the best of each kept);
    fastest = least summed time relative to the best piece at each size. (None, {}) where the
    ranks do not share one machine. The window keeps the chosen piece for what follows."""
    from minidist.comm import shared_memory

    shared = shared_memory.window_or_none(dist.get_world())
    if shared is None:
        return None, {}
    built_in = shared_memory.PIECE_PER_RANK_SQUARED * comm.size ** 2
    pieces = sorted({max(shared_memory.SMALL, int(built_in * f)) // 64 * 64 for f in PIECE_FACTORS})
    arrays = [np.random.default_rng(comm.rank).standard_normal(n // 4).astype(np.float32) for n in PIECE_SIZES]
    seconds = {p: {x.nbytes: float("inf") for x in arrays} for p in pieces}
    for _ in range(rounds):
        for p in pieces:
            shared.set_piece(p)
            for x in arrays:
                call = lambda: dist.all_reduce(x, algorithm="shared_memory")  # noqa: E731, B023
                reps = reps_for(call, comm, budget, most=200)  # its warm-up grows the window to this piece
                seconds[p][x.nbytes] = min(seconds[p][x.nbytes], timed(call, reps, comm))
    best_at = {x.nbytes: min(seconds[p][x.nbytes] for p in pieces) for x in arrays}
    best = min(pieces, key=lambda p: sum(seconds[p][n] / best_at[n] for n in best_at))
    shared.set_piece(best)
    return best, seconds


def print_tuning(rows, n: int, path: str, piece=None, piece_seconds=None) -> None:
    if piece:
        sizes = list(next(iter(piece_seconds.values())))
        print(f"shared-memory piece on {n} ranks: us per all-reduce of " + ", ".join(map(human, sizes)))
        for p, times in piece_seconds.items():
            print(f"{human(p):>6s} " + " ".join(f"{times[size] * 1e6:10.1f}" for size in sizes)
                  + ("   <- chosen" if p == piece else ""))
    names = list(rows[0]["seconds"])
    print(f"all-reduce on {n} ranks: us per call, and the ratio of the fastest to MPI's")
    print(f"{'bytes':>6s} " + " ".join(f"{name[:12]:>12s}" for name in names) + f" {'MPI':>9s}  fastest (ratio)")
    for row in rows:
        best = row["seconds"][row["algorithm"]]
        print(f"{human(row['bytes']):>6s} " + " ".join(f"{row['seconds'][name] * 1e6:12.1f}" for name in names)
              + f" {row['mpi_seconds'] * 1e6:9.1f}  {row['algorithm']} ({best / row['mpi_seconds']:.2f}x)")
    print(f"wrote the table for {n} ranks to {path}; `export MINIDIST_TUNING={os.path.abspath(path)}` "
          "makes algorithm='auto' use it")


def wait_demo(comm):
    """Rank 0 computes while the others wait for its message: how long does its compute take?"""
    r = comm.rank
    token = np.zeros(1)

    def compute():
        a = np.random.default_rng(0).random((300, 300))
        t = time.perf_counter()
        for _ in range(150):
            a = np.tanh(a @ a / 300.0)
        return time.perf_counter() - t

    rows = []
    for label, how in [("peers asleep (time.sleep)", "sleep"), ("MPI's blocking Recv (spins)", "mpi"),
                       ("minidist polite wait", "polite")]:
        best = float("inf")
        for _ in range(3):
            comm.Barrier()
            if r == 0:
                best = min(best, compute())
                for k in range(1, comm.size):
                    comm.Send(token, k)
            elif how == "sleep":
                time.sleep(2.0)  # longer than rank 0's compute: nobody competes for a core
                comm.Recv(token, 0)
            elif how == "mpi":
                comm.Recv(token, 0)
            else:
                dist.recv(token, 0)
        rows.append((label, best))
    if r == 0:
        print(f"wait demo, {comm.size} ranks on this machine: rank 0's compute time while the others wait")
        for label, t in rows:
            print(f"  {label:32s} {t * 1e3:8.0f} ms")
    return rows


def main(argv=None):
    faults.install()
    parser = cli.OneLineParser(prog="python -m minidist.bench collectives", description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=cli.output_file, help="write the records to this file (rank 0)")
    parser.add_argument("--sizes", type=cli.listof(size_flag),
                        help="comma-separated sizes in bytes, multiples of 4 up to 1G, e.g. 1K,64K,1M")
    parser.add_argument("--quick", action="store_true", help=f"sizes {','.join(QUICK_SIZES)}, shorter timing")
    parser.add_argument("--algorithms", type=cli.listof(cli.one_of(ALGORITHM_NAMES)), default=None,
                        help="all-reduce algorithms (default: " + ",".join(ALL_REDUCE_ALGOS + ["auto+spin"]) +
                        ", and hierarchical on several machines); '+spin' = with MPI's spinning wait instead of "
                        "the polite one")
    parser.add_argument("--budget", type=cli.number(0, 60, lo_open=True), default=None, help="seconds per timing round")
    parser.add_argument("--rounds", type=cli.integer(1), default=3)
    parser.add_argument("--no-malloc-tuning", action="store_true")
    parser.add_argument("--wait-demo", action="store_true", help="only measure the polite wait's effect")
    parser.add_argument("--tune", type=cli.output_file, metavar="PATH",
                        help="time every all-reduce algorithm per size and write the fastest to this tuning table")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    limit_threads_per_rank(comm)  # ranks share the machine's cores (chapter 2)
    if args.wait_demo:
        wait_demo(comm)
        return 0
    tuned = False if args.no_malloc_tuning else tune_malloc()
    dist.set_check(False)  # MPI's collectives do not check either
    sizes = args.sizes or [parse_size(s) for s in (QUICK_SIZES if args.quick else DEFAULT_SIZES)]
    budget = args.budget or (0.02 if args.quick else 0.05)
    layout = node_layout(comm)
    machines = len(layout) > 1
    np.seterr(over="ignore", invalid="ignore")  # repeated in-place sums grow to inf: harmless here
    if args.tune:
        piece, piece_seconds = tune_piece(comm, budget, args.rounds)
        rows = tune(comm, sizes, budget, args.rounds, len(layout))
        if comm.rank == 0:
            tuning.write(args.tune, n_ranks := comm.size, len(layout), rows,
                         MPI.Get_library_version().splitlines()[0].strip(), piece,
                         {str(p): {str(n): t for n, t in times.items()} for p, times in piece_seconds.items()})
            print_tuning(rows, n_ranks, args.tune, piece, piece_seconds)
        return 0
    default = ALL_REDUCE_ALGOS + ["auto+spin"] + ["hierarchical"] * machines
    algorithms = args.algorithms or default
    n = comm.size
    link, alpha, beta, gamma = fit_link(comm, sizes, budget, args.rounds)
    records = list(link)
    fit = dict(alpha=alpha, beta=beta, gamma=gamma)
    if machines:
        level_records, levels = fit_two_levels(comm, layout, sizes, budget, args.rounds)
        records += level_records
        fit.update(levels)  # every record carries both levels' fit too
    for nbytes in sizes:
        for coll, algo, (t, t_mpi), sent in bench_size(comm, nbytes, budget, args.rounds, algorithms):
            name = algo.replace("+spin", "")
            chosen = dist.choose_all_reduce(name, dist.get_world(), nbytes) if coll == "all_reduce" and n > 1 else name
            algbw = nbytes / t if t > 0 else 0.0
            two_level = two_level_prediction(chosen, layout, nbytes, fit) if chosen in TWO_LEVEL else None
            pred = two_level if chosen == "hierarchical" else cost.predict(coll, chosen, n, nbytes, alpha, beta, gamma)
            records.append(dict(collective=coll, algorithm=algo, world_size=n, bytes=nbytes, seconds=t,
                                mpi_seconds=t_mpi, ratio=t / t_mpi, predicted_seconds=pred, algbw=algbw,
                                busbw=algbw * BUS[coll](n) if n > 1 else 0.0, bytes_sent_per_rank=sent,
                                malloc_tuned=tuned, **fit))
            if machines and two_level is not None:
                records[-1]["predicted_two_level_seconds"] = two_level
    chosen_against_fastest = auto_against_fastest(records)
    for x in link:
        x.update(ratio=x["seconds"] / x["mpi_seconds"], predicted_seconds=alpha + x["bytes"] * beta)
    for x in records:
        if x["collective"] == "sendrecv":
            x.update(**fit)
    if comm.rank == 0:
        print(f"minidist collectives vs MPI ({MPI.Get_library_version().splitlines()[0].strip()}), "
              f"{n} ranks, float32, malloc tuning {'on' if tuned else 'off'}; ratio = ours / MPI (lower is better)")
        print(f"alpha-beta fit on sendrecv: alpha = {alpha * 1e6:.1f} us, beta = {beta * 1e9:.3f} ns/B "
              f"({1 / beta / 1e9 if beta else float('inf'):.2f} GB/s), gamma (add) = {gamma * 1e9:.3f} ns/B")
        if machines:
            print(f"{len(layout)} machines of {'+'.join(str(len(m)) for m in layout)} ranks; two-level fit: "
                  + ", ".join(f"{where} alpha = {fit['alpha_' + where] * 1e6:.1f} us, "
                              f"1/beta = {1 / max(fit['beta_' + where], 1e-30) / 1e9:.2f} GB/s"
                              for where in ("inside", "between")))
        print(f"{'collective':15s} {'algorithm':19s} {'bytes':>6s} {'ours us':>10s} {'MPI us':>10s} {'ratio':>6s} "
              f"{'busbw GB/s':>10s} {'model us':>10s} {'sent/rank':>10s}")
        for x in records:
            print(f"{x['collective']:15s} {x['algorithm']:19s} {human(x['bytes']):>6s} {x['seconds'] * 1e6:10.1f} "
                  f"{x['mpi_seconds'] * 1e6:10.1f} {x['seconds'] / x['mpi_seconds']:6.2f} "
                  f"{x.get('busbw', 0) / 1e9:10.3f} {x.get('predicted_seconds', x['seconds']) * 1e6:10.1f} "
                  f"{human(x['bytes_sent_per_rank']):>10s}")
        if chosen_against_fastest:
            print("auto against minidist's fastest algorithm of the same size in this run: "
                  + ", ".join(f"{human(x['bytes'])} {x['of_fastest']:.2f}x ({x['fastest_algorithm']})"
                              for x in chosen_against_fastest))
        write_records(args.json, records)
    return 0
