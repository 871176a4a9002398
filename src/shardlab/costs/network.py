"""Communication seconds of a plan on a link: the what-if half of the communication model.

A MODEL, never a measurement: the catalog's links (`hardware.yaml`: the bus bandwidth NCCL reaches on
each, with its source) and NCCL's latency model, through the same collective physics as the planner
(`costs.nccl`), with every rank of a group joined by that one link; no contention. "This machine" uses
the communication benchmark's fitted alpha-beta parameters instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.costs import hardware, nccl
from shardlab.costs.alpha_beta import AlphaBeta
from shardlab.costs.comm_volume import Call

MEASURED_LINK = "this machine (fitted alpha-beta)"


@dataclass(frozen=True)
class Link:
    name: str
    kind: str  # nvlink, pcie or network: the latency of a ring step over it
    bandwidth_GBps: float  # the bus bandwidth NCCL reaches, per direction, 1e9 bytes/s
    nominal_GBps: float

    def figures(self) -> dict:
        """What `costs.nccl` reads of a node whose ranks this link joins."""
        return {"intra_node_gbps": self.nominal_GBps, "intra_node_busbw_share": self.bandwidth_GBps / self.nominal_GBps,
                "intra_node_hop": self.kind, "nvls_gain": 0.0}


def links() -> list[Link]:
    """The catalog's links a cluster is built from, slowest first (the tables number them in this order)."""
    found = [Link(entry["name"], entry["kind"], entry["busbw_gbps"], entry["nominal_gbps"])
             for entry in hardware.catalog()["links"] if entry["name"] != "gloo on this machine"]
    return sorted(found, key=lambda link: link.bandwidth_GBps)


LINKS = links()


def plan_seconds(plan: list[Call], link: Link | dict[str, AlphaBeta]) -> float | None:
    """Predicted communication seconds of a plan's calls on `link`, or with fitted alpha-beta models
    ({collective: AlphaBeta}); None if a collective has no fitted model."""
    if isinstance(link, Link):
        return sum(call.count * nccl.seconds(link.figures(), call.collective, call.size_bytes,
                                             nccl.Span(call.group_size, call.group_size)) for call in plan)
    if any(call.collective not in link for call in plan if call.group_size > 1):
        return None
    return sum(call.count * link[call.collective].seconds_for(call.collective, call.size_bytes, call.group_size)
               for call in plan)
