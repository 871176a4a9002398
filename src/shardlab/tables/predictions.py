"""The planner against this study's own runs: every run of the DAG that finished gets the unified
cost model's prediction (costs.predict) for its strategy's plan (the registry's `plan_fields`), on
this machine as calibrated by the DAG itself:
- compute: each experiment's reference run (one process, no communication) gives the rate;
- concurrency: ranks sharing this machine's cores compute slower than one process alone. The
  factor is measured on the data-parallel runs that time all their communication (compute = step -
  communication, on 1/W of the reference's work); with more ranks than cores they time-share;
- collectives: the communication benchmark's alpha-beta fit (`comm_fit`); nothing overlaps on CPU.
The calibration runs are marked; every other run is a prediction.

- run_predictions: per run, the fullest rank's model-state and activation bytes (predicted: the runs
  step's `rank_predictions`) and the step time, measured vs predicted, with the signed errors
  (`tables.prediction_error`).
- run_prediction_ranking: per experiment, the step-time error of the predicted runs and how well
  the predicted step times order the runs: Spearman's rho, and over the pairs whose measured
  difference exceeds the run-to-run noise (`timing_noise`; 95 %), how many the prediction orders
  the same way.
- run_prediction_summary: mean and worst absolute error of the memory predictions beside their goals.
- gpu_measured: the newest GPU check kept in the repository (reports/gpu/), as its record has it
  (`tables.gpu_check`): what each run measured on the GPU, and the planner's error before and after
  calibration on it.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd

from shardlab.core.step_stats import run_to_run_sigma
from shardlab.costs.alpha_beta import models_from_table
from shardlab.costs.plan import Cluster
from shardlab.costs.predict import Prediction, evaluate
from shardlab.science.measures import spearman
from shardlab.strategies import REGISTRY, Family
from shardlab.tables import TableInputs, gpu_check
from shardlab.tables.prediction_error import error_pct
from shardlab.tables.rank_predictions import of_run, run_setting
from shardlab.tables.rank_predictions import read as read_predictions

MACHINE = "CPU (calibrated)"
STACK = "shardlab"  # this project's runner (costs/stacks.yaml)
GOALS_PCT = {"model_states": 1.0, "activations": 10.0}  # step time is judged per experiment (ranking table)
STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")


def this_machine(world: int, collectives: dict, fp32_tflops: float = 1.0) -> Cluster:
    """The calibrated CPU: one 'node' of `world` ranks, compute at `fp32_tflops` (all of a step's
    compute time, element-wise work included), collectives from the benchmark's fit."""
    return Cluster(MACHINE, 1, world, overrides={"fp32_tflops": fp32_tflops, "bf16_tflops": fp32_tflops, "gemm": 1.0,
                                                 "gemm_half_width": 0.0, "elementwise_passes": 0.0, "hbm": 1.0,
                                                 "alpha_beta": collectives})


def calibrated_tflops(reference: dict, setting: tuple, collectives: dict) -> float:
    """The compute rate that makes the planner reproduce the reference run's step time."""
    model, plan, workload = setting
    unit = evaluate(model, plan, this_machine(1, collectives), workload, STACK)
    other = unit.step_s - unit.time["compute"]
    return unit.time["compute"] / max(reference["step_time_median_s"] - other, 1e-9)


def predicted_memory(predictions: pd.DataFrame, summary: dict) -> tuple[float, float]:
    """(model-state bytes, activation bytes) of the run's fullest rank, from `rank_predictions`."""
    mine = of_run(predictions, summary["experiment"], summary["strategy"])
    return mine["predicted_model_state_bytes"].max(), mine["predicted_activation_bytes"].max()


def concurrency(inputs: TableInputs) -> tuple[dict[int, float], set]:
    """{world size: per-rank compute rate relative to one process alone}, and the runs it came from."""
    ok = {(s["experiment"], s["strategy"]): s for s in inputs.summaries if s["status"] == "ok"}
    factors: dict[int, list[float]] = {}
    used = set()
    for (experiment, strategy), s in ok.items():
        spec = REGISTRY[strategy]
        reference = ok.get((experiment, spec.reference))
        if (spec.family != Family.DATA_PARALLEL or not spec.comm_timed_in_full or s.get("comm_time_median_s") is None
                or reference is None or s is reference):
            continue
        compute = s["step_time_median_s"] - s["comm_time_median_s"]
        factors.setdefault(s["world_size"], []).append(reference["step_time_median_s"] / s["world_size"] / compute)
        used.add((experiment, strategy))
    return {w: float(np.median(f)) for w, f in factors.items()}, used


def concurrency_at(world: int, factors: dict[int, float], cores: int) -> float:
    """The measured factor at `world`, else the nearest measured smaller world's, time-shared beyond the cores."""
    if world <= 1:
        return 1.0
    if world in factors:
        return factors[world]
    known = max((w for w in factors if w < world), default=None)
    base = factors[known] if known else 1.0
    return base * min(1.0, max(known or 1, cores) / world)


