"""The ZeRO ladder's tables, from the runs of the strategies whose registry topic is `zero`.

- zero_memory: per run and rank, measured vs predicted parameter/gradient/optimizer bytes (predicted:
  `rank_predictions`; the memory model's signed error in %, `tables.prediction_error`), where they live
  (device or host: `costs.sharded_states.host_bytes`), with the run's throughput and outcome.
- zero_tree_check: per run, does the planner put the rung on the same side of the device memory as
  the run? With a budget (`launch.device_memory_budget_bytes`, a smaller device than the machine's)
  the run's measured device-resident model states and activations decide; without one, its outcome
  (ok / oom) on the real device.
- zero_plan: the decision tree's choice (`costs.zero_tree`, a view of the planner) over the catalogued
  models and device counts (A100-80GB, bf16 + AdamW, one 2048-token sequence per device).
- zero_rungs: per rung, the largest measured and predicted bytes over ranks and the largest
  absolute error of the memory model.
- zero_verdicts: per experiment, the memory model's worst error and how many runs agree with the
  decision tree.
"""

from __future__ import annotations

import pandas as pd

from shardlab.costs.plan import Cluster
from shardlab.costs.predict import Prediction, evaluate
from shardlab.costs.shapes import model_shape
from shardlab.costs.sharded_states import host_bytes
from shardlab.costs.zero_tree import choose, cluster_of, ladder
from shardlab.strategies import REGISTRY, Family
from shardlab.strategies.zero import deepspeed_ladder
from shardlab.tables import TableInputs
from shardlab.tables.prediction_error import error_pct
from shardlab.tables.rank_predictions import of_run, run_setting
from shardlab.tables.rank_predictions import read as read_predictions

STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")
PLAN_MODELS = ["pythia-160m", "pythia-1b", "pythia-2.8b", "pythia-6.9b", "pythia-12b", "gpt3-175b"]
PLAN_GPUS = [1, 2, 4, 8, 16, 64]
MACHINE, STACK = "CPU (calibrated)", "shardlab"  # the runs' device and stack (tables.predictions)


def _on_ladder(summary: dict) -> bool:
    return REGISTRY[summary["strategy"]].family == Family.ZERO


def memory_rows(summaries: list[dict], predictions: pd.DataFrame) -> list[dict]:
    """Per rank, the measured model states beside the cost model's prediction for the run's Plan
    (`rank_predictions`: DeepSpeed's padding and partition boundaries, FSDP2's chunks)."""
    rows = []
    for s in filter(_on_ladder, summaries):
        mine = of_run(predictions, s["experiment"], s["strategy"])
        base = {"experiment": s["experiment"], "strategy": s["strategy"],
                "framework": mine["framework"].iloc[0] if len(mine) else None, "status": s["status"],
                "tokens_per_s": s.get("tokens_per_s"), "world_size": s.get("world_size")}
        if s["status"] != "ok" or mine.empty:
            rows.append(dict(base, rank=None))
            continue
        for rank in s["ranks"]:
            want = mine.loc[rank["rank"]]
            row = dict(base, rank=rank["rank"])
            for key in STATES:
                predicted = want[f"predicted_{key}"]
                row[f"measured_{key}"] = rank[key]
                row[f"predicted_{key}"] = predicted
                row[f"error_{key}_pct"] = error_pct(rank[key], predicted)
            measured = sum(rank[k] for k in STATES)
            host = host_bytes(want["offload"], *(rank[k] for k in STATES))
            total, offloaded = want["predicted_model_state_bytes"], want["predicted_host_bytes"]
            row.update(measured_model_state_bytes=measured, predicted_model_state_bytes=total,
                       error_model_state_pct=error_pct(measured, total),
                       measured_device_bytes=measured - host, measured_host_bytes=host,
                       predicted_device_bytes=total - offloaded, predicted_host_bytes=offloaded,
                       activation_bytes=rank.get("activation_bytes"))
            rows.append(row)
    return rows


def device_memory(summaries: list[dict]) -> float | None:
    """Memory per device from any successful run's ranks (the runs share one machine)."""
    seen = [r["device_memory_bytes"] for s in summaries for r in s.get("ranks", []) if r.get("device_memory_bytes")]
    return max(seen) if seen else None


