"""Config checks for the tensor-parallel strategies (torch-free: run before any launch)."""

from __future__ import annotations

from shardlab.errors import ConfigError

HAND_WRITTEN_OPTIONS = {"world_size", "parallel_cross_entropy"}


def check_tp_options(exp: dict, where: str, tp: int | str) -> None:
    """Heads, MLP width and vocabulary split evenly over the TP ranks; SP also splits the sequence."""
    strategy = where.rsplit(".", 1)[-1]
    experiment = where.rsplit(".strategy_options", 1)[0]
    allowed = HAND_WRITTEN_OPTIONS if strategy in ("tp", "tp_sp") else {"world_size"}
    for key in exp.get("strategy_options", {}).get(strategy, {}):
        if key not in allowed:
            raise ConfigError(f"{where}.{key}", f"unknown option (allowed: {', '.join(sorted(allowed))})")
    model = exp["model"]
    if tp == "auto" or model.get("source") != "local":
        return  # checked when the model is sharded
    for key in ("num_heads", "intermediate_size", "vocab_size"):
        if model[key] % tp:
            raise ConfigError(f"{experiment}.model.{key}",
                              f"{model[key]} is not divisible by the tensor-parallel degree {tp} of '{strategy}'")
    if strategy.startswith("tp_sp") and exp["training"]["seq_len"] % tp:
        raise ConfigError(f"{experiment}.training.seq_len",
                          f"{exp['training']['seq_len']} is not divisible by the sequence-parallel degree {tp}")
