"""Online alternative to the shipped files: a Hugging Face hub data set exported to the same CSV.

The shipped files (data/README.md) keep the default workflow offline. For longer GPU runs a larger
hub data set can replace them: export it with the shipped file's column names and point the
experiment's `data.path` at the result; formats, splits and evaluation stay the same. Hub column
names differ per data set, so the mapping is explicit (`--columns SMILES=smiles,Solubility=logS`):
check the data set card and its licence first.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from shardlab import cli


def parse_columns(spec: str) -> dict[str, str]:
    """'ours=theirs,...' -> {ours: theirs}."""
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    if not pairs or any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
        raise ValueError(f"--columns must look like 'SMILES=smiles,Solubility=logS', got {spec!r}")
    return {ours.strip(): theirs.strip() for ours, theirs in pairs}


def export_rows(dataset, columns: dict[str, str], out: Path | str) -> int:
    """Write `dataset` (any iterable of dicts, e.g. a `datasets.Dataset`) with renamed columns; returns rows."""
    missing = set(columns.values()) - set(getattr(dataset, "column_names", None) or columns.values())
    if missing:
        raise KeyError(f"the data set has no column(s) {sorted(missing)}; it has {dataset.column_names}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns))
        writer.writeheader()
        for row in dataset:
            writer.writerow({ours: row[theirs] for ours, theirs in columns.items()})
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab fetch-dataset --hub-id ID [--config NAME] --split train --columns A=a,B=b --out CSV`."""
    parser = cli.Parser(prog="shardlab fetch-dataset", description=__doc__.splitlines()[0])
    parser.add_argument("--hub-id", required=True)
    parser.add_argument("--config", default=None, help="the data set's configuration name, if it has several")
    parser.add_argument("--split", default="train")
    parser.add_argument("--columns", required=True, type=cli.argument(parse_columns),
                        help="shipped column = hub column, comma separated")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from datasets import load_dataset  # slow to import; only a download needs it

    try:
        dataset = load_dataset(args.hub_id, args.config, split=args.split)
    except Exception as err:  # offline, unknown id, gated: the hub and fsspec raise many types for one cause
        print(f"shardlab fetch-dataset: cannot download {args.hub_id} [{args.split}]: {type(err).__name__}: "
              f"{' '.join(str(err).split())[:300]}", file=sys.stderr)
        return 1
    n = export_rows(dataset, args.columns, args.out)
    print(f"{args.hub_id} [{args.split}]: {n} rows -> {args.out}")
    return 0
