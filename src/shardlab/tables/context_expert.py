"""Context- and expert-parallel runs -> the two tidy tables their report section needs.

- cp_memory.csv: one row per run rank of every run in an experiment that has a `cp_ring` run:
  sequence length, context-parallel size (1 for the reference), activation bytes, throughput.
- expert_load.csv: one row per (run, layer, expert) of `moe_single` / `ep_moe` runs: assignments
  routed to the expert, kept within capacity, dropped.

Reads `results/<exp>/runs/<strategy>/summary.json` and the experiment's resolved
`results/<exp>/experiment.json` (for the sequence length).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from shardlab.tables.runs import write_tables

CP_COLUMNS = ["experiment", "strategy", "status", "seq_len", "global_batch_size", "cp_size", "rank",
              "activation_bytes", "param_bytes", "tokens_per_s", "step_time_median_s", "final_loss"]
LOAD_COLUMNS = ["experiment", "strategy", "layer", "expert", "routed", "kept", "dropped", "routed_share"]


def _experiment(summary_path: Path) -> dict:
    settings = summary_path.parents[2] / "experiment.json"
    return json.loads(settings.read_text()) if settings.exists() else {}


def cp_rows(summary: dict, exp: dict) -> list[dict]:
    training = exp.get("training", {})
    base = {"experiment": summary.get("experiment"), "strategy": summary.get("strategy"), "status": summary.get("status"),
            "seq_len": training.get("seq_len"), "global_batch_size": training.get("global_batch_size"),
            "tokens_per_s": summary.get("tokens_per_s"), "step_time_median_s": summary.get("step_time_median_s"),
            "final_loss": summary.get("final_loss")}
    ranks = summary.get("ranks") or []
    if not ranks:  # a failed run: one row that says so
        return [dict(base, cp_size=None, rank=None, activation_bytes=None, param_bytes=None)]
    return [dict(base, cp_size=r.get("cp_size", 1), rank=r["rank"], activation_bytes=r.get("activation_bytes"),
                 param_bytes=r.get("param_bytes")) for r in ranks]


def load_rows(summary: dict) -> list[dict]:
    ranks = summary.get("ranks") or []
    if not ranks or "expert_routed" not in ranks[0]:
        return []
    rank = ranks[0]  # routing counts are group totals, identical on every rank
    rows = []
    for layer, (routed, kept) in enumerate(zip(rank["expert_routed"], rank["expert_kept"])):
        total = sum(routed) or 1
        for expert, (r, k) in enumerate(zip(routed, kept)):
            rows.append({"experiment": summary["experiment"], "strategy": summary["strategy"], "layer": layer,
                         "expert": expert, "routed": r, "kept": k, "dropped": r - k, "routed_share": r / total})
    return rows


def build_tables(summary_paths: list[Path]) -> dict[str, pd.DataFrame]:
    summaries = [(json.loads(Path(p).read_text()), _experiment(Path(p))) for p in summary_paths]
    cp_experiments = {s.get("experiment") for s, _ in summaries if s.get("strategy") == "cp_ring"}
    cp, load = [], []
    for summary, exp in summaries:
        if summary.get("experiment") in cp_experiments:
            cp += cp_rows(summary, exp)
        load += load_rows(summary)
    return {"cp_memory": pd.DataFrame(cp, columns=CP_COLUMNS), "expert_load": pd.DataFrame(load, columns=LOAD_COLUMNS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlab.tables.context_expert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("summaries", type=Path, nargs="*")
    args = parser.parse_args(argv)
    write_tables(build_tables(args.summaries), args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
