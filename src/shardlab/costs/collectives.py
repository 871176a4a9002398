"""The benchmarked collectives and nccl-tests' bus-bandwidth conventions.

nccl-tests reports, for a message of `size` bytes taking `t` seconds, the algorithm bandwidth
`algbw = size / t` and the bus bandwidth `busbw = algbw * factor(n)`: the rate each rank's link
actually carries with ring algorithms, comparable across collectives and rank counts. Its
`size` is the whole buffer: the all-reduce buffer, the all-gather OUTPUT, the reduce-scatter
INPUT, the all-to-all buffer of one rank, the broadcast buffer, the send/recv message.
"""

from __future__ import annotations

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")


def bus_factor(collective: str, n_ranks: int) -> float:
    """busbw / algbw for `collective` over `n_ranks` ranks (nccl-tests' PERFORMANCE.md)."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if collective == "all_reduce":
        return 2 * (n_ranks - 1) / n_ranks  # reduce-scatter then all-gather: each byte crosses twice
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n_ranks - 1) / n_ranks  # every rank receives the n-1 chunks it does not hold
    if collective in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective '{collective}' (known: {', '.join(COLLECTIVES)})")


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s."""
    return size_bytes / seconds


def busbw(collective: str, size_bytes: float, seconds: float, n_ranks: int) -> float:
    """Bus bandwidth in bytes/s."""
    return algbw(size_bytes, seconds) * bus_factor(collective, n_ranks)