def tree_check_rows(summaries: list[dict], exp: dict, inputs: TableInputs, predictions: pd.DataFrame,
                    device_mem: float | None, budget: float | None = None) -> list[dict]:
    """Does the planner (the decision tree is a view of it: `costs.zero_tree`) place each run on the right
    side of the device memory? The experiment's model shape (`inputs`), so failed runs (which carry no model)
    are checked too, and the predicted bytes per rank from `predictions` (`rank_predictions`); the device
    is this machine under the runner's stack, its memory the machine's or the budget's, less the stack's
    runtime allowance.

    Without a `budget` the run's outcome is the truth: a rung the planner says fits (its peak memory)
    must have run, one it rules out must have run out of memory. With a budget (a device smaller than
    the machine's, so that the check can fail on a CPU that never runs out) the truth is measured: the
    rank's device-resident model states after the step and its saved activations, against the planner's
    prediction of the same two for the same rank."""
    memory = budget or device_mem
    rows = []
    for s in filter(_on_ladder, summaries):
        shape = inputs.model_shape(exp)
        if s["status"] not in ("ok", "oom") or memory is None or shape is None or not s.get("world_size"):
            continue  # a run that failed for another reason says nothing about memory
        strategy, world = s["strategy"], s["world_size"]
        model, plan, workload = run_setting(s, exp, inputs)
        device = Cluster(MACHINE, 1, world, overrides={"hbm_gb": memory / 2**30})
        p = evaluate(model, plan, device, workload, STACK, with_time=False)
        if not isinstance(p, Prediction):
            continue
        row = {"experiment": s["experiment"], "strategy": strategy, "world_size": world,
               "parameters": shape.parameters(), "device_memory_bytes": memory, "budgeted": budget is not None,
               "usable_bytes": p.capacity_bytes, "planner_peak_bytes": p.device_bytes, "planner_says_fits": p.fits,
               "outcome": s["status"]}
        if budget is None:  # the planner's verdict against the outcome
            row.update(evidence="outcome", predicted_fits=p.fits, fits=s["status"] == "ok")
        elif s["status"] == "ok":  # device-resident model states and activations, predicted against measured
            held, predicted = [], []
            mine = of_run(predictions, s["experiment"], strategy)
            for r in s["ranks"]:
                held.append(sum(r[k] for k in STATES) - host_bytes(plan.offload, *(r[k] for k in STATES))
                            + (r.get("activation_bytes") or 0))
                want = mine.loc[r["rank"]]
                predicted.append(want["predicted_model_state_bytes"] - want["predicted_host_bytes"]
                                 + want["predicted_activation_bytes"])
            row.update(evidence="measured device bytes", measured_device_bytes=max(held),
                       predicted_device_bytes=max(predicted), predicted_fits=max(predicted) <= p.capacity_bytes,
                       fits=max(held) <= p.capacity_bytes)
        else:
            continue  # out of memory on the real device: says nothing about a smaller budget
        rows.append(dict(row, consistent=row["predicted_fits"] == row["fits"]))
    return rows


def plan_rows(accelerator: str = "A100-80GB SXM", seq_len: int = 2048) -> list[dict]:
    """The decision tree's choice over the catalogued models and device counts (bf16, AdamW, one
    micro-batch of `seq_len` tokens per device)."""
    rows = []
    for name in PLAN_MODELS:
        model = model_shape(name)
        for gpus in PLAN_GPUS:
            choice = choose(ladder(model, cluster_of(accelerator, gpus), seq_len, deepspeed_ladder()))
            rows.append({"model": name, "parameters": model.parameters(), "gpus": gpus, "accelerator": accelerator,
                         "seq_len": seq_len, "choice": choice or "none (needs TP/PP)"})
    return rows


def rung_rows(memory: pd.DataFrame) -> pd.DataFrame:
    ok = memory[memory["status"] == "ok"] if len(memory) else memory
    if ok.empty:
        return pd.DataFrame(columns=["experiment", "strategy", "max_abs_error_pct"])
    measured = [f"{kind}_{key}" for key in STATES for kind in ("measured", "predicted")]
    table = ok.groupby(["experiment", "strategy"], sort=False)[measured].max()
    table["max_abs_error_pct"] = ok.groupby(["experiment", "strategy"], sort=False)["error_model_state_pct"].agg(
        lambda e: e.abs().max())
    return table.reset_index()


def verdict_rows(rungs: pd.DataFrame, check: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for name in dict.fromkeys([*rungs.get("experiment", []), *check.get("experiment", [])]):
        mine = check[check["experiment"] == name] if len(check) else check
        rows.append({"experiment": name,
                     "worst_abs_error_pct": rungs.loc[rungs["experiment"] == name, "max_abs_error_pct"].max(),
                     "tree_checked_runs": len(mine), "tree_agreeing_runs": int(mine["consistent"].sum()) if len(mine) else 0})
    return pd.DataFrame(rows, columns=["experiment", "worst_abs_error_pct", "tree_checked_runs", "tree_agreeing_runs"])


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    memory, check = [], []
    predictions = read_predictions(inputs)
    for name, exp in inputs.experiments.items():
        summaries = [s for s in inputs.summaries if s["experiment"] == name]
        memory += memory_rows(summaries, predictions)
        check += tree_check_rows(summaries, exp, inputs, predictions, device_memory(summaries),
                                 exp.get("launch", {}).get("device_memory_budget_bytes"))
    memory, check = pd.DataFrame(memory), pd.DataFrame(check)
    rungs = rung_rows(memory)
    return {"zero_memory": memory, "zero_tree_check": check, "zero_plan": pd.DataFrame(plan_rows()),
            "zero_rungs": rungs, "zero_verdicts": verdict_rows(rungs, check)}
