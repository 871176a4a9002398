"""Errors every layer may raise (imports nothing from shardlab)."""

from __future__ import annotations

import signal
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is wrong; the message starts with the offending field."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"config field '{field}': {problem}")


class Interrupted(Exception):
    """A launcher received SIGTERM or SIGINT (e.g. Snakemake cancelling the job): what it started is
    stopped and recorded; the command exits 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class ArtifactError(RuntimeError):
    """A prepared file or folder (model, tokenizer) is missing or cannot be read; names the path."""

    def __init__(self, what: str, path, cause: BaseException | None = None):
        self.path = path
        why = f": {type(cause).__name__}: {str(cause).strip()[:300]}" if cause else ""
        super().__init__(f"cannot load the {what} in {path} (missing, corrupt or incomplete: delete it and "
                         f"rerun the rule that prepares it){why}")


def load_artifact(what: str, path, loader):
    """`loader()`, with any failure to read `path` turned into an ArtifactError naming it."""
    if not Path(path).is_dir():
        raise ArtifactError(what, path, FileNotFoundError("no such folder"))
    try:
        return loader()
    except Exception as err:  # transformers/safetensors/json raise many types for one cause: a bad file
        raise ArtifactError(what, path, err) from err
