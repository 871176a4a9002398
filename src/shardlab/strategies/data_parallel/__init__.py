"""Data parallelism: every rank holds the whole model and a slice of the batch; gradients are
averaged. `naive` (one blocking all-reduce after backward) and `interleaved` (per-layer async
all-reduce from gradient hooks) are written by hand; `ddp` is PyTorch's, their production twin."""

from __future__ import annotations

from shardlab.costs.comm_volume import data_parallel
from shardlab.costs.memory import unsharded
from shardlab.strategies.spec import StrategySpec

TOPIC = "data_parallel"


def replica_plan(model, step, world, options):
    return data_parallel(model, step, world)


def replica_states(model, world, options, dtype, optimizer):
    return [unsharded(model.parameters(), dtype, optimizer)] * world


def _spec(name: str, cls: str, summary: str, **kw) -> StrategySpec:
    return StrategySpec(name, f"shardlab.strategies.data_parallel.{cls}", "data parallel", TOPIC, summary,
                        replica_plan, replica_states, **kw)


SPECS = [
    _spec("dp_naive", "naive:NaiveDataParallel",
          "Full backward, then one blocking all-reduce of all gradients (hand-written).", twin="ddp"),
    _spec("dp_interleaved", "interleaved:InterleavedDataParallel",
          "Per-layer async all-reduce launched from gradient hooks, overlapping backward (hand-written).", twin="ddp",
          comm_timed_in_full=False),
    _spec("ddp", "ddp:TorchDDP", "torch DistributedDataParallel: bucketed all-reduce overlapped with backward."),
]
