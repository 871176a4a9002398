"""Deterministic, disjoint train/validation/test splits, decided row by row.

A row's part depends only on a seeded hash of its key (the row's first column: the SMILES,
sequence or formula), never on file order or on which other rows exist. So training (which
filters the raw file on the fly, see `shardlab.core.data.read_documents`) and evaluation (which reads
the saved split files) see exactly the same rows, and identical keys never straddle two parts.
A data set that ships its own test file (SCOP) sets `test_path`: then the main file is split
into train/validation only and the test part is that file.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import Iterator

from shardlab import cli

PARTS = ("train", "validation", "test")


def part_of(key: str, seed: int, validation_fraction: float, test_fraction: float) -> str:
    """'train', 'validation' or 'test' for a row key; a uniform draw from a seeded hash."""
    digest = hashlib.sha256(f"{seed}\x00{key}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + validation_fraction:
        return "validation"
    return "train"


def split_settings(split: dict) -> tuple[int, float, float]:
    """(seed, validation_fraction, test_fraction) with the defaults of the config schema."""
    test = 0.0 if split.get("test_path") else split.get("test_fraction", 0.1)
    return split.get("seed", 0), split.get("validation_fraction", 0.1), test


def read_rows(path: Path | str) -> tuple[list[str], Iterator[dict]]:
    fh = open(path, newline="")
    reader = csv.DictReader(fh)
    return list(reader.fieldnames or []), _rows(reader, fh)


def _rows(reader, fh) -> Iterator[dict]:
    with fh:
        yield from reader


def rows_of_part(path: Path | str, split: dict, part: str, base_dir: Path | str = ".") -> Iterator[dict]:
    """The raw rows of `path` that fall in `part` (malformed rows included: formatting skips them)."""
    if part not in PARTS:
        raise ValueError(f"unknown split part '{part}' (known: {', '.join(PARTS)})")
    if part == "test" and split.get("test_path"):
        yield from read_rows(Path(base_dir) / split["test_path"])[1]
        return
    seed, val, test = split_settings(split)
    columns, rows = read_rows(Path(base_dir) / path)
    key = columns[0]
    for row in rows:
        if part_of((row.get(key) or "").strip(), seed, val, test) == part:
            yield row


def write_splits(path: Path | str, split: dict, out_dir: Path | str, base_dir: Path | str = ".") -> dict:
    """Save the three parts as CSV files (the source's columns) plus manifest.json; returns the manifest."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed, val, test = split_settings(split)
    manifest = {"source": str(path), "test_source": split.get("test_path"), "seed": seed,
                "validation_fraction": val, "test_fraction": test, "key": None, "parts": {}}
    for part in PARTS:
        source = Path(base_dir) / (split["test_path"] if part == "test" and split.get("test_path") else path)
        columns = read_rows(source)[0]
        manifest["key"] = manifest["key"] or columns[0]
        target = out_dir / f"{part}.csv"
        with target.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns)
            writer.writeheader()
            n = 0
            for row in rows_of_part(path, split, part, base_dir):
                writer.writerow(row)
                n += 1
        manifest["parts"][part] = {"rows": n, "file": target.name,
                                   "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab save-splits --config exp.json --out DIR`: save an experiment's splits."""
    parser = cli.Parser(prog="shardlab save-splits", description=main.__doc__)
    parser.add_argument("--config", type=cli.existing_file, required=True, help="resolved experiment JSON")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base-dir", type=cli.existing_dir, default=Path("."),
                        help="what a relative data.path is relative to")
    args = parser.parse_args(argv)
    data = json.loads(args.config.read_text())["data"]
    manifest = write_splits(data["path"], data.get("split") or {}, args.out, base_dir=args.base_dir)
    counts = ", ".join(f"{p} {v['rows']}" for p, v in manifest["parts"].items())
    print(f"splits of {data['path']} (seed {manifest['seed']}): {counts} -> {args.out}")
    return 0
