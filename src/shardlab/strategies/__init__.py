"""The strategy registry: the single source of every strategy fact.

Each family package lists its strategies (`SPECS` in `strategies/<family>/__init__.py`, torch-free)
with their module, report topic, reference, Plan fields and config checks (`spec.StrategySpec`): a
strategy is a Plan plus an implementation, and the one cost model (`costs.predict`) predicts its
memory, collectives and step time from the Plan. Rules, tables and report sections iterate over this
registry; none keeps its own list of strategy names. Adding a strategy is one entry in its family's
`SPECS` (or `register`), its module, and its tests.
"""

from __future__ import annotations

import os
from dataclasses import replace

from shardlab.strategies import (composed, context_parallel, data_parallel, expert_parallel, pipeline_parallel,
                                 tensor_parallel, zero)
from shardlab.errors import ConfigError
from shardlab.strategies.spec import Family, StrategySpec


def smaller_micro_batch(rows: int) -> int:
    """The largest micro-batch below `rows` that divides it (rows / its smallest prime factor): half an
    even micro-batch, a third of 9, one row of a prime."""
    if rows < 2:
        raise ValueError("a micro-batch of one sequence cannot be split into a second summation order")
    return rows // next(p for p in range(2, rows + 1) if rows % p == 0)


def check_reorderable(spec: StrategySpec, exp: dict, where: str, world) -> None:
    """The reordered reference splits each micro-batch in two, so a micro-batch needs two sequences."""
    training = exp["training"]
    if (training.get("micro_batch_size") or training["global_batch_size"]) < 2:
        field = "micro_batch_size" if training.get("micro_batch_size") else "global_batch_size"
        raise ConfigError(f"{where}.training.{field}",
                          "the parity check's noise floor (single_reordered) splits each micro-batch in two: "
                          "it needs at least 2 sequences per micro-batch")


SINGLE = StrategySpec(
    "single", "shardlab.strategies.single:SingleDevice", Family.BASELINE, "runs",
    "One process, the reference every parallel run is checked against.",
    reference="single", single_process=True, reordered="single_reordered")
SINGLE_REORDERED = StrategySpec(
    "single_reordered", "shardlab.strategies.single:SingleReordered", Family.BASELINE, "runs",
    "The reference with its micro-batches and its linear layers' sums split in two: the same math in another "
    "order, so its distance from `single` is the rounding noise the parity check allows for (tables.parity).",
    single_process=True, check_options=check_reorderable, micro_batch_rows=smaller_micro_batch)

class Registry(dict):
    """name -> StrategySpec. Besides the registered names, any `composed_<plan>` is one more composed plan:
    the `composed` strategy under that name, its options at `strategy_options.composed_<plan>`, so that one
    experiment runs several plans, each its own run. Such names are looked up, never listed: iterating
    gives the registered strategies only."""

    def __missing__(self, name: str) -> StrategySpec:
        if isinstance(name, str) and name.startswith(composed.VARIANT_PREFIX):
            return replace(composed.variant(name), title=title(name))
        raise KeyError(name)

    def __contains__(self, name) -> bool:
        return super().__contains__(name) or (isinstance(name, str) and name.startswith(composed.VARIANT_PREFIX))

    def get(self, name, default=None):
        return self[name] if name in self else default


# What the report's prose calls each strategy (tables and code keep the names).
TITLES = {
    "single": "one device", "single_reordered": "one device, sums reordered", "dp_naive": "naive DP",
    "dp_interleaved": "interleaved DP", "ddp": "DDP", "zero0": "ZeRO-0", "zero1": "ZeRO-1", "zero2": "ZeRO-2",
    "zero3": "ZeRO-3", "zero2_offload": "ZeRO-2 with offload", "zero3_offload": "ZeRO-3 with offload",
    "fsdp2_full": "FSDP2 full sharding", "fsdp2_grad_op": "FSDP2 gradient and optimizer sharding",
    "deepspeed_single": "DeepSpeed's bf16 on one device", "fsdp2_single": "FSDP2's bf16 on one device",
    "tp": "TP", "tp_sp": "TP + SP", "tp_dtensor": "TP on DTensor", "tp_sp_dtensor": "TP + SP on DTensor",
    "pp_gpipe": "GPipe", "pp_1f1b": "1F1B", "pp_interleaved": "interleaved 1F1B", "hybrid_dp_pp": "DP × PP",
    "cp_ring": "ring attention", "moe_single": "the MoE on one device", "ep_moe": "expert-parallel MoE",
    "composed": "a composed plan", "composed_moe": "a composed MoE plan",
}


def title(name: str) -> str:
    """A strategy as the report's prose names it; a composed plan by its degrees ('plan dp2 tp2sp pp2 zero1')."""
    if name in TITLES:
        return TITLES[name]
    if isinstance(name, str) and name.startswith(composed.VARIANT_PREFIX):
        return "plan " + name.removeprefix(composed.VARIANT_PREFIX).replace("_", " ")
    return name


_FAMILIES = (data_parallel, zero, tensor_parallel, pipeline_parallel, context_parallel, expert_parallel, composed)
REGISTRY: Registry = Registry({spec.name: replace(spec, title=title(spec.name))
                               for spec in [SINGLE, SINGLE_REORDERED, *(s for f in _FAMILIES for s in f.SPECS)]})
TOPICS: tuple[str, ...] = tuple(dict.fromkeys(spec.topic for spec in REGISTRY.values()))
# Runs that measure rounding noise for the parity rule, not a technique: no ranking or claim counts them.
NOISE_RUNS: frozenset[str] = frozenset(filter(None, (x for s in REGISTRY.values() for x in (s.reordered, s.bf16_twin))))


def register(spec: StrategySpec) -> StrategySpec:
    """Add a strategy to the registry (e.g. a variant of an existing class with other Plan fields):
    checked, predicted and tabulated like every other. Refuses a name already taken."""
    if spec.name in REGISTRY:
        raise ValueError(f"strategy '{spec.name}' is already registered")
    REGISTRY[spec.name] = spec
    return spec


def get_spec(name: str) -> StrategySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown strategy '{name}' (known: {', '.join(sorted(REGISTRY))})") from None


def strategies_of(topic: str) -> list[str]:
    """The strategies a topic's tables and report section cover, in registry order."""
    return [name for name, spec in REGISTRY.items() if spec.topic == topic]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity: a Slurm or container limit), else all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def launch_threads(launch: dict, world: int | str) -> int:
    """CPU threads a launch uses: ranks x launch.threads_per_rank ('auto' ranks: counted at launch, 1 here)."""
    return launch["threads_per_rank"] * (1 if world == "auto" else int(world))


def threads_per_rank(exp: dict, strategy: str) -> int:
    """CPU threads each rank of a run uses: launch.threads_per_rank, except that a one-process run gets the
    cores of the experiment's widest run (ranks x threads_per_rank, at most this machine's cores), so that
    throughputs are compared at equal cores: `single` against a 2-rank run of 1 thread a rank runs with 2
    threads. On GPUs a one-process run still holds 1 device against N: the tables say so (`compute.count`)."""
    threads = exp["launch"]["threads_per_rank"]
    if not REGISTRY[strategy].single_process:
        return threads
    strategies = [*exp.get("strategies", []), *exp.get("noise_floor_runs", [])]
    widest = max((w for w in (REGISTRY[s].world_size(exp) for s in strategies) if isinstance(w, int)), default=1)
    return max(threads, min(threads * widest, available_cores()))
