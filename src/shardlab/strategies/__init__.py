"""The strategy registry: the single source of every strategy fact.

Each family package lists its strategies (`SPECS` in `strategies/<family>/__init__.py`, torch-free)
with their module, report topic, reference, communication plan, memory prediction and config
checks (`spec.StrategySpec`). Rules, tables and report sections iterate over this registry; none
keeps its own list of strategy names. Adding a strategy is one entry in its family's `SPECS`, its
module, and its tests.
"""

from __future__ import annotations

from shardlab.costs.memory import unsharded
from shardlab.strategies import context_parallel, data_parallel, expert_parallel, pipeline_parallel, tensor_parallel, zero
from shardlab.strategies.spec import StrategySpec, one

SINGLE = StrategySpec(
    "single", "shardlab.strategies.single:SingleDevice", "baseline", "runs",
    "One process, the reference every parallel run is checked against.",
    lambda model, step, world, options: [],
    lambda model, world, options, dtype, optimizer: [unsharded(model.parameters(), dtype, optimizer)],
    reference="single", single_process=True, data_parallel_size=one)

_FAMILIES = (data_parallel, zero, tensor_parallel, pipeline_parallel, context_parallel, expert_parallel)
REGISTRY: dict[str, StrategySpec] = {spec.name: spec for spec in [SINGLE, *(s for f in _FAMILIES for s in f.SPECS)]}
TOPICS: tuple[str, ...] = tuple(dict.fromkeys(spec.topic for spec in REGISTRY.values()))


def get_spec(name: str) -> StrategySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown strategy '{name}' (known: {', '.join(sorted(REGISTRY))})") from None


def strategies_of(topic: str) -> list[str]:
    """The strategies a topic's tables and report section cover, in registry order."""
    return [name for name, spec in REGISTRY.items() if spec.topic == topic]
