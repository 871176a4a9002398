"""Science runs and domain metrics -> the tidy tables the report's science section reads.

- science_curves.csv: one row per validation point (experiment, domain, strategy, step, elapsed_s, val_loss)
- science_runs.csv:   one row per run (status, tokens/s, step time, peak memory, final validation
                      loss, time to the domain's target validation loss)
- science_metrics.csv: the evaluators' rows, concatenated
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from shardlab.science.formats import FORMATS


def read_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def time_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    """Wall seconds at the first validation point with loss <= target (None if never reached)."""
    return next((t for t, loss in curve if loss <= target), None)


def run_rows(exp: dict, runs_dir: Path) -> tuple[list[dict], list[dict]]:
    """(runs, curves) of one experiment; time-to-target needs all its runs, so it is filled here."""
    domain = FORMATS[exp["data"]["format"]].domain
    runs, curves, per_run_curve = [], [], {}
    for strategy in exp["strategies"]:
        run = runs_dir / strategy
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        ranks = [r for r in summary.get("ranks") or [] if r]
        points = [r for r in read_steps(run / "metrics.jsonl") if r.get("val_loss") is not None]
        per_run_curve[strategy] = [(r["elapsed_s"], r["val_loss"]) for r in points]
        curves += [{"experiment": exp["name"], "domain": domain, "strategy": strategy, "step": r["step"] + 1,
                    "elapsed_s": r["elapsed_s"], "val_loss": r["val_loss"]} for r in points]
        runs.append({
            "experiment": exp["name"], "domain": domain, "strategy": strategy,
            "status": summary.get("status", "missing"), "reason": summary.get("reason"),
            "world_size": summary.get("world_size"), "steps": summary.get("steps"),
            "tokens_per_s": summary.get("tokens_per_s"), "step_time_median_s": summary.get("step_time_median_s"),
            "peak_bytes_max_rank": max((r.get("peak_bytes") or 0 for r in ranks), default=None),
            "peak_kind": ranks[0].get("peak_kind") if ranks else None,
            "final_val_loss": summary.get("final_val_loss"),
        })
    finals = [r["final_val_loss"] for r in runs if r["status"] == "ok" and r["final_val_loss"] is not None]
    target = (exp.get("evaluation") or {}).get("target_val_loss") or (max(finals) if finals else None)
    for row in runs:
        row["target_val_loss"] = target
        curve = per_run_curve[row["strategy"]]
        row["time_to_target_s"] = time_to_target(curve, target) if target is not None and row["status"] == "ok" else None
    return runs, curves


def write_csv(rows: list[dict], path: Path, columns: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


RUN_COLUMNS = ["experiment", "domain", "strategy", "status", "reason", "world_size", "steps", "tokens_per_s",
               "step_time_median_s", "peak_bytes_max_rank", "peak_kind", "final_val_loss", "target_val_loss",
               "time_to_target_s"]
CURVE_COLUMNS = ["experiment", "domain", "strategy", "step", "elapsed_s", "val_loss"]


def build_tables(experiment_configs: list[Path], results_dir: Path, metric_files: list[Path], out_dir: Path) -> None:
    from shardlab.science.evaluate import COLUMNS

    runs, curves = [], []
    for path in experiment_configs:
        exp = json.loads(Path(path).read_text())
        r, c = run_rows(exp, Path(results_dir) / exp["name"] / "runs")
        runs += r
        curves += c
    metrics = []
    for path in metric_files:
        with open(path, newline="") as fh:
            metrics += list(csv.DictReader(fh))
    write_csv(runs, out_dir / "science_runs.csv", RUN_COLUMNS)
    write_csv(curves, out_dir / "science_curves.csv", CURVE_COLUMNS)
    write_csv(metrics, out_dir / "science_metrics.csv", COLUMNS)


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab.tables.science --results DIR --out-dir DIR --experiments A.json ... --metrics A.csv ...`"""
    import argparse

    parser = argparse.ArgumentParser(prog="shardlab.tables.science")
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--experiments", type=Path, nargs="+", required=True, help="resolved experiment JSONs")
    parser.add_argument("--metrics", type=Path, nargs="+", required=True, help="per-experiment metric CSVs")
    args = parser.parse_args(argv)
    build_tables(args.experiments, args.results, args.metrics, args.out_dir)
    print(f"science tables ({len(args.experiments)} experiments) -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
