"""Communication: each run's plan and its share of step time, a what-if model of step time per
network link, the plans at the study's scale, and the benchmark's alpha-beta fit curves.

- comm_volume: one row per (run, call of its plan); a run without a known plan gets one row, plan = unknown.
- comm_share: per successful run, communication time (measured or predicted, labelled), its share
  of the median step time (`comm_share`), the alpha-beta prediction's share (`predicted_share`) and,
  where the run times its whole communication (`comm_whole`; the registry's `comm_timed_in_full`),
  the idle benchmark's error against the measurement (`model_rel_err`) and the in-training calibration
  held out: the prediction times the median measured/predicted ratio of the *other* such runs
  (`training_ratio`), its error (`calibrated_rel_err`) against the benchmark fit's own largest error
  for the run's collectives (`tolerance_rel_err`, `rel_err_within_tolerance`).
- comm_whatif: predicted step time per (run, link, overlap assumption).
- comm_projection: communication seconds per step of every registered multi-process strategy at the
  study's scale, per link; strategies with the same plan there share a `plan_group`.
- comm_fit_curve: each fitted collective's alpha-beta time over its benchmarked size range.

A MODEL, never a measurement, on stated assumptions:
- compute time = measured median step time - communication time, where communication time is the
  run's own timed blocking waits when it records them (hand-written strategies), else the
  alpha-beta prediction of its Plan's collectives (`costs.predict.collectives`) with the benchmark's fitted parameters,
  times the in-training factor (median measured/predicted over the runs that time their whole
  communication: in training, ranks reach a collective at different moments and share the cores with
  compute, which an idle benchmark does not see);
- on another link, communication is costed by `costs.network` (the bus bandwidth NCCL reaches on it and NCCL's latency model, hardware.yaml);
- step time is bounded by two overlap assumptions: none (compute + communication) and perfect
  (max(compute, communication)); real overlap lies between;
- compute does not change with the link (same devices), and what the plan does not count
  (see `costs.comm_volume`) is ignored.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from shardlab.costs.alpha_beta import models_from_table
from shardlab.costs.comm_volume import Call, bytes_per_rank
from shardlab.costs.plan import Workload
from shardlab.costs.predict import collectives
from shardlab.costs.network import LINKS, MEASURED_LINK, Link, plan_seconds
from shardlab.costs.shapes import ModelShape
from shardlab.strategies import REGISTRY, get_spec
from shardlab.tables import TableInputs
from shardlab.tables.prediction_error import relative_error
from shardlab.tables.rank_predictions import run_setting

Plans = dict[tuple[str, str], "list[Call] | None"]

VOLUME_COLUMNS = ["experiment", "strategy", "world_size", "plan", "collective", "purpose", "size_bytes", "count",
                  "group_size", "bus_bytes"]
SHARE_COLUMNS = ["experiment", "strategy", "world_size", "step_time_s", "bytes_per_rank", "comm_measured_s",
                 "comm_predicted_s", "comm_s", "comm_source", "comm_share", "compute_s", "predicted_share",
                 "comm_whole", "model_rel_err", "training_ratio", "calibrated_rel_err", "tolerance_rel_err",
                 "rel_err_within_tolerance"]
WHATIF_COLUMNS = ["experiment", "strategy", "link", "bandwidth_GBps", "overlap", "compute_s", "comm_s",
                  "predicted_step_s", "measured_step_s", "link_order"]
CURVE_COLUMNS = ["collective", "world_size", "size_bytes", "time_s"]


def _value(row: dict, column: str):
    value = row.get(column)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def run_world(run: dict, exp: dict | None) -> int | None:
    """The run's process count: recorded in its summary, else what its experiment asks for (None if 'auto')."""
    world = _value(run, "world_size") or (exp and get_spec(run["strategy"]).world_size(exp))
    return None if world in (None, "auto") else int(world)


def run_plan(run: dict, exp: dict, inputs: TableInputs) -> list[Call] | None:
    """The calls the run's Plan makes per step (`costs.predict.collectives`); None when the model shape is unknown."""
    world = run_world(run, exp)
    if inputs.model_shape(exp) is None or world is None:
        return None
    return collectives(*run_setting({"strategy": run["strategy"], "world_size": world}, exp, inputs))


def run_plans(runs: pd.DataFrame, inputs: TableInputs) -> Plans:
    """{(experiment, strategy): plan} of every run whose experiment is known (None: plan unknown)."""
    plans = {}
    for run in runs.to_dict("records"):
        exp = inputs.experiments.get(run["experiment"])
        if exp is not None:
            plans[run["experiment"], run["strategy"]] = run_plan(run, exp, inputs)
    return plans


