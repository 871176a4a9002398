"""Compare two results/tables folders: same tables, same columns (new ones allowed), same values
apart from timings. For refactors that must not change what the study measures.

    python scripts/compare-tables.py BEFORE/results/tables AFTER/results/tables [--ignore REGEX]

Timing-dependent columns (wall times, throughput, bandwidth, communication shares and anything
derived from them) differ between any two runs and are skipped; every other shared column is
compared row by row after sorting on the columns both sides share that identify a row. Exit
status 1 when a table or column is missing or a value differs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

# Timings and what derives from them; when and where a run ran; process-level peak memory (the
# allocator's and the imports' footprint, which moves between launches even on one machine).
TIMING = re.compile(r"time|_s$|_s_|per_s|tokens_s|throughput|bw|GBps|comm_share|predicted_share|speedup|ratio|latency|alpha|beta|"
                    r"rel_err|r2|bubble_measured|fraction|overhead|seconds|wall|spread|iqr|p\d\d|mean_s|median|"
                    r"bottleneck|started|finished|host|hostname|commit|python|version|pid|attempt|dirty|^peak_bytes$|peak_bytes_max_rank",
                    re.IGNORECASE)
KEYS = ("experiment", "strategy", "rank", "step", "component", "module", "category", "collective", "size_bytes",
        "purpose", "stage", "rung", "domain", "metric", "name", "table", "split", "world_size", "schedule")


def compare_table(name: str, before: pd.DataFrame, after: pd.DataFrame, skip=TIMING) -> list[str]:
    problems = []
    missing = [c for c in before.columns if c not in after.columns]
    if missing:
        problems.append(f"{name}: columns gone: {missing}")
    if len(before) != len(after):
        return problems + [f"{name}: {len(before)} rows before, {len(after)} after"]
    compared = [c for c in before.columns if c in after.columns and not skip.search(c)]
    keys = [k for k in KEYS if k in compared]
    b = before.sort_values(keys, kind="stable").reset_index(drop=True) if keys else before
    a = after.sort_values(keys, kind="stable").reset_index(drop=True) if keys else after
    for col in compared:
        x, y = b[col], a[col]
        if pd.api.types.is_numeric_dtype(x) and pd.api.types.is_numeric_dtype(y):
            same = np.isclose(x.astype(float), y.astype(float), rtol=1e-9, atol=0, equal_nan=True)
        else:
            same = ((x.astype(str) == y.astype(str)) | (x.isna() & y.isna())).to_numpy()
        if not same.all():
            i = int(np.argmin(same))
            problems.append(f"{name}.{col}: {int((~same).sum())} of {len(same)} rows differ, e.g. row {i}: "
                            f"{x.iloc[i]!r} -> {y.iloc[i]!r}")
    return problems


def main(before_dir: str, after_dir: str, ignore: str | None = None) -> int:
    """`ignore`: a regex of further columns to skip (e.g. a setting the two runs were told to differ in)."""
    skip = re.compile(f"{TIMING.pattern}|{ignore}", re.IGNORECASE) if ignore else TIMING
    before = {p.stem: p for p in Path(before_dir).glob("*.csv")}
    after = {p.stem: p for p in Path(after_dir).glob("*.csv")}
    problems = [f"table gone: {name}" for name in sorted(set(before) - set(after))]
    for name in sorted(set(before) & set(after)):
        b, a = pd.read_csv(before[name]), pd.read_csv(after[name])
        found = compare_table(name, b, a, skip)
        added = [c for c in a.columns if c not in b.columns]
        skipped = [c for c in b.columns if c in a.columns and skip.search(c)]
        print(f"{name}: {len(b)} rows, {'OK' if not found else 'DIFFERS'}"
              + (f"; added columns {added}" if added else "") + (f"; timing columns skipped {skipped}" if skipped else ""))
        problems += found
    for name in sorted(set(after) - set(before)):
        print(f"{name}: new table ({len(pd.read_csv(after[name]))} rows)")
    print("\n".join(problems) if problems else "same tables, columns and values apart from timings"
          + (f" and columns matching {ignore!r}" if ignore else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--ignore", help="regex of further columns to skip")
    args = parser.parse_args()
    sys.exit(main(args.before, args.after, args.ignore))
