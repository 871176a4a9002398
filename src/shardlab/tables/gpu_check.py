"""The GPU check's record (scripts/gpu-check.sh on config/gpu-check.yaml): what each run measured on the
GPU beside what this project's models predicted for it, kept as reports/gpu/<date>-<device>.json and .md.

Per run:
- throughput: tokens/s, and MFU against the device's dense peak for the run's dtype (`costs.hardware`);
- memory: the allocator's peak, and the fullest rank's bytes per category (parameters, gradients,
  optimizer state, activations) beside the memory model's prediction (`rank_predictions`), signed error;
- parity: the largest loss deviation from single device and the parity rule's tolerance (`tables.parity`);
- the planner: the run's plan on the catalogued accelerator under this project's stack (`costs.predict`):
  the device bytes of its fullest rank against the allocator's peak, and the step time,
  first with the catalog's efficiencies, never fitted to this GPU ("before"), then with the compute rate
  that reproduces the single-device run ("after": the catalog's dense peak and HBM bandwidth scaled by
  one factor, `calibrated_speed`; that run is then the calibration point and the others are held out).
"""

from __future__ import annotations

import math
import re

import pandas as pd

from shardlab.costs import hardware
from shardlab.costs.plan import Cluster
from shardlab.costs.predict import Prediction, evaluate
from shardlab.strategies import roles
from shardlab.tables import TableInputs
from shardlab.tables.prediction_error import relative_error
from shardlab.tables.rank_predictions import run_setting

STACK = "shardlab"  # this project's runner (costs/stacks.yaml)
CALIBRATION_RUN = roles.the_reference()  # the single device: no communication, the compute rate alone
CATEGORIES = {"param": "param_bytes", "grad": "grad_bytes", "optimizer": "optimizer_bytes",
              "activation": "activation_bytes"}
TABLES = ("runs", "ranks", "rank_predictions", "parity")
ENVIRONMENT = ("device_name", "torch", "cuda", "nccl", "deepspeed", "transformers", "python", "git_commit", "git_dirty")


def _number(value):
    """A plain Python value for the JSON record: numpy scalars as Python numbers, NaN as None."""
    value = value.item() if hasattr(value, "item") else value
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def memory(run: dict, ranks: pd.DataFrame, predicted: pd.DataFrame) -> dict:
    """The fullest rank's allocator peak and bytes per category, measured and predicted, with the error."""
    mine = ranks[(ranks["experiment"] == run["experiment"]) & (ranks["strategy"] == run["strategy"])]
    if mine.empty:
        return {}
    fullest = mine.sort_values(["param_bytes", "peak_bytes"]).iloc[-1]  # of equal replicas, the highest peak
    model = predicted[(predicted["experiment"] == run["experiment"]) & (predicted["strategy"] == run["strategy"])
                      & (predicted["rank"] == fullest["rank"])]
    out = {"peak_bytes": fullest["peak_bytes"], "peak_kind": fullest["peak_kind"]}
    for category, column in CATEGORIES.items():
        measured = fullest[column]
        guess = model[f"predicted_{column}"].item() if len(model) else None
        out[f"{category}_bytes"], out[f"predicted_{category}_bytes"] = measured, _number(guess)
        out[f"{category}_error"] = relative_error(measured, guess) if _number(guess) is not None and measured else None
    return out


def parity(run: dict, table: pd.DataFrame) -> dict:
    match = table[(table["experiment"] == run["experiment"]) & (table["strategy"] == run["strategy"])]
    if match.empty:
        return {}
    m = match.iloc[0]
    verdict = _number(m["within_tolerance"])
    return {"max_loss_deviation": m["max_loss_deviation"], "tolerance": m["tolerance"],
            "tolerance_fraction": m["tolerance_fraction"], "noise_floor": m["noise_floor"],
            "within_tolerance": None if verdict is None else bool(verdict),
            "undecided": _number(m["undecided"]) if verdict is None else None}


def planner(runs: list[dict], inputs: TableInputs) -> dict[str, dict]:
    """Per run, the planner's step time, tokens/s and MFU with the catalog's efficiencies ('before') and
    with the compute rate calibrated on the single-device run ('after'), each with its error; and the
    device bytes it predicts for the fullest rank (against the allocator's peak in `record`)."""
    settings, clusters = {}, {}
    for run in runs:
        entry = hardware.accelerator(str(run["environment.device_name"]))
        if entry is not None:
            settings[run["strategy"]] = run_setting(run, inputs.experiment(run), inputs)
            clusters[run["strategy"]] = Cluster(entry["name"], 1, int(run["world_size"]))
    before = {s: _predict(settings[s], clusters[s]) for s in settings}
    reference = next((r for r in runs if r["strategy"] == CALIBRATION_RUN and r["strategy"] in settings), None)
    speed = _calibrated_speed(reference, settings, clusters) if reference else None
    out = {}
    for run in runs:
        s = run["strategy"]
        if s not in settings:
            continue
        out[s] = {**_versus(run, before[s], "before"), "calibrated_speed": speed,
                  "calibration_run": s == CALIBRATION_RUN}
        if isinstance(before[s], Prediction):  # memory does not depend on the speed: one prediction
            out[s].update(planner_device_bytes=before[s].device_bytes, planner_fits=before[s].fits)
        if speed is not None:
            out[s].update(_versus(run, _predict(settings[s], _faster(clusters[s], speed)), "after"))
    return out


