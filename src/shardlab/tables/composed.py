"""Composed plans' tables: what each rank of a composed run holds and its memory against the one cost
model's prediction for the run's Plan (the registry's), the runs' parity, and the plan-to-run loop.

- composed_ranks: per composed run and rank, its mesh coordinates, what it holds (pipeline stage
  units, tensor-parallel shard, context chunks, batch rows) and parameter, gradient, optimizer and
  activation bytes measured vs predicted (`rank_predictions`, the runs step's), with errors.
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

from shardlab.strategies.roles import is_composed
from shardlab.tables import TableInputs
from shardlab.tables.prediction_error import error_pct
from shardlab.tables.predictions import GOALS_PCT, STATES
from shardlab.tables.rank_predictions import AXES, of_run
from shardlab.tables.rank_predictions import read as read_predictions

QUANTITIES = {"param_bytes": "model_states", "grad_bytes": "model_states", "optimizer_bytes": "model_states",
              "activation_bytes": "activations"}
SEARCH_COLUMNS = ["search_rank", "strategy", "plan", "searched_tokens_per_s", "searched_on", "measured_step_s",
                  "measured_rank", "calibrated_predicted_step_s", "step_time_error_pct"]
RUN_COLUMNS = ["experiment", "strategy", "plan", "world_size", "ranks_over_cores", "within_tolerance",
               "max_loss_deviation", "tolerance", "model_states_worst_error_pct", "activations_worst_error_pct"]


def rank_rows(summary: dict, predictions: pd.DataFrame) -> list[dict]:
    """Per rank of a finished composed run: where it sits, what it holds and its bytes, measured beside the
    cost model's prediction (`rank_predictions`)."""
    mine = of_run(predictions, summary["experiment"], summary["strategy"])
    rows = []
    for rank in summary["ranks"]:
        predicted = mine.loc[rank["rank"]]
        row = {"experiment": summary["experiment"], "strategy": summary["strategy"], "plan": predicted["plan"],
               "rank": rank["rank"], **{f"{axis}_rank": predicted[f"{axis}_rank"] for axis in AXES},
               "holds": predicted["holds"]}
        for key in STATES:
            row[f"measured_{key}"], row[f"predicted_{key}"] = rank[key], predicted[f"predicted_{key}"]
        # A pipeline's peak of live activations over its schedule; one forward's saved bytes elsewhere.
        row["measured_activation_bytes"] = rank.get("pp_peak_live_activation_bytes") or rank["activation_bytes"]
        row["predicted_activation_bytes"] = predicted["predicted_activation_bytes"]
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
    predictions = read_predictions(inputs)
    ranks = pd.DataFrame([row for s in composed for row in rank_rows(s, predictions)])
    parity = inputs.tables.get("parity", pd.DataFrame(columns=["experiment", "strategy"]))
    runs = run_rows(ranks, parity, composed) if composed else pd.DataFrame(columns=RUN_COLUMNS)
    return {"composed_ranks": ranks, "composed_runs": runs, "composed_worst": worst_rows(runs),
            **plan_search_tables(inputs)}
