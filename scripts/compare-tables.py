"""Compare two results/tables folders: same tables, same columns (new ones allowed), same values in
every deterministic column. For refactors that must not change what the study measures.

    python scripts/compare-tables.py BEFORE/results/tables AFTER/results/tables [--ignore REGEX]

The noisy columns are declared once, below, and nothing else is skipped: what a run measured with a
clock (times, throughputs, the process's resident memory), what is computed from those (ratios,
intervals, fits, calibrated predictions, verdicts and choices that a timing decides), and when and where
a run ran. Every other column is compared row by row after sorting on the columns both sides share that
identify a row. Exit status 1 when a table or column is missing or a value differs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

# Clock measurements: noisy in every table that has them.
MEASURED = {"tokens_per_s", "step_time_median_s", "step_time_s", "comm_time_s", "comm_time_median_s", "elapsed_s",
            "train_wall_s", "time_s", "latency_s", "start_s", "end_s", "busy_s", "span_s", "time_to_target_s",
            "measured_step_s", "checkpoint_s"}
# Tables the cost model writes from the configuration alone, no run measured: their `tokens_per_s`, step
# times and the like are predictions, compared like every other column (the search's wall time aside).
MODEL_ONLY = ("comm_projection", "pipeline_theory", "planning_crosscheck", "planning_published",
              "planning_published_by_source", "planning_published_by_stack", "planning_published_memory",
              "planning_rejected", "planning_scenarios", "planning_top", "planning_what_if", "planning_zero_ladder",
              "zero_plan")
# Per table, what else is noisy: derived from the measurements above, or the run's time, place and process.
_THROUGHPUT_RATIOS = ("reference_tokens_per_s", "ratio_to_reference", "ratio_to_reference_low",
                      "ratio_to_reference_high", "twin_tokens_per_s", "ratio_to_twin", "ratio_to_twin_low",
                      "ratio_to_twin_high")
_RANKING = ("step_time_mean_abs_error_pct", "step_time_worst_abs_error_pct", "step_time_spearman_rho",
            "step_time_pairs_beyond_noise", "step_time_pairs_ordered_as_measured")
NOISY = {
    "launch_cost": ("median_s", "p10_s", "p90_s"),  # every phase of a launch is a clock reading
    "runs": ("attempt", "started", "finished", "environment.git_commit", "environment.git_dirty",
             "environment.hostname", "environment.python", "startup.agent_start_s", "startup.data_and_resume_s",
             "startup.first_step_s", "startup.launch_wall_s", "startup.model_load_s", "startup.process_group_s",
             "startup.rendezvous_and_spawn_s", "startup.save_and_gather_s", "startup.strategy_setup_s",
             "startup.training_s", "startup.worker_imports_s"),
    "environments": ("python", "git_commit", "git_dirty"),
    # Process RSS (library baseline and allocator: moves between launches) and the pipeline's timed schedule.
    "ranks": ("peak_bytes", "pp_bubble_ratio", "pp_busy_s", "pp_idle_fraction", "pp_step_span_s", "pp_timeline",
              "pp_timeline_span_s"),
    "science_runs": ("peak_bytes_max_rank",),
    "comm_bench": ("algbw_GBps", "busbw_GBps"),
    "comm_fit": ("alpha_s", "beta_GBps", "r2", "rel_err_median", "rel_err_max"),
    "comm_share": ("comm_measured_s", "comm_predicted_s", "comm_s", "comm_share", "compute_s",
                   "predicted_share", "model_rel_err", "training_ratio", "calibrated_rel_err", "tolerance_rel_err",
                   "rel_err_within_tolerance"),
    "comm_whatif": ("compute_s", "comm_s", "predicted_step_s"),
    "cp_activation_ratio": ("reference_tokens_per_s",),
    "dp_buckets": ("comm_exposed_s", "comm_predicted_s", "latency_predicted_s", "ddp_tokens_per_s", "ratio_to_ddp",
                   "ratio_to_ddp_low", "ratio_to_ddp_high", "ratio_to_ddp_noise_low", "ratio_to_ddp_noise_high"),
    "dp_comm_steps": ("comm_fraction",),
    "dp_pairs": ("other_tokens_per_s", "ratio", "ratio_low", "ratio_high"),
    "dp_throughput": _THROUGHPUT_RATIOS,
    "tp_throughput": _THROUGHPUT_RATIOS,
    "tp_twins": ("twin_tokens_per_s", "ratio_to_twin", "ratio_to_twin_low", "ratio_to_twin_high", "goal_met"),
    "pipeline": ("idle_fraction", "bubble_ratio", "bottleneck", "idle_error", "idle_tolerance", "follows_theory"),
    "pipeline_hybrid": ("idle_fraction",),
    "plan_search_ranking": _RANKING,
    "run_prediction_ranking": _RANKING,
    "plan_search_runs": ("measured_rank", "calibrated_predicted_step_s", "step_time_error_pct"),
    "run_predictions": ("calibrated_flops_per_s", "core_sharing_ratio", "predicted_step_s", "step_time_error_pct",
                        "predicted_bottleneck"),
    "abstract": ("sentence",),  # states the measured speed-ups
    "planning_scenarios": ("search_s",),
}
# Long tables whose timing rows are noisy and whose other rows are not: (which rows, which columns).
NOISY_ROWS = {
    "strategy_choice": (lambda t: t["goal"] == "throughput",
                        ("choice", "versus", "ratio", "ratio_low", "ratio_high", "decided", "evidence")),
    "verdicts": (lambda t: t["measure"].astype(str).str.startswith(("tokens/s", "ratio 1a")),
                 ("ratio", "ratio_low", "ratio_high", "verdict", "evidence")),
}
KEYS = ("experiment", "strategy", "rank", "step", "component", "module", "category", "collective", "size_bytes",
        "purpose", "stage", "rung", "domain", "metric", "name", "table", "split", "world_size", "schedule", "claim",
        "goal", "quantity", "scenario", "test_set")


def noisy_columns(name: str, columns, ignore: re.Pattern | None = None) -> list[str]:
    """The columns of table `name` that are skipped whole: declared noisy, or matching `ignore`."""
    declared = (set() if name in MODEL_ONLY else MEASURED) | set(NOISY.get(name, ()))
    return [c for c in columns if c in declared or (ignore is not None and ignore.search(c))]


def _same(x: pd.Series, y: pd.Series) -> np.ndarray:
    if pd.api.types.is_numeric_dtype(x) and pd.api.types.is_numeric_dtype(y):
        return np.isclose(x.astype(float), y.astype(float), rtol=1e-9, atol=0, equal_nan=True)
    return ((x.astype(str) == y.astype(str)) | (x.isna() & y.isna())).to_numpy()


def compare_table(name: str, before: pd.DataFrame, after: pd.DataFrame, ignore: re.Pattern | None = None) -> list[str]:
    problems = []
    missing = [c for c in before.columns if c not in after.columns]
    if missing:
        problems.append(f"{name}: columns gone: {missing}")
    if len(before) != len(after):
        return problems + [f"{name}: {len(before)} rows before, {len(after)} after"]
    skipped = noisy_columns(name, before.columns, ignore)
    compared = [c for c in before.columns if c in after.columns and c not in skipped]
    keys = [k for k in KEYS if k in compared]
    b = before.sort_values(keys, kind="stable").reset_index(drop=True) if keys else before
    a = after.sort_values(keys, kind="stable").reset_index(drop=True) if keys else after
    noisy_rows, row_columns = NOISY_ROWS.get(name, (None, ()))
    exempt = noisy_rows(b).to_numpy() if noisy_rows else np.zeros(len(b), dtype=bool)
    for col in compared:
        same = _same(b[col], a[col]) | (exempt if col in row_columns else False)
        if not same.all():
            i = int(np.argmin(same))
            problems.append(f"{name}.{col}: {int((~same).sum())} of {len(same)} rows differ, e.g. row {i}: "
                            f"{b[col].iloc[i]!r} -> {a[col].iloc[i]!r}")
    return problems


def main(before_dir: str, after_dir: str, ignore: str | None = None) -> int:
    """`ignore`: a regex of further columns to skip (e.g. a setting the two runs were told to differ in)."""
    pattern = re.compile(ignore, re.IGNORECASE) if ignore else None
    before = {p.stem: p for p in Path(before_dir).glob("*.csv")}
    after = {p.stem: p for p in Path(after_dir).glob("*.csv")}
    problems = [f"table gone: {name}" for name in sorted(set(before) - set(after))]
    n_compared = n_skipped = 0
    for name in sorted(set(before) & set(after)):
        b, a = pd.read_csv(before[name]), pd.read_csv(after[name])
        found = compare_table(name, b, a, pattern)
        added = [c for c in a.columns if c not in b.columns]
        skipped = noisy_columns(name, [c for c in b.columns if c in a.columns], pattern)
        partly = [c for c in NOISY_ROWS.get(name, (None, ()))[1] if c in b.columns]
        n_skipped += len(skipped)
        n_compared += len([c for c in b.columns if c in a.columns]) - len(skipped)
        print(f"{name}: {len(b)} rows, {'OK' if not found else 'DIFFERS'}"
              + (f"; added columns {added}" if added else "")
              + (f"; noisy columns skipped {skipped}" if skipped else "")
              + (f"; timing rows skipped in {partly}" if partly else ""))
        problems += found
    for name in sorted(set(after) - set(before)):
        print(f"{name}: new table ({len(pd.read_csv(after[name]))} rows)")
    print(f"{n_compared} columns compared, {n_skipped} skipped as noisy")
    print("\n".join(problems) if problems else "same tables, columns and values apart from the noisy columns"
          + (f" and columns matching {ignore!r}" if ignore else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--ignore", help="regex of further columns to skip")
    args = parser.parse_args()
    sys.exit(main(args.before, args.after, args.ignore))
