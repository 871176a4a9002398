"""The launching side of a benchmark that runs its own per-rank program (`python -m <module> --worker ...`):
one torchrun job owned like a run (`runner.launch.launch_module`), its result read back, its rows written."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pandas as pd

from shardlab.runner.launch import launch_module


def run_worker(world: int, module: str, worker_args: list[str], timeout_s: float) -> tuple[object | None, str]:
    """`module --worker` on `world` ranks: the JSON its rank 0 wrote to `--worker-out`, or None and why the
    launch failed (one line; a timeout names the `--timeout-s` option)."""
    with tempfile.TemporaryDirectory(prefix=module.rsplit(".", 1)[-1] + "-") as tmp:
        out = Path(tmp) / "result.json"
        reason = launch_module(world, module, ["--worker", "--worker-out", str(out), *worker_args], Path(tmp), out,
                               timeout_s, "--timeout-s")
        return (None, reason) if reason else (json.loads(out.read_text()), "")


def write_rows(experiment: str, rows: list[dict], columns: list[str], out: Path) -> None:
    """A benchmark's table: one row per measurement (or per failure), each named by its experiment."""
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{"experiment": experiment, **row} for row in rows], columns=columns).to_csv(out, index=False)


def bench_parser(prog: str, description: str, tokens: bool = True, timeout_s: int = 900):
    """The arguments every such benchmark takes: the experiment's settings, its model (and tokens), the table to
    write, the launch's deadline, and the hidden flags of its per-rank program."""
    from shardlab import cli

    parser = cli.Parser(prog=prog, description=description)
    parser.add_argument("--experiment-config", type=cli.existing_file, required=True)
    parser.add_argument("--model-dir", type=cli.existing_dir, required=True)
    if tokens:
        parser.add_argument("--tokens", type=cli.existing_file, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout-s", type=cli.count, default=timeout_s)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return parser
