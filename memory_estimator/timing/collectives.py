"""Alpha-beta cost of collectives, per algorithm: pure functions of size, ranks and link.

A message of m bytes over one link costs ``alpha + m * beta`` (Hockney's model):
alpha the latency of one step, beta the seconds per byte (1 / bandwidth of one
rank's link, one direction). Each function returns the seconds one collective
over a *full* buffer of ``nbytes`` takes on ``n`` ranks when every step waits for
the slowest link (the algorithms are bulk synchronous).

=========================  ============================  ===========================
all-reduce algorithm       latency term                  bandwidth term
=========================  ============================  ===========================
ring                       2(n-1) alpha                  2(n-1)/n S beta
halving-doubling           2 log2(p) alpha (+2 alpha)    2(p-1)/p S beta (+2 S beta)
reduce-then-broadcast      2 ceil(log2 n) alpha          2 ceil(log2 n) S beta
parameter server           2(n-1) alpha                  2(n-1) S beta
=========================  ============================  ===========================

p is the largest power of two <= n; when p < n the extra ranks first hand their
whole buffer to a partner and get the result back (Rabenseifner's fold), the terms
in brackets. Ring and halving-doubling send the same bytes; halving-doubling takes
log2 n steps instead of n-1, so it wins where latency dominates (small buffers,
many ranks) and the ring where bandwidth does (it needs no power of two, and its
neighbours are fixed, which suits topology-aware rings). The parameter server's
rank 0 receives and sends every worker's full buffer: its link carries 2(n-1) S,
O(n), the bottleneck as workers grow (``benchmarks/bench_algorithms.py`` measures it).

>>> round(ring_all_reduce(2**20, 4, alpha=1e-5, beta=1e-9) * 1e6, 1)   # µs
1632.9
>>> halving_doubling_all_reduce(2**20, 4, 1e-5, 1e-9) < ring_all_reduce(2**20, 4, 1e-5, 1e-9)
True
"""
from __future__ import annotations

import math

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
ALGORITHMS = ("ring", "halving_doubling", "auto")


def _check(nbytes: float, n: int, alpha: float, beta: float) -> None:
    if n < 1 or nbytes < 0 or alpha < 0 or beta < 0:
        raise ValueError(f"need n >= 1 and non-negative bytes, alpha, beta; got n={n}, "
                         f"bytes={nbytes}, alpha={alpha}, beta={beta}")


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def ring_all_reduce(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Reduce-scatter then all-gather around a ring: 2(n-1) steps of S/n each."""
    _check(nbytes, n, alpha, beta)
    return 0.0 if n == 1 else 2 * (n - 1) * (alpha + nbytes / n * beta)


def halving_doubling_all_reduce(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Recursive halving (reduce-scatter) then doubling (all-gather); non-powers of two fold first."""
    _check(nbytes, n, alpha, beta)
    if n == 1:
        return 0.0
    p = _pow2_floor(n)
    core = 2 * math.log2(p) * alpha + 2 * (p - 1) / p * nbytes * beta
    return core if p == n else core + 2 * (alpha + nbytes * beta)


def reduce_broadcast_all_reduce(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast; whole buffers per step."""
    _check(nbytes, n, alpha, beta)
    return 2 * math.ceil(math.log2(n)) * (alpha + nbytes * beta) if n > 1 else 0.0


def parameter_server_all_reduce(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Every worker sends its buffer to rank 0, which sends the sum back to each: rank 0's
    link carries 2(n-1) S, one message after another."""
    _check(nbytes, n, alpha, beta)
    return 2 * (n - 1) * (alpha + nbytes * beta)


def ring_reduce_scatter(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """n-1 steps of S/n (S = the full input); an all-gather (S = the full output) is the mirror."""
    _check(nbytes, n, alpha, beta)
    return (n - 1) * (alpha + nbytes / n * beta)


def halving_reduce_scatter(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """log2 n steps of S/2, S/4, ...; powers of two only (else the ring)."""
    _check(nbytes, n, alpha, beta)
    if n & (n - 1):
        return ring_reduce_scatter(nbytes, n, alpha, beta)
    return math.log2(n) * alpha + (n - 1) / n * nbytes * beta


def broadcast_chunks(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """An all-gather as one binomial-tree broadcast per rank's chunk of S/n, issued together
    (Gloo's in-place all-gather): n ceil(log2 n) latencies, each rank sends its (n-1)/n S."""
    _check(nbytes, n, alpha, beta)
    return n * math.ceil(math.log2(n)) * alpha + (n - 1) / n * nbytes * beta if n > 1 else 0.0


def pairwise_all_to_all(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """n-1 rounds, each rank sending S/n (S = its full input) to one other rank: the bytes of a
    ring reduce-scatter, the shape of compressed reductions (shardengine/distributed/compression/collectives.py)."""
    _check(nbytes, n, alpha, beta)
    return (n - 1) * (alpha + nbytes / n * beta)


_ALL_REDUCE = {"ring": ring_all_reduce, "halving_doubling": halving_doubling_all_reduce}
_SCATTER_GATHER = {"ring": ring_reduce_scatter, "halving_doubling": halving_reduce_scatter}


def collective_seconds(kind: str, nbytes: float, n: int, alpha: float, beta: float,
                       algorithm: str = "auto") -> float:
    """Seconds of one collective of ``kind`` over a full buffer of ``nbytes`` on ``n`` ranks.

    ``algorithm="auto"`` takes the faster of the ring and halving-doubling, as NCCL's
    and Gloo's tuners pick tree-like algorithms for small buffers and rings for large
    ones. ``broadcast`` is the per-chunk broadcast form of an all-gather.

    >>> collective_seconds("all_reduce", 0, 8, 1e-5, 1e-9, "ring") > collective_seconds("all_reduce", 0, 8, 1e-5, 1e-9)
    True
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {KINDS}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; one of {ALGORITHMS}")
    if kind == "broadcast":
        return broadcast_chunks(nbytes, n, alpha, beta)
    if kind == "all_to_all":
        return pairwise_all_to_all(nbytes, n, alpha, beta)
    table = _ALL_REDUCE if kind == "all_reduce" else _SCATTER_GATHER
    if algorithm != "auto":
        return table[algorithm](nbytes, n, alpha, beta)
    return min(fn(nbytes, n, alpha, beta) for fn in table.values())


def latency_steps(kind: str, n: int) -> int:
    """Message steps of the ring form of ``kind`` (what a fit of alpha counts)."""
    if n == 1:
        return 0
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "broadcast":
        return n * math.ceil(math.log2(n))
    return n - 1
