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
algorithm, and the benchmark prints the prediction beside the measurement.
"""
from __future__ import annotations

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
