"""Composed plans' tables: what each rank of a composed run holds and its memory against the one cost
model's prediction for the run's Plan (the registry's), the runs' parity, and the plan-to-run loop.

- composed_ranks: per composed run and rank, its mesh coordinates, what it holds (pipeline stage
  units, tensor-parallel shard, context chunks, batch rows) and parameter, gradient, optimizer and
  activation bytes measured vs predicted (`costs.predict.rank_states`, `rank_activations`), with errors.
- composed_runs: per composed run, its Plan, world size, parity (from `parity`) and the worst error
  over its ranks per quantity; `ranks_over_cores` says where ranks time-shared the cores (its timing is
  not a speed).
- composed_worst: per quantity, the worst error over every composed run beside its goal.
- plan_search_runs / plan_search_ranking: the plan-to-run loop (`plan_search` in the config): the
  plans the search ranked, in its order with its predicted throughput, beside the measured and the
  calibrated step times of their runs (`run_predictions`), and how the calibrated predictions order
  the runs (`run_prediction_ranking`).
"""

from __future__ import annotations

import math

import pandas as pd

from shardlab.costs.plan import Workload
from shardlab.costs.predict import rank_activations, rank_states
from shardlab.costs.shapes import stage_units
from shardlab.strategies import REGISTRY
from shardlab.tables import TableInputs
from shardlab.tables.predictions import GOALS_PCT, STATES, error_pct

QUANTITIES = {"param_bytes": "model_states", "grad_bytes": "model_states", "optimizer_bytes": "model_states",
              "activation_bytes": "activations"}
SEARCH_COLUMNS = ["search_rank", "strategy", "plan", "searched_tokens_per_s", "searched_on", "measured_step_s",
                  "measured_rank", "calibrated_predicted_step_s", "step_time_error_pct"]
RUN_COLUMNS = ["experiment", "strategy", "plan", "world_size", "ranks_over_cores", "within_tolerance",
               "max_loss_deviation", "tolerance", "model_states_worst_error_pct", "activations_worst_error_pct"]


def is_composed(strategy: str) -> bool:
    return REGISTRY[strategy].plan is REGISTRY["composed"].plan


def holdings(plan, coords: dict, layers: int) -> str:
    """What a rank holds, in words: its stages' units, its TP shard, its context chunks."""
    parts = []
    if plan.pp > 1:
        units = stage_units(layers, plan.pp * plan.virtual_stages)
        stages = [coords["pp"] + k * plan.pp for k in range(plan.virtual_stages)]
        parts += [f"stage {s}: {' '.join(map(str, units[s]))}" for s in stages]
    else:
        parts.append("all layers")
    if plan.tp > 1:
        parts.append(f"TP shard {coords['tp'] + 1}/{plan.tp}" + (" (+SP sequence shard)" if plan.sp else ""))
    if plan.cp > 1:
        parts.append(f"sequence chunks {coords['cp']} and {2 * plan.cp - 1 - coords['cp']} of {2 * plan.cp}")
    if plan.framework == "fsdp2":  # sharded over every rank holding the same parameters: dp x cp
        parts.append(f"FSDP2 shard {coords['dp'] * plan.cp + coords['cp'] + 1}/{plan.dp * plan.cp}")
    if plan.dp > 1:
        parts.append(f"batch rows {coords['dp'] + 1}/{plan.dp}")
    return "; ".join(parts)


def rank_rows(summary: dict, inputs: TableInputs) -> list[dict]:
    exp = inputs.experiment(summary)
    spec = REGISTRY[summary["strategy"]]
    model = spec.run_model(inputs.model_shape(exp), exp)
    plan = spec.run_plan(exp, summary["world_size"])
    workload = Workload.from_training(exp["training"])
    rows = []
    for rank in summary["ranks"]:
        coords = plan.coordinates(rank["rank"])
        predicted = rank_states(model, plan, rank["rank"])
        row = {"experiment": summary["experiment"], "strategy": summary["strategy"], "plan": plan.label(),
               "rank": rank["rank"], **{f"{dim}_rank": c for dim, c in coords.items()}, "holds": holdings(plan, coords, model.num_layers)}
        for key in STATES:
            row[f"measured_{key}"], row[f"predicted_{key}"] = rank[key], getattr(predicted, key)
        # A pipeline's peak of live activations over its schedule; one forward's saved bytes elsewhere.
        row["measured_activation_bytes"] = rank.get("pp_peak_live_activation_bytes") or rank["activation_bytes"]
        row["predicted_activation_bytes"] = rank_activations(model, plan, workload, rank["rank"])
        for key in QUANTITIES:
            row[f"{key.removesuffix('_bytes')}_error_pct"] = error_pct(row[f"measured_{key}"], row[f"predicted_{key}"])
        rows.append(row)
    return rows


