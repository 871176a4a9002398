"""Data parallelism: every rank holds the whole model and a slice of the batch; gradients are
averaged. `naive` (one blocking all-reduce after backward) and `interleaved` (per-layer async
all-reduce from gradient hooks) are written by hand; `ddp` is PyTorch's, their production twin."""

from __future__ import annotations

from shardlab.costs.comm_volume import bucketed_data_parallel, data_parallel
from shardlab.costs.memory import unsharded
from shardlab.errors import ConfigError
from shardlab.strategies.spec import StrategySpec

TOPIC = "data_parallel"


def replica_plan(model, step, world, options):
    return data_parallel(model, step, world)


def bucket_plan(model, step, world, options):
    return bucketed_data_parallel(model, step, world, options.get("bucket_mb"))


def check_bucket_options(exp: dict, where: str, world) -> None:
    options = exp.get("strategy_options", {}).get("dp_interleaved", {})
    unknown = set(options) - {"bucket_mb", "world_size"}
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown option (known: bucket_mb, world_size)")
    size = options.get("bucket_mb")
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0):
        raise ConfigError(f"{where}.bucket_mb", f"must be a positive number of MiB, got {size!r}")


def replica_states(model, world, options, dtype, optimizer):
    return [unsharded(model.parameters(), dtype, optimizer)] * world


def _spec(name: str, cls: str, summary: str, plan=replica_plan, **kw) -> StrategySpec:
    return StrategySpec(name, f"shardlab.strategies.data_parallel.{cls}", "data parallel", TOPIC, summary,
                        plan, replica_states, **kw)


SPECS = [
    _spec("dp_naive", "naive:NaiveDataParallel",
          "Full backward, then one blocking all-reduce of all gradients (hand-written).", twin="ddp"),
    _spec("dp_interleaved", "interleaved:InterleavedDataParallel",
          "Per-layer (or per-bucket_mb) async all-reduce launched from gradient hooks, overlapping backward "
          "(hand-written).", plan=bucket_plan, twin="ddp", comm_timed_in_full=False, check_options=check_bucket_options),
    _spec("ddp", "ddp:TorchDDP", "torch DistributedDataParallel: bucketed all-reduce overlapped with backward."),
]
