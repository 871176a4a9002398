"""Composed plans: one run laid out by the Plan's degrees on one named device mesh (Megatron's order,
tensor parallelism innermost), reusing the hand-written techniques. This first composition is data
parallelism (replicas averaged over `dp`) around hand-written tensor parallelism, with or without
sequence parallelism, inside each `tp` group; pipelines, context and expert parallelism join it next.

strategy_options.composed: {tp: int (default 2), sp: bool (default false), world_size: int}
"""

from __future__ import annotations

from shardlab.errors import ConfigError
from shardlab.strategies.spec import Family, StrategySpec, all_of, only_options
from shardlab.strategies.tensor_parallel.options import check_tp_options

DEFAULT_TP = 2


def composed_plan(world: int, options: dict) -> dict:
    """dp x tp (+sp): the data-parallel degree is what the tensor-parallel groups leave of the world."""
    tp = options.get("tp", DEFAULT_TP)
    return {"dp": max(1, world // tp), "tp": tp, "sp": bool(options.get("sp", False)), "vocab_parallel_loss": False}


def check_degrees(spec: StrategySpec, exp: dict, where: str, world: int | str) -> None:
    """The degrees multiply to the world size and TP splits the model (heads, MLP, vocabulary; SP: the
    sequence), each a ConfigError naming the field."""
    options = spec.options(exp)
    tp, sp = options.get("tp", DEFAULT_TP), options.get("sp", False)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(spec.option_field(where, "tp"), f"must be a positive integer, got {tp!r}")
    if not isinstance(sp, bool):
        raise ConfigError(spec.option_field(where, "sp"), f"must be true or false, got {sp!r}")
    if sp and tp == 1:
        raise ConfigError(spec.option_field(where, "sp"), "sequence parallelism needs tp > 1")
    if world == "auto":
        return  # checked again at launch
    if int(world) % tp:
        raise ConfigError(spec.option_field(where, "tp"), f"{tp} does not divide the world size {world}: "
                                                         f"dp x tp must be the world size")
    check_tp_options(spec, exp, where, tp)


SPECS = [
    StrategySpec("composed", "shardlab.strategies.composed.strategy:ComposedPlan", Family.HYBRID, "tensor_parallel",
                 "A Plan's degrees on one mesh: dp replicas around hand-written TP (+SP) groups.",
                 plan=composed_plan, check_options=all_of(only_options("tp", "sp"), check_degrees)),
]
