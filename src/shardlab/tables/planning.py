"""The planner's tables (report section "Planning at scale"), from the config's `planning` block.

- planning_scenarios: per scenario, the search (candidates, fitting, seconds) and its best plan.
- planning_top: per scenario, the top plans: memory per rank by category, step time by component,
  tokens/s, MFU, the bottleneck.
- planning_rejected: per scenario, why the other plans fail (reason, count, one example).
- planning_what_if: per scenario and what-if (catalog figures scaled), the best plan and its speed-up.
- planning_zero_ladder: the ZeRO rungs on one scenario's cluster, by the decision tree and by the
  full planner (activations included), each with why it fits or not.
- planning_published: the published large-scale points, measured vs predicted.
- planning_published_loo: Korthikanti et al.'s iteration times, each model predicted by efficiencies
  fitted on the other three.
- planning_published_fsdp: MosaicML's FSDP throughput on H100, calibration and held-out rows.
- planning_crosscheck: the planner beside DeepSpeed's estimator and Megatron's formula.
"""

from __future__ import annotations


import pandas as pd

from shardlab.costs import calibration, crosscheck, published
from shardlab.costs.hardware import memory_bytes
from shardlab.costs.plan import Plan
from shardlab.costs.planner import Scenario, known_models, model_shape, scenarios
from shardlab.costs.predict import MEMORY_CATEGORIES, Prediction, evaluate
from shardlab.costs.search import SearchResult, search
from shardlab.costs.zero_tree import DEFAULT_HEADROOM, data_parallel_plan, feasibility
from shardlab.core.pool import ordered_map
from shardlab.strategies.zero import deepspeed_ladder
from shardlab.tables import TableInputs

GB = 1e9


def prediction_row(p: Prediction) -> dict:
    row = {"plan": p.plan.label(), **{f"plan_{k}": v for k, v in p.plan.as_dict().items()},
           "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "hfu": p.hfu, "tflops_per_gpu": p.tflops_per_gpu,
           "step_s": p.step_s, "bottleneck": p.bottleneck,
           "device_gb": p.device_bytes / GB, "usable_gb": p.capacity_bytes / GB, "fits": p.fits, "why": p.why}
    row.update({f"{k}_gb": p.memory[k] / GB for k in (*MEMORY_CATEGORIES, "host_bytes")})
    row.update({f"time_{k}_s": v for k, v in p.time.items()})  # seconds per step by component
    if p.time:  # what the step loses beyond compute, and its share
        overhead = max((k for k in p.time if k != "compute"), key=p.time.get)
        row["largest_overhead"] = f"{overhead} ({p.time[overhead] / p.step_s:.0%} of the step)"
    return row


def search_task(task: tuple[Scenario, dict | None, int]) -> SearchResult:
    """One search of the tables: (scenario, what-if factors of its catalog figures or None, plans kept)."""
    s, factors, top = task
    return search(s.model, s.cluster.scaled(**factors) if factors else s.cluster, s.workload, top=top, space=s.space)


def run_searches(tasks: list, workers: int) -> list[SearchResult]:
    """The searches are independent: in `workers` processes when the rule gives the topic more than one
    core (the default scenarios' 20 searches took 32 s in one; the MoE scenario's four, 22 s of it)."""
    return ordered_map(search_task, tasks, workers)


def scenario_tables(s: Scenario, result: SearchResult, alternatives: dict[str, SearchResult]) -> dict[str, list[dict]]:
    """The tables of one scenario: its search, and each what-if's search (`alternatives`, by name)."""
    base = {"scenario": s.name}
    best = result.ranked[0] if result.ranked else None
    summary = dict(base, description=s.description, parameters_b=s.model.parameters() / 1e9,
                   active_parameters_b=s.model.active_parameters() / 1e9, hardware=s.cluster.accelerator,
                   gpus=s.cluster.gpus, global_batch=s.workload.global_batch, seq_len=s.workload.seq_len,
                   candidates=result.candidates, fitting=result.fitting, search_s=result.seconds,
                   best_plan=best.plan.label() if best else "none fits",
                   tokens_per_s=best.tokens_per_s if best else None, mfu=best.mfu if best else None,
                   hfu=best.hfu if best else None, tflops_per_gpu=best.tflops_per_gpu if best else None,
                   bottleneck=best.bottleneck if best else None,
                   largest_overhead=prediction_row(best)["largest_overhead"] if best else None)
    top_rows = [dict(base, rank=i, **prediction_row(p)) for i, p in enumerate(result.ranked, 1)]
    rejected = [dict(base, reason=kind, plans=n, example=result.examples[kind]) for kind, n in result.rejected.most_common()]
    what_ifs = [dict(base, what_if="as catalogued", best_plan=summary["best_plan"], tokens_per_s=summary["tokens_per_s"],
                     mfu=summary["mfu"], speedup=1.0 if best else None, plan_changed=False)]
    for name, alt in alternatives.items():
        a = alt.ranked[0] if alt.ranked else None
        what_ifs.append(dict(base, what_if=name, best_plan=a.plan.label() if a else "none fits",
                             tokens_per_s=a.tokens_per_s if a else None, mfu=a.mfu if a else None,
                             speedup=a.tokens_per_s / best.tokens_per_s if a and best else None,
                             plan_changed=(a.plan != best.plan) if a and best else None))
    return {"planning_scenarios": [summary], "planning_top": top_rows, "planning_rejected": rejected,
            "planning_what_if": what_ifs}


