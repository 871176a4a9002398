"""Errors every layer may raise (imports nothing from shardlab)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is wrong; the message starts with the offending field."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"config field '{field}': {problem}")