def prediction_rows(inputs: TableInputs, collectives: dict) -> list[dict]:
    ok = [s for s in inputs.summaries if s["status"] == "ok"]
    by_run = {(s["experiment"], s["strategy"]): s for s in ok}
    factors, calibration = concurrency(inputs)
    predictions = read_predictions(inputs)
    rows = []
    for s in ok:
        exp = inputs.experiment(s)
        setting = run_setting(s, exp, inputs)
        reference = by_run.get((s["experiment"], REGISTRY[s["strategy"]].reference))
        if reference is None:
            continue  # no reference run to calibrate the compute rate on
        cores = s.get("environment", {}).get("cpu_cores") or s["world_size"]
        rate = concurrency_at(s["world_size"], factors, cores)
        tflops = calibrated_tflops(reference, run_setting(reference, exp, inputs), collectives) * rate
        model, plan, workload = setting
        p = evaluate(model, plan, this_machine(s["world_size"], collectives, tflops), workload, STACK)
        if not isinstance(p, Prediction):
            rows.append({"experiment": s["experiment"], "strategy": s["strategy"], "plan": plan.label(), "why": p,
                         "is_calibration_run": False})
            continue
        states, activations = predicted_memory(predictions, s)
        measured_states = max(sum(r[k] for k in STATES) for r in s["ranks"])
        # Pipelines record their peak live activations over the schedule; one forward's saved bytes elsewhere.
        measured_act = max(r.get("pp_peak_live_activation_bytes") or r.get("activation_bytes") or 0 for r in s["ranks"])
        rows.append({"experiment": s["experiment"], "strategy": s["strategy"], "plan": plan.label(),
                     "calibrated_flops_per_s": tflops * 1e12, "core_sharing_ratio": rate,
                     "measured_model_state_bytes": measured_states, "predicted_model_state_bytes": states,
                     "model_states_error_pct": error_pct(measured_states, states),
                     "measured_activation_bytes": measured_act, "predicted_activation_bytes": activations,
                     "activations_error_pct": error_pct(measured_act, activations),
                     "measured_step_s": s["step_time_median_s"], "predicted_step_s": p.step_s,
                     "step_time_error_pct": error_pct(s["step_time_median_s"], p.step_s),
                     "predicted_bottleneck": p.bottleneck,
                     "is_calibration_run": s is reference or (s["experiment"], s["strategy"]) in calibration})
    return rows


def ranking_rows(rows: pd.DataFrame, sigma: float) -> list[dict]:
    """Per experiment, the step-time error of the predicted runs and how the predictions order the runs.
    Every column derives from timings and says so in its name (table comparisons skip timings)."""
    out = []
    for experiment, group in rows.dropna(subset=["measured_step_s"]).groupby("experiment", sort=False):
        measured, predicted = group["measured_step_s"].to_numpy(), group["predicted_step_s"].to_numpy()
        decidable = concordant = 0
        for i, j in itertools.combinations(range(len(group)), 2):
            if abs(math.log(measured[i] / measured[j])) > 1.96 * sigma:
                decidable += 1
                concordant += (measured[i] > measured[j]) == (predicted[i] > predicted[j])
        errors = group.loc[~group["is_calibration_run"].astype(bool), "step_time_error_pct"].abs()
        out.append({"experiment": experiment, "runs": len(group),
                    "step_time_mean_abs_error_pct": errors.mean() if len(errors) else math.nan,
                    "step_time_worst_abs_error_pct": errors.max() if len(errors) else math.nan,
                    "step_time_spearman_rho": spearman(measured, predicted),
                    "step_time_noise_sigma": sigma, "step_time_pairs": len(group) * (len(group) - 1) // 2,
                    "step_time_pairs_beyond_noise": decidable, "step_time_pairs_ordered_as_measured": concordant})
    return out


def summary_rows(rows: pd.DataFrame) -> list[dict]:
    out = []
    for quantity, goal in GOALS_PCT.items():
        errors = rows[f"{quantity}_error_pct"].abs().dropna()
        out.append({"quantity": quantity, "runs": len(errors), "mean_abs_error_pct": errors.mean(),
                    "worst_abs_error_pct": errors.max(), "goal_pct": goal,
                    "meets_goal": bool(errors.max() <= goal) if len(errors) else None})
    return out


# Column names keep a table readable when it has no rows (e.g. no experiment with three runs to rank).
RANKING_COLUMNS = ["experiment", "runs", "step_time_mean_abs_error_pct", "step_time_worst_abs_error_pct",
                   "step_time_spearman_rho", "step_time_noise_sigma", "step_time_pairs", "step_time_pairs_beyond_noise",
                   "step_time_pairs_ordered_as_measured"]
SUMMARY_COLUMNS = ["quantity", "runs", "mean_abs_error_pct", "worst_abs_error_pct", "goal_pct", "meets_goal"]


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    collectives = models_from_table(inputs.tables["comm_fit"]) if "comm_fit" in inputs.tables else {}
    rows = pd.DataFrame(prediction_rows(inputs, collectives))
    sigma = run_to_run_sigma(inputs.tables.get("timing_noise"))
    ok = rows.dropna(subset=["predicted_step_s"]) if "predicted_step_s" in rows else rows.iloc[0:0]
    return {"run_predictions": rows,
            "run_prediction_ranking": pd.DataFrame(ranking_rows(ok, sigma) if len(ok) else [], columns=RANKING_COLUMNS),
            "run_prediction_summary": pd.DataFrame(summary_rows(ok) if len(ok) else [], columns=SUMMARY_COLUMNS),
            "gpu_measured": gpu_check.table(inputs.records)}
