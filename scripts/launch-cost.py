"""Where a launch's time goes: the `startup` phases every run records (shardlab.runner.worker.Phases,
plus the launcher's `launch_wall_s`), summarised over the runs of a results folder. Usage:

    python scripts/launch-cost.py [results]

Prints, per phase, the median and the 10-90 % range over the finished multi-process runs, and the
fixed cost: the wall time minus training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from shardlab.tables.runs import launch_cost


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
    summaries = [json.loads(p.read_text()) for p in sorted(results.glob("*/runs/*/summary.json"))]
    table = launch_cost(pd.json_normalize([s for s in summaries if not s.get("reused_from")]))
    if table.empty:
        raise SystemExit(f"no finished run under {results} records its launch phases: run the DAG first")
    print(f"{table['runs'].iloc[0]} runs under {results}, {table['rank_server'].iloc[0]} forked by the rank server "
          "(median, 10-90 % range, seconds):")
    for row in table.itertuples():
        print(f"  {row.phase:<24} {row.median_s:6.2f}   {row.p10_s:6.2f} - {row.p90_s:6.2f}")


if __name__ == "__main__":
    main()
