"""Collectives as NCCL runs them (costs.nccl): large messages reach the bus bandwidth nccl-tests measures
(hardware.yaml's anchors), small ones pay NCCL's latency, which grows with the ring; a group spanning
nodes moves at its ranks' NICs, one NIC per rank when it has one rank per node."""

from __future__ import annotations

import pytest

from shardlab.costs.hardware import by_name
from shardlab.costs.nccl import Span, seconds
from shardlab.costs.collectives import bus_factor

H100, A100 = by_name("H100-80GB SXM"), by_name("A100-80GB SXM")
BIG = 8 * 2**30


def busbw(device: dict, collective: str, size: float, span: Span) -> float:
    """nccl-tests' bus bandwidth of one call, GB/s."""
    return size * bus_factor(collective, span.ranks) / seconds(device, collective, size, span) / 1e9


@pytest.mark.parametrize("device, collective, span, anchor", [
    (H100, "all_reduce", Span(8, 8), 480),      # NVLink SHARP within a DGX H100
    (H100, "all_gather", Span(8, 8), 370),      # the ring within a node
    (A100, "all_reduce", Span(8, 8), 235),      # NCCL's Ampere figure
    (H100, "all_gather", Span(16, 8), 370),     # two nodes: 8 NICs of 48 GB/s, capped by the NVLink ring (nccl-tests 380-396)
    (A100, "reduce_scatter", Span(64, 8), 192),  # eight nodes: 8 HDR NICs of 24 GB/s
    (H100, "all_gather", Span(64, 1), 48),      # one rank per node (a data-parallel group under TP 8): one NIC
])
def test_large_messages_reach_the_nccl_tests_bus_bandwidth(device, collective, span, anchor):
    assert busbw(device, collective, BIG, span) == pytest.approx(anchor, rel=0.02)


def test_small_messages_pay_a_latency_that_grows_with_the_ring():
    small = 64 * 2**10
    within, across, wide = (seconds(H100, "all_gather", small, s) for s in (Span(8, 8), Span(64, 8), Span(1536, 8)))
    assert within < across < wide
    assert wide > 1e-3  # 1,535 ring steps, 191 of them across nodes: milliseconds before a byte counts
    assert busbw(H100, "all_gather", small, Span(8, 8)) < 0.2 * busbw(H100, "all_gather", BIG, Span(8, 8))


def test_a_tree_all_reduce_beats_the_ring_on_small_messages_across_many_nodes():
    """NCCL picks the faster algorithm: the ring's 2(n-1) steps against the tree's 2 log2(nodes) levels."""
    span, small = Span(1024, 8), 2**20
    ring_only = seconds(H100, "reduce_scatter", small, span) + seconds(H100, "all_gather", small, span)
    assert seconds(H100, "all_reduce", small, span) < 0.5 * ring_only


def test_a_stack_s_collective_efficiency_scales_the_bandwidth():
    span = Span(16, 8)  # two nodes: the latency is a tenth of a millisecond against 22 ms of bytes
    assert seconds(A100, "all_gather", BIG, span, 0.125) == pytest.approx(8 * seconds(A100, "all_gather", BIG, span), rel=0.01)
