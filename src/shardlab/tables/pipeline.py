"""Pipeline runs -> the tidy tables the pipeline report section reads, with the bubble theory beside them.

- pipeline.csv: one row per run rank of the pipeline strategies (pp_*, hybrid_dp_pp): schedule,
  p, v, m, the rank's stages, measured busy/span/idle fraction/bubble ratio, the theory, whether the
  rank is its pipeline's bottleneck (most compute), and memory (the loop probe's activation bytes,
  all activations saved over the step, their peak live bytes across the schedule, parameters, gradients).
- pipeline_timeline.csv: one row per op (forward, loss, backward) of one measured step per rank,
  for a timeline chart.

Theory (balanced stages, equal-sized micro-batches, communication free): with p stages per pipeline,
v virtual stages per rank and m micro-batches, bubble/compute = (p-1)/(v*m) and the idle share of a
step is (p-1)/(v*m + p-1). The theory is added here, beside the measurement; a run never records it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from shardlab.tables.runs import write_tables

PIPELINE_STRATEGIES = ("pp_gpipe", "pp_1f1b", "pp_interleaved", "hybrid_dp_pp")
COLUMNS = ["experiment", "strategy", "status", "reason", "schedule", "world_size", "pp_size", "virtual_stages",
           "n_microbatches", "rank", "dp_rank", "stage_ids", "stage_units", "busy_s", "span_s", "idle_fraction",
           "bubble_ratio", "theory_idle_fraction", "theory_bubble_ratio", "bottleneck", "activation_bytes",
           "saved_activation_bytes", "peak_live_activation_bytes", "param_bytes", "grad_bytes", "step_time_median_s", "tokens_per_s",
           "final_loss"]
TIMELINE_COLUMNS = ["experiment", "strategy", "n_microbatches", "rank", "op", "stage", "micro_batch", "start_s", "end_s"]


def theory_bubble_ratio(p: int, m: int, v: int = 1) -> float:
    """Idle time over compute time per stage: (p-1)/(v*m)."""
    return (p - 1) / (v * m)


def theory_idle_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of a step's span per stage: (p-1)/(v*m + p-1)."""
    return (p - 1) / (v * m + p - 1)


def run_rows(summary: dict) -> list[dict]:
    base = {"experiment": summary.get("experiment"), "strategy": summary.get("strategy"),
            "status": summary.get("status"), "reason": summary.get("reason"), "world_size": summary.get("world_size"),
            "step_time_median_s": summary.get("step_time_median_s"), "tokens_per_s": summary.get("tokens_per_s"),
            "final_loss": summary.get("final_loss")}
    ranks = [r for r in summary.get("ranks") or [] if r]
    if not ranks:  # a failed run: one row that says so
        return [base]
    rows = []
    for r in ranks:
        p, v, m = r.get("pp_size"), r.get("pp_virtual_stages"), r.get("pp_n_microbatches")
        rows.append(dict(
            base, schedule=r.get("pp_schedule"), pp_size=p, virtual_stages=v, n_microbatches=m, rank=r["rank"],
            dp_rank=r.get("dp_rank", 0), stage_ids=json.dumps(r.get("pp_stage_ids")),
            stage_units=json.dumps(r.get("pp_stage_units")), busy_s=r.get("pp_busy_s"), span_s=r.get("pp_step_span_s"),
            idle_fraction=r.get("pp_idle_fraction"), bubble_ratio=r.get("pp_bubble_ratio"),
            theory_idle_fraction=theory_idle_fraction(p, m, v) if p and m and v else None,
            theory_bubble_ratio=theory_bubble_ratio(p, m, v) if p and m and v else None,
            activation_bytes=r.get("activation_bytes"), saved_activation_bytes=r.get("pp_saved_activation_bytes"),
            peak_live_activation_bytes=r.get("pp_peak_live_activation_bytes"),
            param_bytes=r.get("param_bytes"), grad_bytes=r.get("grad_bytes")))
    # The bottleneck is the rank with the most compute in its pipeline (data-parallel replica): its idle
    # time is the schedule's bubble; lighter stages also wait for it (stage imbalance).
    for dp in {row["dp_rank"] for row in rows}:
        replica = [row for row in rows if row["dp_rank"] == dp and row["busy_s"] is not None]
        for row in replica:
            row["bottleneck"] = row is max(replica, key=lambda x: x["busy_s"])
    return rows


def timeline_rows(summary: dict) -> list[dict]:
    rows = []
    for r in summary.get("ranks") or []:
        for op, stage, micro, start, end in (r or {}).get("pp_timeline", []):
            rows.append({"experiment": summary["experiment"], "strategy": summary["strategy"],
                         "n_microbatches": r.get("pp_n_microbatches"), "rank": r["rank"], "op": op, "stage": stage,
                         "micro_batch": micro, "start_s": start, "end_s": end})
    return rows


def build_tables(summary_paths: list[Path]) -> dict[str, pd.DataFrame]:
    summaries = [json.loads(Path(p).read_text()) for p in summary_paths]
    summaries = [s for s in summaries if s.get("strategy") in PIPELINE_STRATEGIES]
    rows = [row for s in summaries for row in run_rows(s)]
    timeline = [row for s in summaries for row in timeline_rows(s)]
    return {"pipeline": pd.DataFrame(rows, columns=COLUMNS),
            "pipeline_timeline": pd.DataFrame(timeline, columns=TIMELINE_COLUMNS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlab.tables.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("summaries", nargs="*", type=Path)
    args = parser.parse_args(argv)
    write_tables(build_tables(args.summaries), args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
