"""The parts strategies play in the study, read from the registry: which run is the reference, which
production strategy a hand-written one is measured against, the ZeRO ladder, the tensor-parallel pair
with and without sequence parallelism. Tables and benchmarks ask here instead of naming strategies, so
that renaming or adding one is a registry entry only.

Roles are resolved from what the registry records (`reference`, `twin`, family, Plan fields), never
from a strategy's name.
"""

from __future__ import annotations

from collections import Counter

from shardlab.strategies import REGISTRY, composed
from shardlab.strategies.spec import Family

# Plan fields are read at two ranks: enough for every degree to exceed 1 where the strategy splits.
_PROBE_WORLD = 2


def reference_of(name: str) -> str:
    """The run whose losses a run of `name` must reproduce (same experiment)."""
    return REGISTRY[name].reference


def is_reference(name: str) -> bool:
    """Whether `name` is some strategy's reference (the single device, the single-process MoE, ...)."""
    return any(spec.reference == name for spec in REGISTRY.values())


def the_reference() -> str:
    """The reference most strategies are checked against: the single device."""
    return Counter(spec.reference for spec in REGISTRY.values()).most_common(1)[0][0]


def twin_of(name: str) -> str | None:
    """The production strategy a hand-written `name` is measured against, or None."""
    return REGISTRY[name].twin


def _plan(name: str) -> dict:
    return REGISTRY[name].plan_fields(_PROBE_WORLD, {})


def hand_written_data_parallel(bucketed: bool) -> tuple[str, str]:
    """(the hand-written data-parallel strategy, its production twin): with `bucketed`, the one whose plan
    reduces gradients in buckets as backward goes (interleaved); without, the one that all-reduces once."""
    for name, spec in REGISTRY.items():
        if spec.family == Family.DATA_PARALLEL and spec.twin:
            if (_plan(name).get("grad_bucket_mb") is not None) == bucketed:
                return name, spec.twin
    raise LookupError(f"no hand-written {'bucketed' if bucketed else 'unbucketed'} data-parallel strategy registered")


def zero_ladder() -> tuple[str, ...]:
    """DeepSpeed's rungs that keep everything on the device, by ZeRO stage: the least sharded first, the
    most sharded last."""
    plans = {name: _plan(name) for name, spec in REGISTRY.items() if spec.family == Family.ZERO}
    plain = {name: p["zero"] for name, p in plans.items()
             if p.get("framework") == "deepspeed" and p.get("offload", "none") == "none"}
    return tuple(sorted(plain, key=plain.get))


def tp_pair() -> tuple[str, str]:
    """(hand-written tensor parallelism, the same with sequence parallelism): the tensor-parallel strategies
    with a production twin, told apart by their plan's `sp`."""
    hand = {_plan(name).get("sp", False): name for name, spec in REGISTRY.items()
            if spec.family == Family.TENSOR_PARALLEL and spec.twin}
    if set(hand) != {False, True}:
        raise LookupError("the registry needs one hand-written tensor-parallel strategy with and one without SP")
    return hand[False], hand[True]


def is_composed(name: str) -> bool:
    """Whether `name` runs the composed strategy (`composed`, `composed_moe` or a `composed_<plan>` variant)."""
    return REGISTRY[name].target == composed.COMPOSED.target