def volume_table(runs: pd.DataFrame, experiments: dict[str, dict], plans: Plans) -> pd.DataFrame:
    rows = []
    for run in runs.to_dict("records"):
        plan = plans.get((run["experiment"], run["strategy"]))
        key = {"experiment": run["experiment"], "strategy": run["strategy"],
               "world_size": run_world(run, experiments.get(run["experiment"]))}
        if plan is None:
            rows.append(dict(key, plan="unknown"))
        for call in plan or []:
            rows.append(dict(key, plan="known", collective=call.collective, purpose=call.purpose, size_bytes=call.size_bytes,
                             count=call.count, group_size=call.group_size, bus_bytes=call.bus_bytes))
    return pd.DataFrame(rows, columns=VOLUME_COLUMNS)


def _training_ratio(rows: list[dict], leave_out: dict | None = None) -> float | None:
    """Median measured / idle-predicted communication over the runs that time all of theirs (but one)."""
    ratios = [r["comm_measured_s"] / r["comm_predicted_s"] for r in rows
              if r is not leave_out and r["comm_whole"] and r["comm_predicted_s"]]
    return float(np.median(ratios)) if ratios else None


def _tolerance(plan: list[Call] | None, fits: pd.DataFrame) -> float | None:
    """The benchmark fit's largest relative error over the collectives a plan uses: what the model claims."""
    if not plan or "rel_err_max" not in fits:
        return None
    used = fits[fits["collective"].isin({c.collective for c in plan if c.group_size > 1}) & (fits["status"] == "ok")]
    return None if used.empty else float(used["rel_err_max"].max())


def _measured_row(run: dict, plan: list[Call] | None, models, fits: pd.DataFrame) -> dict:
    predicted = plan_seconds(plan, models) if plan is not None else None
    measured = _value(run, "comm_time_median_s")
    whole = measured is not None and bool(plan) and get_spec(run["strategy"]).comm_timed_in_full
    return {"experiment": run["experiment"], "strategy": run["strategy"], "world_size": int(run["world_size"]),
            "step_time_s": float(run["step_time_median_s"]), "bytes_per_rank": bytes_per_rank(plan),
            "comm_measured_s": measured, "comm_predicted_s": predicted, "comm_whole": whole,
            "model_rel_err": relative_error(measured, predicted) if whole and predicted is not None and measured else None,
            "tolerance_rel_err": _tolerance(plan, fits)}


def _communication(row: dict, plan: list[Call] | None, factor: float | None) -> tuple:
    """(seconds, source) of a run's communication: measured where the run timed it, else predicted."""
    if plan == []:
        return 0.0, "none (one process)"
    if row["comm_measured_s"] is not None:
        return float(row["comm_measured_s"]), "measured (timed blocking waits)"
    if row["comm_predicted_s"] is not None and factor is not None:
        return row["comm_predicted_s"] * factor, "predicted (alpha-beta, in-training factor)"
    if row["comm_predicted_s"] is not None:
        return row["comm_predicted_s"], "predicted (alpha-beta)"
    return None, "unknown"


def share_table(runs: pd.DataFrame, plans: Plans, fits: pd.DataFrame) -> pd.DataFrame:
    """Per successful run: communication time (measured or predicted, labelled) and its share of step time."""
    models = models_from_table(fits)
    ok = [r for r in runs.to_dict("records") if r.get("status") == "ok" and (r["experiment"], r["strategy"]) in plans]
    rows = [_measured_row(run, plans[run["experiment"], run["strategy"]], models, fits) for run in ok]
    factor = _training_ratio(rows)
    for row in rows:
        step, predicted = row["step_time_s"], row["comm_predicted_s"]
        comm, source = _communication(row, plans[row["experiment"], row["strategy"]], factor)
        row.update(comm_s=comm, comm_source=source, comm_share=None if comm is None else min(comm / step, 1.0),
                   compute_s=None if comm is None else max(step - comm, 0.0),
                   predicted_share=None if predicted is None else min(predicted / step, 1.0))
        held_out = _training_ratio(rows, leave_out=row) if row["model_rel_err"] is not None else None
        if held_out is not None:
            error = relative_error(row["comm_measured_s"], predicted * held_out)
            row.update(training_ratio=held_out, calibrated_rel_err=error,
                       rel_err_within_tolerance=None if row["tolerance_rel_err"] is None
                       else abs(error) <= row["tolerance_rel_err"])
    return pd.DataFrame(rows, columns=SHARE_COLUMNS)


def _scenarios(fits: pd.DataFrame, links: list[Link]) -> list[tuple]:
    """(order, link name, bandwidth, the link or alpha-beta models): this machine's fit first, then the
    links by bandwidth."""
    measured = [(0, MEASURED_LINK, None, models_from_table(fits))]
    return measured + [(k, link.name, link.bandwidth_GBps, link) for k, link in enumerate(links, 1)]


