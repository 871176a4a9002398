"""Config checks for the tensor-parallel strategies (torch-free: run before any launch)."""

from __future__ import annotations

from shardlab.errors import ConfigError


def check_tp_options(spec, exp: dict, where: str, tp: int | str) -> None:
    """Heads, MLP width and vocabulary split evenly over the TP ranks; SP also splits the sequence."""
    model = exp["model"]
    if tp == "auto" or model.get("source") != "local":
        return  # checked when the model is sharded
    for key in ("num_heads", "intermediate_size", "vocab_size"):
        if model[key] % tp:
            raise ConfigError(f"{where}.model.{key}",
                              f"{model[key]} is not divisible by the tensor-parallel degree {tp} of '{spec.name}'")
    if spec.plan_fields(tp, spec.options(exp)).get("sp") and exp["training"]["seq_len"] % tp:
        raise ConfigError(f"{where}.training.seq_len",
                          f"{exp['training']['seq_len']} is not divisible by the sequence-parallel degree {tp}")
