"""Config checks for `cp_ring` (torch-free: the Snakefile validates configs before any run)."""

from __future__ import annotations

from shardlab.errors import ConfigError


def check_cp_options(spec, exp: dict, where: str, cp: int | str) -> None:
    unknown = set(spec.options(exp)) - {"world_size"}
    if unknown:
        raise ConfigError(spec.option_field(where, sorted(unknown)[0]), f"unknown option for {spec.name} (known: world_size)")
    if cp == "auto":
        return  # checked again by the sharding code once the world size is known
    check_cp_sequence(exp["training"]["seq_len"], cp, f"{where}.training.seq_len")


def check_cp_sequence(seq_len: int, cp: int, field: str) -> None:
    if seq_len % (2 * cp):
        raise ConfigError(field, f"{seq_len} is not divisible by 2 x {cp} context-parallel ranks = {2 * cp}: zig-zag "
                                 f"sharding gives each rank two equal chunks (use a multiple of {2 * cp})")
