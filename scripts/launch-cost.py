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

PHASES = ["agent_start_s", "rendezvous_and_spawn_s", "worker_imports_s", "process_group_s", "model_load_s",
          "strategy_setup_s", "data_and_resume_s", "training_s", "save_and_gather_s"]


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
    rows = []
    for path in sorted(results.glob("*/runs/*/summary.json")):
        summary = json.loads(path.read_text())
        startup = summary.get("startup") or {}
        if summary.get("status") == "ok" and not summary.get("reused_from") and "launch_wall_s" in startup:
            rows.append({"run": f"{summary['experiment']}/{summary['strategy']}", "world_size": summary["world_size"],
                         **startup})
    if not rows:
        raise SystemExit(f"no finished run under {results} records its launch phases: run the DAG first")
    table = pd.DataFrame(rows)
    table["exit_s"] = table["launch_wall_s"] - table[PHASES].sum(axis=1)
    table["fixed_s"] = table["launch_wall_s"] - table["training_s"]
    shown = [*PHASES, "exit_s", "launch_wall_s", "fixed_s"]
    print(f"{len(table)} runs under {results} (median, 10-90 % range, seconds):")
    for phase in shown:
        q = table[phase].quantile([0.1, 0.5, 0.9])
        print(f"  {phase:<24} {q[0.5]:6.2f}   {q[0.1]:6.2f} - {q[0.9]:6.2f}")


if __name__ == "__main__":
    main()
