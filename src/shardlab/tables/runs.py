"""All runs' summary.json + metrics.jsonl -> tidy tables under results/tables/.

- runs.csv: one row per run (status, reason, throughput, loss, settings, environment)
- steps.csv: one row per run step (loss, step time, tokens/s, communication time, validation loss)
- ranks.csv: one row per run rank (parameter/gradient/optimizer/activation bytes, peak, extras)
- activations.csv: one row per run rank module (bytes saved for backward)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

RUN_KEYS = ("experiment", "strategy", "status")


def _scalars(d: dict, prefix: str = "") -> dict:
    """Scalar fields as columns; nested dicts flattened with a prefix; lists as JSON text."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_scalars(value, f"{prefix}{key}."))
        elif isinstance(value, list):
            out[f"{prefix}{key}"] = json.dumps(value)
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_run(summary_path: Path) -> tuple[dict, list[dict], list[dict], list[dict]]:
    summary = json.loads(summary_path.read_text())
    key = {k: summary.get(k) for k in RUN_KEYS}
    ranks = summary.pop("ranks", []) or []
    run = _scalars(summary)

    metrics_path = summary_path.with_name("metrics.jsonl")
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    steps = [dict(key, **json.loads(line)) for line in lines if line.strip()]

    rank_rows, activation_rows = [], []
    for rank in ranks:
        rank = dict(rank)
        by_module = rank.pop("activation_by_module", {}) or {}
        rank_rows.append(dict(key, **_scalars(rank)))
        activation_rows += [dict(key, rank=rank["rank"], module=m, bytes=b) for m, b in by_module.items()]
    return run, steps, rank_rows, activation_rows


def aggregate(summary_paths: list[Path], out_dir: Path) -> dict[str, pd.DataFrame]:
    runs, steps, ranks, activations = [], [], [], []
    for path in summary_paths:
        r, s, k, a = read_run(Path(path))
        runs.append(r)
        steps += s
        ranks += k
        activations += a
    tables = {
        "runs": pd.DataFrame(runs),
        "steps": pd.DataFrame(steps, columns=None if steps else [*RUN_KEYS, "step", "loss"]),
        "ranks": pd.DataFrame(ranks, columns=None if ranks else [*RUN_KEYS, "rank"]),
        "activations": pd.DataFrame(activations, columns=[*RUN_KEYS, "rank", "module", "bytes"]),
    }
    write_tables(tables, out_dir)
    return tables


def write_tables(tables: dict[str, pd.DataFrame], out_dir: Path) -> None:
    """Write each table as out_dir/<name>.csv (shared by every topic's table builder)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, frame in tables.items():
        frame.to_csv(out_dir / f"{name}.csv", index=False)
        print(f"{name}.csv: {len(frame)} rows")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlab.tables.runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("summaries", type=Path, nargs="+", help="results/<exp>/runs/<strategy>/summary.json")
    args = parser.parse_args(argv)
    tables = aggregate(args.summaries, args.out_dir)
    runs = tables["runs"]
    ok = int((runs["status"] == "ok").sum())
    print(f"aggregated {len(runs)} runs ({ok} ok, {len(runs) - ok} failed/oom) -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
