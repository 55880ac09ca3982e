"""The alpha-beta cost model of communication (chapter 07).

One idea: sending a message of S bytes costs about  alpha + S * beta  seconds, where alpha
(latency, 延迟) is the fixed cost of any message, however small, and beta (the inverse of
bandwidth, 带宽) the cost of each byte. A collective is a sequence of steps; if in each step
every rank sends at most one message and they travel in parallel, its time is

    (number of steps) * alpha + (bytes along the slowest path) * beta + (bytes reduced) * gamma

where gamma is the cost of applying the op (adding) to one byte, which a CPU pays too.

    algorithm (all-reduce, N ranks, S bytes)   steps            bytes on the path     reduced
    naive (reduce to root, then send out)      2(N-1)           2(N-1) S              (N-1) S
    binomial tree (reduce + broadcast)         2 ceil(log2 N)   2 ceil(log2 N) S      ceil(log2 N) S
    recursive doubling                         log2 N (+2)      log2 N S (+2 S)       log2 N S (+S)
    halving-doubling (Rabenseifner)            2 log2 N (+2)    2(N-1)/N S (+2 S)     (N-1)/N S (+S)
    ring (reduce-scatter + all-gather)         2(N-1)           2(N-1)/N S            (N-1)/N S

(+2: the extra fold-in and hand-back steps when N is not a power of two.) Small messages are
ruled by alpha: fewest steps wins (recursive doubling, tree). Large messages are ruled by
beta: fewest bytes wins, and the ring's 2(N-1)/N S is the least any all-reduce can send per
rank (every rank must send out its S bytes' worth of contributions except the 1/N it keeps,
and receive everyone else's contributions to its 1/N; see chapter 07), so the ring is
*bandwidth-optimal* (带宽最优). `crossover` finds the size where one overtakes another.

`fit_alpha_beta` fits alpha and beta by least squares to measured point-to-point exchange
times (the benchmark measures them on this machine); `predict` then predicts every
algorithm, and the benchmark prints the prediction beside the measurement. `auto_algorithm`
is the message algorithm the model predicts fastest with constants fitted once (`AUTO_COST`):
what `all_reduce(algorithm="auto")` runs where no shared memory or hierarchy applies
(collectives.py).
"""
from __future__ import annotations

import functools
import math

import numpy as np


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def terms(collective: str, algorithm: str, n: int, nbytes: float) -> tuple[float, float, float]:
    """(steps, bytes on the critical path, bytes reduced on the critical path) of one call."""
    S, L = float(nbytes), _log2(n)
    if n <= 1:
        return 0.0, 0.0, 0.0
    if collective == "all_reduce":
        if algorithm == "naive":
            return 2 * (n - 1), 2 * (n - 1) * S, (n - 1) * S
        if algorithm == "tree":
            return 2 * L, 2 * L * S, L * S
        if algorithm == "recursive_doubling":
            p = 1 << (n.bit_length() - 1)
            k, extra = p.bit_length() - 1, 2 if p != n else 0
            return k + extra, (k + extra) * S, (k + (1 if extra else 0)) * S
        if algorithm == "halving_doubling":
            p = 1 << (n.bit_length() - 1)
            k, extra = p.bit_length() - 1, 2 if p != n else 0
            return 2 * k + extra, 2 * (p - 1) / p * S + extra * S, (p - 1) / p * S + (1 if extra else 0) * S
        if algorithm == "ring":
            return 2 * (n - 1), 2 * (n - 1) / n * S, (n - 1) / n * S
        if algorithm == "shared_memory":  # steps are handshakes on flags; bytes are read from others
            from minidist.comm.shared_memory import SMALL
            if S <= SMALL:
                return 1, (n - 1) * S, (n - 1) * S
            return 2, 2 * (n - 1) / n * S, (n - 1) / n * S
    if collective == "reduce_scatter" and algorithm == "ring":
        return n - 1, (n - 1) / n * S, (n - 1) / n * S
    if collective == "all_gather" and algorithm == "ring":
        return n - 1, (n - 1) / n * S, 0.0
    if collective == "broadcast" and algorithm == "tree":
        return L, L * S, 0.0
    if collective == "broadcast" and algorithm == "naive":
        return n - 1, (n - 1) * S, 0.0
    raise ValueError(f"no cost formula for {collective} {algorithm}")


