"""Option types of the tensor-parallel strategies (torch-free: run before any launch). What the heads,
MLP width, vocabulary and (SP) sequence must split into is their Plan's question (`costs.plan.rejection`,
asked by `StrategySpec.check`)."""

from __future__ import annotations

from shardlab.errors import ConfigError


def check_tp_options(spec, exp: dict, where: str, tp: int | str) -> None:
    """`parallel_cross_entropy` (hand-written TP only: its name is checked by `only_options`) is a switch."""
    value = spec.options(exp).get("parallel_cross_entropy", False)
    if not isinstance(value, bool):
        raise ConfigError(spec.option_field(where, "parallel_cross_entropy"), f"must be true or false, got {value!r}")