def run_rows(ranks: pd.DataFrame, parity: pd.DataFrame, summaries: list[dict]) -> pd.DataFrame:
    parity = parity.set_index(["experiment", "strategy"])
    rows = []
    for s in summaries:
        mine = ranks[(ranks["experiment"] == s["experiment"]) & (ranks["strategy"] == s["strategy"])]
        check = parity.loc[(s["experiment"], s["strategy"])] if (s["experiment"], s["strategy"]) in parity.index else {}
        cores = s.get("environment", {}).get("cpu_cores")
        worst = {q: max((abs(mine[f"{k.removesuffix('_bytes')}_error_pct"]).max() for k, qq in QUANTITIES.items()
                         if qq == q), default=math.nan) for q in GOALS_PCT}
        rows.append({"experiment": s["experiment"], "strategy": s["strategy"], "plan": mine["plan"].iloc[0],
                     "world_size": s["world_size"], "ranks_over_cores": bool(cores and s["world_size"] > cores),
                     "within_tolerance": check.get("within_tolerance"), "max_loss_deviation":
                     check.get("max_loss_deviation"), "tolerance": check.get("tolerance"),
                     **{f"{q}_worst_error_pct": v for q, v in worst.items()}})
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def worst_rows(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for quantity, goal in GOALS_PCT.items():
        column = f"{quantity}_worst_error_pct"
        if runs.empty:
            continue
        at = runs[column].idxmax()
        rows.append({"quantity": quantity.replace("_", " "), "runs": len(runs), "worst_abs_error_pct": runs[column].max(),
                     "worst_run": f"{runs.at[at, 'experiment']}/{runs.at[at, 'strategy']}", "goal_pct": goal,
                     "meets_goal": bool(runs[column].max() <= goal)})
    return pd.DataFrame(rows, columns=["quantity", "runs", "worst_abs_error_pct", "worst_run", "goal_pct", "meets_goal"])


def plan_search_tables(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    search = inputs.settings.get("plan_search") or {}
    experiment = search.get("experiment")
    exp = inputs.experiments.get(experiment)
    ranking = inputs.tables.get("run_prediction_ranking", pd.DataFrame(columns=["experiment"]))
    predictions = inputs.tables.get("run_predictions", pd.DataFrame(columns=["experiment", "strategy"]))
    if exp is None:
        return {"plan_search_runs": pd.DataFrame(columns=SEARCH_COLUMNS),
                "plan_search_ranking": ranking.iloc[0:0]}
    measured = predictions[predictions["experiment"] == experiment].set_index("strategy")
    rows = []
    for name, found in sorted(search.get("plans", {}).items(), key=lambda item: item[1]["search_rank"]):
        row = {"search_rank": found["search_rank"], "strategy": name, "plan": found["label"],
               "searched_tokens_per_s": found["tokens_per_s"], "searched_on": search["cluster_label"]}
        if name in measured.index:
            row.update(measured_step_s=measured.at[name, "measured_step_s"],
                       calibrated_predicted_step_s=measured.at[name, "predicted_step_s"],
                       step_time_error_pct=measured.at[name, "step_time_error_pct"])
        rows.append(row)
    runs = pd.DataFrame(rows, columns=SEARCH_COLUMNS)
    runs["measured_rank"] = runs["measured_step_s"].rank(method="min")
    return {"plan_search_runs": runs, "plan_search_ranking": ranking[ranking["experiment"] == experiment]}


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    composed = [s for s in inputs.summaries if is_composed(s["strategy"]) and s["status"] == "ok"]
    ranks = pd.DataFrame([row for s in composed for row in rank_rows(s, inputs)])
    parity = inputs.tables.get("parity", pd.DataFrame(columns=["experiment", "strategy"]))
    runs = run_rows(ranks, parity, composed) if composed else pd.DataFrame(columns=RUN_COLUMNS)
    return {"composed_ranks": ranks, "composed_runs": runs, "composed_worst": worst_rows(runs),
            **plan_search_tables(inputs)}