def _predict(setting: tuple, cluster: Cluster) -> Prediction | str:
    model, plan, workload = setting
    return evaluate(model, plan, cluster, workload, STACK)


def _faster(cluster: Cluster, speed: float) -> Cluster:
    """The cluster with its compute and memory rates (dense peak, HBM bandwidth) at `speed` x the catalog's."""
    return cluster.scaled(bf16_tflops=speed, fp32_tflops=speed, hbm_tbps=speed)


def _calibrated_speed(reference: dict, settings: dict, clusters: dict) -> float | None:
    """The factor on the catalog's rates at which the planner reproduces the reference run's step time
    (bisection on a log scale: the predicted step time falls as the rates rise)."""
    def step_s(speed: float) -> float:
        p = _predict(settings[CALIBRATION_RUN], _faster(clusters[CALIBRATION_RUN], speed))
        return p.step_s if isinstance(p, Prediction) else math.nan

    low, high = 1e-4, 1e4
    if not step_s(high) <= reference["step_time_median_s"] <= step_s(low):
        return None  # no rate within eight decades of the catalog's explains it
    for _ in range(200):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if step_s(mid) > reference["step_time_median_s"] else (low, mid)
        if high / low < 1 + 1e-12:
            break
    return math.sqrt(low * high)


def _versus(run: dict, p: Prediction | str, when: str) -> dict:
    if not isinstance(p, Prediction):
        return {f"planner_{when}_why": p}
    return {f"planner_{when}_step_s": p.step_s, f"planner_{when}_tokens_per_s": p.tokens_per_s,
            f"planner_{when}_mfu": p.mfu, f"planner_{when}_plan": p.plan.label(),
            f"planner_{when}_error": relative_error(run["step_time_median_s"], p.step_s)}


def record(inputs: TableInputs) -> dict:
    """The check's whole record: when, where (the environment of its runs) and one row per run."""
    t = inputs.tables
    runs = t["runs"].to_dict("records")
    ok = [r for r in runs if r["status"] == "ok"]
    planned = planner(ok, inputs)
    rows = []
    for run in runs:
        exp = inputs.experiment(run)
        row = {"strategy": run["strategy"], "status": run["status"], "reason": _number(run.get("reason")),
               "world_size": int(run["world_size"])}
        if run["status"] == "ok":
            model, training = inputs.model_shape(exp), exp["training"]
            flops = hardware.training_flops_per_token(model.matmul_parameters(), model.num_layers, model.hidden_size,
                                                      training["seq_len"])
            peak = hardware.device_peak_flops(str(run["environment.device_name"]), training["dtype"])
            row.update(tokens_per_s=run["tokens_per_s"], step_time_median_s=run["step_time_median_s"],
                       mfu=run["tokens_per_s"] * flops / (peak * run["world_size"]) if peak else None,
                       **memory(run, t["ranks"], t["rank_predictions"]), **parity(run, t["parity"]),
                       **planned.get(run["strategy"], {}))
            if "planner_device_bytes" in row and row.get("peak_bytes"):
                row["planner_device_bytes_error"] = relative_error(row["peak_bytes"], row["planner_device_bytes"])
        rows.append({k: _number(v) for k, v in row.items()})
    first = ok[0] if ok else {}  # the check's runs share one machine: its environment is the first's
    return {"date": str(pd.Timestamp(min(r["started"] for r in runs)).date()) if runs else None,
            "environment": {k: _number(first.get(f"environment.{k}")) for k in ENVIRONMENT},
            "dtype": next(iter(inputs.experiments.values()))["training"]["dtype"] if inputs.experiments else None,
            "runs": rows}


def name(rec: dict) -> str:
    """reports/gpu/<name>.json: the date and the device, e.g. '2026-12-08-nvidia-h100-80gb-hbm3'."""
    device = re.sub(r"[^a-z0-9]+", "-", str(rec["environment"].get("device_name") or "unknown").lower()).strip("-")
    return f"{rec['date']}-{device}"


def failures(rec: dict) -> list[str]:
    """The runs that failed, left the single-device loss, or could not be checked."""
    return [r["strategy"] for r in rec["runs"]
            if r["status"] != "ok" or r.get("within_tolerance") is False or r.get("undecided")]


TABLE_COLUMNS = ["date", "device_name", "torch", "cuda", "nccl", "deepspeed", "git_commit", "dtype", "strategy", "status",
                 "reason", "world_size", "tokens_per_s", "mfu", "peak_bytes",
                 *[f"{c}_error" for c in CATEGORIES], "max_loss_deviation", "tolerance", "within_tolerance",
                 "planner_before_error", "planner_after_error", "calibration_run", "calibrated_speed",
                 "planner_device_bytes_error"]


def table(records: list[dict]) -> pd.DataFrame:
    """The newest record (by date) as a table, one row per run with its date and environment; no record:
    an empty table (no GPU run is kept yet)."""
    if not records:
        return pd.DataFrame(columns=TABLE_COLUMNS)
    rec = max(records, key=lambda r: r["date"])
    context = {"date": rec["date"], "dtype": rec["dtype"], **rec["environment"]}
    return pd.DataFrame([{**context, **run} for run in rec["runs"]]).reindex(columns=TABLE_COLUMNS)
