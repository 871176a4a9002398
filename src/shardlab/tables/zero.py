"""The ZeRO ladder's tables, from the runs of the strategies whose registry topic is `zero`.

- zero_memory: per run and rank, measured vs predicted parameter/gradient/optimizer bytes (the
  memory model's error in %), where they live (device or host: `costs.sharded_states.host_bytes`), with
  the run's throughput and outcome.
- zero_tree_check: per run, does the memory model put the rung on the same side of the device
  memory as the run? With a budget (`launch.device_memory_budget_bytes`, a smaller device than the
  machine's) the run's measured device-resident model states decide; without one, its outcome (ok /
  oom) on the real device.
- zero_plan: the decision tree's choice over a grid of model sizes and device counts (80 GB
  devices, bf16 + AdamW), the study's decision-tree figure as data.
- zero_rungs: per rung, the largest measured and predicted bytes over ranks and the largest
  absolute error of the memory model.
- zero_verdicts: per experiment, the memory model's worst error and how many runs agree with the
  decision tree.
"""

from __future__ import annotations

import pandas as pd

from shardlab.costs.sharded_states import host_bytes
from shardlab.costs.predict import rank_states, stage_states
from shardlab.costs.zero_tree import DEFAULT_HEADROOM, choose, feasibility
from shardlab.strategies import REGISTRY, Family
from shardlab.strategies.zero import deepspeed_ladder
from shardlab.tables import TableInputs

STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")
PLAN_PARAMS = [1.25e8, 1e9, 2.8e9, 6.9e9, 1.2e10, 3e10, 7e10, 1.75e11]
PLAN_GPUS = [1, 2, 4, 8, 16, 64]


def _on_ladder(summary: dict) -> bool:
    return REGISTRY[summary["strategy"]].family == Family.ZERO


def memory_rows(summaries: list[dict], exp: dict, shape=None) -> list[dict]:
    """`shape`: the experiment's ModelShape; per rank, the cost model's prediction for the run's Plan
    (`costs.predict.rank_states`: DeepSpeed's padding and partition boundaries, FSDP2's chunks)."""
    rows = []
    for s in filter(_on_ladder, summaries):
        spec = REGISTRY[s["strategy"]]
        base = {"experiment": s["experiment"], "strategy": s["strategy"],
                "framework": spec.plan_fields(1, spec.options(exp))["framework"], "status": s["status"],
                "tokens_per_s": s.get("tokens_per_s"), "world_size": s.get("world_size")}
        if s["status"] != "ok" or shape is None:
            rows.append(dict(base, rank=None))
            continue
        plan = spec.run_plan(exp, s["world_size"])
        for rank in s["ranks"]:
            want = rank_states(spec.run_model(shape, exp), plan, rank["rank"])
            row = dict(base, rank=rank["rank"])
            for key in STATES:
                predicted = getattr(want, key)
                row[f"measured_{key}"] = rank[key]
                row[f"predicted_{key}"] = predicted
                row[f"error_{key}_pct"] = 100 * (rank[key] - predicted) / predicted if predicted else 0.0
            measured = sum(rank[k] for k in STATES)
            host = host_bytes(plan.offload, *(rank[k] for k in STATES))
            row.update(measured_model_state_bytes=measured, predicted_model_state_bytes=want.total_bytes,
                       error_model_state_pct=100 * (measured - want.total_bytes) / want.total_bytes,
                       measured_device_bytes=measured - host, measured_host_bytes=host,
                       predicted_device_bytes=want.total_bytes - want.offloaded_bytes,
                       predicted_host_bytes=want.offloaded_bytes, activation_bytes=rank.get("activation_bytes"))
            rows.append(row)
    return rows


def device_memory(summaries: list[dict]) -> float | None:
    """Memory per device from any successful run's ranks (the runs share one machine)."""
    seen = [r["device_memory_bytes"] for s in summaries for r in s.get("ranks", []) if r.get("device_memory_bytes")]
    return max(seen) if seen else None


def tree_check_rows(summaries: list[dict], exp: dict, shape, device_mem: float | None,
                    budget: float | None = None, headroom: float = DEFAULT_HEADROOM) -> list[dict]:
    """Does the memory model place each run on the right side of the device memory? The experiment's
    model `shape`, so failed runs (which carry no model) are checked too.

    Without a `budget` the device is the machine's and the run's outcome is the truth: a rung the tree
    calls feasible must have run, one it rules out must have run out of memory. With a budget (a
    device smaller than the machine's, so that the check can fail on a CPU that never runs out) the
    truth is measured: the rank's device-resident model states against the same usable share."""
    memory = budget or device_mem
    rows = []
    for s in filter(_on_ladder, summaries):
        if s["status"] not in ("ok", "oom") or memory is None or shape is None or not s.get("world_size"):
            continue  # a run that failed for another reason says nothing about memory
        strategy = s["strategy"]
        plan = REGISTRY[strategy].run_plan(exp, s["world_size"])
        states = stage_states(shape, plan, 0)  # the even split: what the decision tree assumes
        usable = memory * (1 - headroom)
        row = {"experiment": s["experiment"], "strategy": strategy, "world_size": s["world_size"],
               "parameters": shape.parameters(), "device_memory_bytes": memory, "budgeted": budget is not None,
               "headroom": headroom, "predicted_device_peak_bytes": states.device_peak_bytes,
               "tree_says_fits": states.device_peak_bytes <= usable, "outcome": s["status"]}
        if budget is None:  # the tree's verdict (model states at their peak) against the outcome
            row.update(evidence="outcome", predicted_fits=row["tree_says_fits"], fits=s["status"] == "ok")
        elif s["status"] == "ok":  # steady device-resident model states, predicted against measured
            held = max(sum(r[k] for k in STATES) - host_bytes(plan.offload, *(r[k] for k in STATES))
                       for r in s["ranks"])
            predicted = states.total_bytes - states.offloaded_bytes
            row.update(evidence="measured device bytes", predicted_device_bytes=predicted, measured_device_bytes=held,
                       predicted_fits=predicted <= usable, fits=held <= usable)
        else:
            continue  # out of memory on the real device: says nothing about a smaller budget
        rows.append(dict(row, consistent=row["predicted_fits"] == row["fits"]))
    return rows


def plan_rows(gpu_mem: float = 80e9, dtype: str = "bf16", optimizer: str = "adamw") -> list[dict]:
    rows = []
    for n_params in PLAN_PARAMS:
        for gpus in PLAN_GPUS:
            choice = choose(feasibility(deepspeed_ladder(), n_params, gpus, gpu_mem, dtype, optimizer))
            rows.append({"parameters": n_params, "gpus": gpus, "gpu_memory_bytes": gpu_mem,
                         "headroom": DEFAULT_HEADROOM, "choice": choice or "none (needs TP/PP)"})
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
    for name, exp in inputs.experiments.items():
        summaries = [s for s in inputs.summaries if s["experiment"] == name]
        shape = inputs.model_shape(exp)
        memory += memory_rows(summaries, exp, shape)
        check += tree_check_rows(summaries, exp, shape, device_memory(summaries),
                                 exp.get("launch", {}).get("device_memory_budget_bytes"))
    memory, check = pd.DataFrame(memory), pd.DataFrame(check)
    rungs = rung_rows(memory)
    return {"zero_memory": memory, "zero_tree_check": check, "zero_plan": pd.DataFrame(plan_rows()),
            "zero_rungs": rungs, "zero_verdicts": verdict_rows(rungs, check)}