def predict(collective: str, algorithm: str, n: int, nbytes: float, alpha: float, beta: float,
            gamma: float = 0.0) -> float:
    """Predicted seconds of one call."""
    steps, moved, reduced = terms(collective, algorithm, n, nbytes)
    return steps * alpha + moved * beta + reduced * gamma


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Least-squares fit of  t = alpha + S beta  to measured one-message times, with
    alpha, beta >= 0. Rows are weighted by 1/t, so small and large messages count alike
    (relative error). If noise makes the free fit negative, the better one-parameter fit
    (alpha only, or beta only) is kept."""
    S, t = np.asarray(nbytes, float), np.asarray(seconds, float)
    A = np.stack([np.ones_like(S), S], axis=1) / t[:, None]
    ones = np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(A, ones, rcond=None)
    if alpha >= 0 and beta >= 0:
        return float(alpha), float(beta)
    candidates = []
    for col in (0, 1):
        x = float(A[:, col] @ ones / (A[:, col] @ A[:, col]))
        params = (max(x, 0.0), 0.0) if col == 0 else (0.0, max(x, 0.0))
        candidates.append((float(np.sum((A @ np.array(params) - ones) ** 2)), params))
    return min(candidates)[1]


def crossover(collective: str, fast_for_large: str, other: str, n: int, alpha: float, beta: float,
              gamma: float = 0.0, lo: float = 1.0, hi: float = 2.0**34) -> float | None:
    """Smallest message size (bytes) from which `fast_for_large` is predicted to beat `other`
    (bisection on a log scale); None if it never does between lo and hi."""
    def gap(s):
        return predict(collective, fast_for_large, n, s, alpha, beta, gamma) - \
            predict(collective, other, n, s, alpha, beta, gamma)
    if gap(hi) >= 0:
        return None
    if gap(lo) < 0:
        return lo
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gap(mid) >= 0 else (lo, mid)
    return hi


# algorithm="auto" picks the all-reduce this model predicts fastest (collectives.py), with these
# constants, fitted by `python -m minidist.bench collectives` on a 2-core machine (chapter 07).
# Every rank computes the same choice from the same numbers.
AUTO_COST = dict(alpha=20e-6, beta=0.5e-9, gamma=0.1e-9)
AUTO_CANDIDATES = ("recursive_doubling", "halving_doubling", "ring")


@functools.lru_cache(maxsize=1024)  # a pure function of (nbytes, n): decide once, not per call
def auto_algorithm(nbytes: int, n: int) -> str:
    """The all-reduce algorithm="auto" uses for `nbytes` on `n` ranks, among the message
    algorithms: fewest steps for small arrays (recursive doubling), fewest bytes in fewest steps
    for large ones (halving-doubling when n is a power of two, else the ring)."""
    return min(AUTO_CANDIDATES, key=lambda a: predict("all_reduce", a, n, nbytes, **AUTO_COST))


def zero_bytes_sent(stage: int, n: int, units_numel: list[int], bytes_per_element: int = 4) -> float:
    """Bytes each rank sends per step under ZeRO stage 0-3 (chapter 8): (N-1)/N of what each ring moves.

    Stage 0 all-reduces the gradients and stages 1-2 reduce-scatter them and all-gather the
    weights: 2(N-1)/N x Ψ either way. Stage 3 all-gathers the weights in forward and the blocks
    (`units_numel[1:]`; the root unit, `units_numel[0]`, stays gathered) again in backward:
    (N-1)/N x (2Ψ + Ψ_blocks), about 1.5x."""
    full, blocks = sum(units_numel), sum(units_numel[1:])
    moved = 2 * full if stage < 3 else 2 * full + blocks
    return (n - 1) / n * moved * bytes_per_element


def tensor_parallel_traffic_per_step(config, batch: int, tp: int, itemsize: int = 4, seq: int | None = None,
                                     sequence_parallel: bool = False, *, one_machine: bool) -> dict:
    """All-reduces of one tensor-parallel training step and the bytes each rank sends for them,
    predicted (chapter 6, `parallel/tensor_parallel.py`).

    Activations of B·T·C elements: 2 per block forward (g after attention and MLP), 2 per block
    backward (f before them), the embedding's g and the head's f: 4L + 2. Small ones of B·T
    elements: the loss's max and its two sums (one message), the accuracy's argmax (max, then
    min of int64 ids); and one number for the gradient norm. Bytes per call are those of the
    algorithm all_reduce picks for that size (`terms` above). The caller says where the t ranks
    run, as MPI reports it (`Split_type(COMM_TYPE_SHARED)` on the ranks): one_machine=True, shared
    memory, which sends (t-1) x the array up to 64 KB and 2(t-1)/t of it above, like the ring;
    False, one rank per machine, the alpha-beta choice. (Several ranks on each of several
    machines: the hierarchical all-reduce, whose bytes differ from rank to rank.)

    sequence_parallel=True: each B·T·C all-reduce becomes one reduce-scatter and one all-gather
    (ring: (t-1)/t of the array each, together a ring all-reduce's bytes), and one all-reduce of
    the replicated parameters' partial gradients is added."""
    from minidist.plan.memory import tensor_parallel_parameter_counts

    seq = config.block_size if seq is None else seq
    n = batch * seq
    activations = (n * config.n_embd * itemsize, 4 * config.n_layer + 2, "activations (B·T·C)")
    calls = [(n * itemsize, 1, "loss: row max"), (2 * n * itemsize, 1, "loss: sum of exp and target logit"),
             (n * itemsize, 1, "accuracy: max"), (n * 8, 1, "accuracy: argmax id (int64)"),
             (8, 1, "gradient norm")]
    if sequence_parallel:
        grads = tensor_parallel_parameter_counts(config, tp)["replicated"] * itemsize
        calls.append((grads, 1, "sequence-parallel gradients (LayerNorms, row biases, wpe)"))
    else:
        calls.insert(0, activations)
    halves = activations[1] if sequence_parallel else 0  # reduce-scatters, and as many all-gathers
    if tp == 1:
        return {"all_reduces": 0, "reduce_scatters": 0, "all_gathers": 0, "bytes_sent": 0, "calls": calls}

    def chosen(nbytes):
        return "shared_memory" if one_machine else auto_algorithm(nbytes, tp)

    sent = sum(count * terms("all_reduce", chosen(nbytes), tp, nbytes)[1] for nbytes, count, _ in calls)
    sent += halves * sum(terms(kind, "ring", tp, activations[0])[1] for kind in ("reduce_scatter", "all_gather"))
    return {"all_reduces": sum(c for _, c, _ in calls), "reduce_scatters": halves, "all_gathers": halves,
            "bytes_sent": int(round(sent)), "calls": calls}


# -- two levels: inside a machine and between machines (chapter 07, "Topology") ---------------
#
# On several machines a message costs alpha_inside + S beta_inside between two ranks of one
# machine (shared memory) and alpha_between + S beta_between between machines (the network),
# with beta_between many times beta_inside. `per_node` ranks on each of `nodes` machines,
# N = per_node x nodes, ranks numbered machine by machine.
#
#   flat ring      2(N-1) steps, each waiting for its one message that crosses machines:
#                  2(N-1) alpha_between + 2(N-1)/N S beta_between
#   hierarchical   tree reduce and tree broadcast inside, ring among the leaders between:
#                  2 ceil(log2 p) (alpha_inside + S beta_inside)
#                  + 2(L-1) alpha_between + 2(L-1)/L S beta_between
#
# For large S the hierarchical one wins when its saving between machines, (2(N-1)/N - 2(L-1)/L)
# S beta_between, exceeds what it adds inside, 2 ceil(log2 p) S beta_inside: on 2 machines of 2
# ranks, when beta_between > 4 beta_inside.

def two_level_terms(algorithm: str, per_node: int, nodes: int, nbytes: float):
    """((steps, bytes) inside machines, (steps, bytes) between machines, bytes reduced) on the
    critical path of one all-reduce: "ring" (flat, over all N ranks) or "hierarchical"."""
    S, p, L = float(nbytes), per_node, nodes
    n = p * L
    if algorithm == "ring":
        level = (2 * (n - 1), 2 * (n - 1) / n * S) if n > 1 else (0, 0.0)
        inside, between = (level, (0, 0.0)) if L == 1 else ((0, 0.0), level)
        return inside, between, (n - 1) / n * S
    if algorithm == "hierarchical":
        tree = 2 * _log2(p)
        between = (2 * (L - 1), 2 * (L - 1) / L * S)
        return (tree, tree * S), between, _log2(p) * S + (L - 1) / L * S
    raise ValueError(f"no two-level cost formula for all_reduce {algorithm!r}; 'ring' or 'hierarchical'")


def predict_two_level(algorithm: str, per_node: int, nodes: int, nbytes: float, alpha_inside: float,
                      beta_inside: float, alpha_between: float, beta_between: float, gamma: float = 0.0) -> float:
    """Predicted seconds of one all-reduce of `nbytes` on `nodes` machines of `per_node` ranks."""
    (k_in, b_in), (k_out, b_out), reduced = two_level_terms(algorithm, per_node, nodes, nbytes)
    return k_in * alpha_inside + b_in * beta_inside + k_out * alpha_between + b_out * beta_between + reduced * gamma


def bytes_between_nodes(algorithm: str, per_node: int, nodes: int, nbytes: float) -> float:
    """Bytes one all-reduce sends from machine to machine, all links together: the flat ring's
    `nodes` links that cross machines each carry 2(N-1)/N S; the hierarchical all-reduce's
    `nodes` leaders each send 2(L-1)/L S."""
    n, L, S = per_node * nodes, nodes, float(nbytes)
    if L == 1:
        return 0.0
    if algorithm == "ring":
        return L * 2 * (n - 1) / n * S
    if algorithm == "hierarchical":
        return L * 2 * (L - 1) / L * S
    raise ValueError(f"no formula for the bytes between machines of all_reduce {algorithm!r}")