def zero_ladder_rows(s: Scenario, micro_batch: int) -> list[dict]:
    """Each ZeRO rung on the scenario's GPUs as pure data parallelism: the decision tree's verdict
    (model states only, 25 % headroom) beside the full planner's (activations included)."""
    device = s.cluster.device
    ladder = deepspeed_ladder()
    tree = {r["rung"]: r for r in feasibility(ladder, s.model.parameters(), s.cluster.gpus, memory_bytes(device))}
    rows = []
    for rung, facts in ladder.items():
        plan = Plan(**{**data_parallel_plan(facts, s.cluster.gpus, "bf16", "adamw").as_dict(), "micro_batch": micro_batch})
        p = evaluate(s.model, plan, s.cluster, s.workload)
        full = prediction_row(p) if isinstance(p, Prediction) else {"fits": False, "why": p}
        rows.append({"scenario": s.name, "rung": rung, "tree_model_states_gb": tree[rung]["device_peak_bytes"] / GB,
                     "tree_budget_gb": tree[rung]["budget_bytes"] / GB, "tree_fits": tree[rung]["fits"],
                     "tree_why": tree[rung]["why"], "headroom": DEFAULT_HEADROOM,
                     **{f"planner_{k}": v for k, v in full.items() if not k.startswith("plan_")}})
    return rows


def published_summary(rows: list[dict]) -> list[dict]:
    """Mean and worst error per quantity beside this project's goal and the best open model's error."""
    ref = published.reference()
    goals, theirs = ref["goals_pct"], ref["reference_model_error_pct"]
    key = {"iteration_time_s": "time", "params_optimizer_gib": "params_optimizer", "activations_gib": "activations"}
    out = []
    for quantity, err in published.summary(rows).items():
        goal_mean, goal_worst = ((goals["time_mean"], goals["time_worst"]) if quantity == "iteration_time_s"
                                 else (goals["memory_each"], goals["memory_each"]))
        out.append({"quantity": quantity, "points": err["n"], "mean_abs_error_pct": err["mean"],
                    "worst_abs_error_pct": err["worst"], "goal_mean_pct": goal_mean, "goal_worst_pct": goal_worst,
                    "meets_goal": err["mean"] <= goal_mean and err["worst"] <= goal_worst,
                    "best_open_model_mean_pct": theirs[key[quantity]]["mean"],
                    "best_open_model_worst_pct": theirs[key[quantity]]["worst"]})
    return out


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    planning = inputs.settings["planning"]
    found = {s.name: s for s in scenarios(planning)}
    out: dict[str, list[dict]] = {}
    what_if = planning["what_if"]
    tasks = [task for s in found.values()
             for task in [(s, None, planning["top"]), *((s, factors, 1) for factors in what_if.values())]]
    print(f"planning: {len(found)} scenarios, {len(tasks)} searches in {inputs.workers} process(es)", flush=True)
    results = iter(run_searches(tasks, inputs.workers))
    for s in found.values():
        print(f"planning {s.name}: {s.model.parameters() / 1e9:.1f}B parameters on {s.cluster.gpus} x {s.cluster.accelerator}",
              flush=True)
        result = next(results)
        alternatives = {name: next(results) for name in what_if}
        for name, rows in scenario_tables(s, result, alternatives).items():
            out.setdefault(name, []).extend(rows)
    ladder = planning.get("zero_ladder")
    out["planning_zero_ladder"] = zero_ladder_rows(found[ladder["scenario"]], ladder["micro_batch"]) if ladder else []
    out["planning_published"] = published.rows()
    out["planning_published_summary"] = published_summary(out["planning_published"])
    out["planning_published_loo"] = calibration.megatron_leave_one_out()
    out["planning_published_fsdp"] = published.fsdp_rows()
    out["planning_published_llama3"] = published.llama3_rows()
    out["planning_crosscheck"] = crosscheck.rows({name: model_shape(name) for name in known_models()})
    return {name: pd.DataFrame(rows, columns=COLUMNS.get(name)) for name, rows in out.items()}


# Tables that may have no rows (no ladder, no rejected plan) keep their columns.
COLUMNS = {
    "planning_rejected": ["scenario", "reason", "plans", "example"],
    "planning_zero_ladder": ["scenario", "rung", "tree_model_states_gb", "tree_budget_gb", "tree_fits", "tree_why",
                             "headroom", "planner_parameters_gb", "planner_gradients_gb", "planner_optimizer_gb",
                             "planner_activations_gb", "planner_comm_buffers_gb", "planner_host_bytes_gb",
                             "planner_device_gb", "planner_usable_gb", "planner_fits", "planner_why",
                             "planner_tokens_per_s", "planner_mfu"],
}
