"""Communication seconds of a plan on a network link: the what-if half of the communication model.

A MODEL, never a measurement, on stated assumptions: on a link, each call of a plan costs
count x (latency + bus bytes / bandwidth), with the link's nominal per-direction bandwidth and an
assumed per-call latency (`LINKS`); ring algorithms (nccl-tests' bus-bandwidth convention); no
contention, no congestion. "This machine" uses the benchmark's fitted alpha-beta parameters instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.costs.alpha_beta import AlphaBeta
from shardlab.costs.collectives import COLLECTIVES
from shardlab.costs.comm_volume import Call


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_GBps: float  # nominal, per direction, 1e9 bytes/s
    latency_s: float  # assumed fixed cost of one collective call (order of magnitude)


# Ordered by bandwidth: the tables number them in this order (link_order) for the charts' axes.
LINKS = [
    Link("10 Gb/s Ethernet", 1.25, 30e-6),
    Link("100 Gb/s InfiniBand", 12.5, 5e-6),
    Link("400 Gb/s InfiniBand", 50.0, 5e-6),
    Link("NVLink 4 (H100, 450 GB/s)", 450.0, 3e-6),
]
MEASURED_LINK = "this machine (fitted alpha-beta)"


def plan_seconds(plan: list[Call], models: dict[str, AlphaBeta]) -> float | None:
    """Predicted communication seconds of a plan; None if a collective has no fitted model."""
    if any(call.collective not in models for call in plan if call.group_size > 1):
        return None
    return sum(call.count * models[call.collective].seconds_for(call.collective, call.size_bytes, call.group_size)
               for call in plan)


def link_models(link: Link) -> dict[str, AlphaBeta]:
    """Every collective on `link`: its assumed latency and nominal bandwidth as alpha and (bus) beta."""
    return {c: AlphaBeta(link.latency_s, link.bandwidth_GBps * 1e9) for c in COLLECTIVES}
