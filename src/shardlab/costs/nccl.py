"""Seconds of one collective as NCCL runs it, from link physics (`hardware.yaml`).

A collective over a group is costed by where the group's ranks sit (`Span`: ranks, and how many share
each node) and by the algorithm and protocol NCCL's own tuning model would choose, i.e. the fastest of:
- ring (all-gather, reduce-scatter, all-reduce): n - 1 steps (twice that for all-reduce), N - 1 of
  them across nodes (2N for all-reduce); latency = base + a per-step latency by the link the step
  crosses, so it grows with the group; bandwidth = the bus bandwidth NCCL reaches within a node
  (NVLink), or across nodes the NICs of the group's ranks on a node (NCCL runs one channel per NIC
  and forwards inside the node over NVLink), whichever is lower;
- tree (all-reduce across nodes): latency grows with log2 of the nodes;
- NVLink SHARP (all-reduce within an NVSwitch node on Hopper): one switch-side reduction;
for each of NCCL's protocols (LL for small messages, LL128, Simple for large ones). A message moves
its nccl-tests bus bytes (`collectives.bus_factor`) at the chosen bandwidth.

`efficiency` scales the bus bandwidth: what a software stack's collectives reach of NCCL's own
figures (1.0 for a stack that calls NCCL on large buffers; costs.stacks).
A machine calibrated by the communication benchmark (`alpha_beta` in the device's figures) uses
its fitted alpha-beta model instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from shardlab.costs.collectives import bus_factor
from shardlab.costs.hardware import nccl


@dataclass(frozen=True)
class Span:
    """Where a group's ranks sit: `ranks` in all, `per_node` of them on each node, over `nodes` nodes."""

    ranks: int
    per_node: int
    nodes: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "nodes", -(-self.ranks // self.per_node))

    @classmethod
    def of(cls, ranks: int, stride: int, gpus_per_node: int) -> Span:
        """A group of `ranks` whose members lie `stride` apart in the rank order (Megatron's order
        puts tensor ranks innermost: a data-parallel group's stride is tp x cp)."""
        return cls(ranks, max(1, min(ranks, gpus_per_node // stride)))


def _bandwidth(device: dict, span: Span) -> float:
    """Bus bandwidth (bytes/s) of a ring over `span`: NVLink within a node; across nodes the NICs of
    the group's ranks on each node, capped by NVLink."""
    intra = device["intra_node_gbps"] * device["intra_node_busbw_share"]
    if span.nodes == 1:
        return intra * 1e9
    nics = span.per_node * device["nics_per_gpu"]
    return min(intra, nics * device["network_gbps"] * device["network_busbw_share"]) * 1e9


def seconds(device: dict, collective: str, size_bytes: float, span: Span, efficiency: float = 1.0) -> float:
    """Seconds of one call of `collective` on `size_bytes` (nccl-tests' convention) over `span`."""
    if span.ranks < 2 or size_bytes <= 0:
        return 0.0
    fitted = device.get("alpha_beta", {}).get(collective)
    if fitted is not None:
        return fitted.seconds_for(collective, size_bytes, span.ranks)
    bus = size_bytes * bus_factor(collective, span.ranks)
    if collective in ("sendrecv", "all_to_all", "broadcast"):
        return _point_to_point(device, collective, bus, span, efficiency)
    return _fastest(collective, bus, span.ranks, span.per_node, span.nodes, _bandwidth(device, span) * efficiency,
                    device["intra_node_hop"], device.get("nvls_gain", 0.0))


@lru_cache(maxsize=1 << 16)
def _fastest(collective: str, bus: float, ranks: int, per_node: int, nodes: int, bandwidth: float, intra_hop: str,
             nvls_gain: float) -> float:
    """The fastest of NCCL's algorithms and protocols for a call (the search asks the same ones often)."""
    model = nccl()
    if collective == "all_reduce":
        steps, inter = 2 * (ranks - 1), (2 * nodes if nodes > 1 else 0)
    else:
        steps, inter = ranks - 1, nodes - 1
    best = math.inf
    for protocol, p in model["ring"].items():
        share = 1 / 3 if protocol == "LL" and nodes == 1 and collective != "all_reduce" else p["bandwidth"]
        latency = p["base"] + (steps - inter) * p["hop"][intra_hop] + inter * p["hop"]["network"]
        best = min(best, latency * 1e-6 + bus / (bandwidth * share))
    if collective == "all_reduce" and nodes > 1:
        for p in model["tree"].values():
            latency = p["base"] + 2 * ((per_node - 1) * p["hop"][intra_hop] + math.log2(nodes) * p["hop"]["network"])
            best = min(best, latency * 1e-6 + bus / (bandwidth * p["bandwidth"]))
    if collective == "all_reduce" and nodes == 1 and nvls_gain:
        best = min(best, model["nvls_latency_us"] * 1e-6 + bus / (bandwidth * nvls_gain))
    return best


def _point_to_point(device: dict, collective: str, bus: float, span: Span, efficiency: float) -> float:
    """Send/receive (a pipeline hop), all-to-all and broadcast: every rank's messages go out at once,
    so one latency; across nodes the bytes that leave the node go through the rank's own NIC."""
    simple = nccl()["ring"]["Simple"]
    hop = "network" if span.nodes > 1 else device["intra_node_hop"]
    intra = device["intra_node_gbps"] * device["intra_node_busbw_share"] * 1e9
    if span.nodes == 1:
        bandwidth = intra
    else:
        nic = device["network_gbps"] * device["network_busbw_share"] * 1e9 * device["nics_per_gpu"]
        leaving = 1.0 if collective != "all_to_all" else (span.ranks - span.per_node) / max(span.ranks - 1, 1)
        bandwidth = min(intra, nic / leaving)
    return (simple["base"] + simple["hop"][hop]) * 1e-6 + bus / (bandwidth * efficiency)
