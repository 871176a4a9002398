"""Data parallelism: every rank holds the whole model and a slice of the batch; gradients are
averaged. `naive` (one blocking all-reduce after backward) and `interleaved` (per-layer async
all-reduce from gradient hooks) are written by hand; `ddp` is PyTorch's, their production twin."""

from __future__ import annotations

from shardlab.errors import ConfigError
from shardlab.strategies.spec import Family, StrategySpec, all_of, only_options

TOPIC = "data_parallel"


def check_bucket_size(spec, exp: dict, where: str, world) -> None:
    size = spec.options(exp).get("bucket_mb")
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0):
        raise ConfigError(spec.option_field(where, "bucket_mb"), f"must be a positive number of MiB, got {size!r}")


def bucketed(world: int, options: dict) -> dict:
    """Replicas that all-reduce their gradients bucket by bucket as the backward goes: `bucket_mb` MiB,
    else one per layer."""
    return {"dp": world, "grad_bucket_mb": options.get("bucket_mb", 0), "grad_sync_overlap": True}


def overlapped(world: int, options: dict) -> dict:
    """Replicas whose library reduces gradients behind the backward (DDP's buckets)."""
    return {"dp": world, "grad_sync_overlap": True}


def _spec(name: str, cls: str, summary: str, **kw) -> StrategySpec:
    return StrategySpec(name, f"shardlab.strategies.data_parallel.{cls}", Family.DATA_PARALLEL, TOPIC, summary, **kw)


SPECS = [
    _spec("dp_naive", "naive:NaiveDataParallel",
          "Full backward, then one blocking all-reduce of all gradients (hand-written).", twin="ddp"),
    _spec("dp_interleaved", "interleaved:InterleavedDataParallel",
          "Per-layer (or per-bucket_mb) async all-reduce launched from gradient hooks, overlapping backward "
          "(hand-written).", plan=bucketed, twin="ddp", comm_timed_in_full=False,
          check_options=all_of(only_options("bucket_mb"), check_bucket_size)),
    _spec("ddp", "ddp:TorchDDP", "torch DistributedDataParallel: bucketed all-reduce overlapped with backward.",
          plan=overlapped),
]