def whatif_table(share: pd.DataFrame, plans: Plans, fits: pd.DataFrame, links: list[Link] = LINKS) -> pd.DataFrame:
    """Predicted step time per (run, link, overlap assumption), from measured compute + modelled communication."""
    scenarios = _scenarios(fits, links)
    rows = []
    for run in share.to_dict("records"):
        plan = plans.get((run["experiment"], run["strategy"]))
        if _value(run, "compute_s") is None or plan is None:
            continue
        compute = float(run["compute_s"])
        for order, name, bandwidth, models in scenarios:
            comm = plan_seconds(plan, models)
            if comm is None:
                continue
            for overlap, step in (("none", compute + comm), ("perfect", max(compute, comm))):
                rows.append({"experiment": run["experiment"], "strategy": run["strategy"], "link": name,
                             "bandwidth_GBps": bandwidth, "overlap": overlap, "compute_s": compute, "comm_s": comm,
                             "predicted_step_s": step, "measured_step_s": run["step_time_s"], "link_order": order})
    return pd.DataFrame(rows, columns=WHATIF_COLUMNS)


# The study's scale: the Pythia-6.9B shape it fine-tunes, on 8 ranks, bf16 activations, 32 sequences of 2048
# tokens per step in micro-batches of 1. Communication only: no compute time exists at this scale here.
PROJECTION_LABEL = "Pythia-6.9B shape, 8 ranks, 32 x 2048 tokens/step, bf16 (gradients as each framework sends them)"
PROJECTION_MODEL = ModelShape(vocab_size=50432, hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=16384)
PROJECTION_TRAINING = {"global_batch_size": 32, "seq_len": 2048, "micro_batch_size": 1, "dtype": "bf16",
                       "optimizer": "adamw"}


def projection_plans(world: int) -> dict[str, list[Call]]:
    """Every registered multi-process strategy's calls at the study's scale, with its default options."""
    exp = {"training": PROJECTION_TRAINING}
    return {name: collectives(spec.run_model(PROJECTION_MODEL, exp), spec.run_plan(exp, world),
                              Workload.from_training(PROJECTION_TRAINING))
            for name, spec in REGISTRY.items() if not spec.single_process}


def plan_groups(plans: dict[str, list[Call]]) -> dict[str, list[str]]:
    """{strategy: the strategies (registry order) whose plan is identical to its own}."""
    by_plan: dict[tuple, list[str]] = {}
    for name, plan in plans.items():
        by_plan.setdefault(tuple(plan), []).append(name)
    return {name: names for names in by_plan.values() for name in names}


def projection_table(world: int = 8, links: list[Link] = LINKS) -> pd.DataFrame:
    """Communication seconds per step of each strategy at the study's scale, per link (a model)."""
    plans = projection_plans(world)
    groups = plan_groups(plans)
    rows = []
    for strategy, plan in plans.items():
        for order, link in enumerate(links, 1):
            rows.append({"scenario": PROJECTION_LABEL, "strategy": strategy, "world_size": world, "link": link.name,
                         "bandwidth_GBps": link.bandwidth_GBps, "bytes_per_rank": bytes_per_rank(plan),
                         "calls_per_step": sum(c.count for c in plan), "comm_s": plan_seconds(plan, link),
                         "family": REGISTRY[strategy].family, "plan_group": ", ".join(groups[strategy]),
                         "group_representative": groups[strategy][0] == strategy, "link_order": order})
    return pd.DataFrame(rows)


def fit_curve_table(fits: pd.DataFrame, points: int = 61) -> pd.DataFrame:
    """Each fitted collective's t = alpha + size x bus factor / beta on a log grid over its measured sizes."""
    rows = []
    for fit in fits[fits["status"] == "ok"].itertuples():
        for k in range(points):
            size = fit.min_bytes * (fit.max_bytes / fit.min_bytes) ** (k / (points - 1))
            rows.append({"collective": fit.collective, "world_size": fit.world_size, "size_bytes": size,
                         "time_s": fit.alpha_s + size * fit.bus_factor / (fit.beta_GBps * 1e9)})
    return pd.DataFrame(rows, columns=CURVE_COLUMNS)


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    runs, fits = inputs.tables["runs"], inputs.tables["comm_fit"]
    plans = run_plans(runs, inputs)
    share = share_table(runs, plans, fits)
    return {"comm_volume": volume_table(runs, inputs.experiments, plans), "comm_share": share,
            "comm_whatif": whatif_table(share, plans, fits), "comm_projection": projection_table(),
            "comm_fit_curve": fit_curve_table(fits)}
