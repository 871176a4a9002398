"""The planner's tables (report section "Planning at scale"), from the config's `planning` block.

- planning_scenarios: per scenario, the search (candidates, fitting, seconds) and its best plan.
- planning_top: per scenario, the top plans: memory per rank by category, step time by component,
  tokens/s, MFU, the bottleneck.
- planning_rejected: per scenario, why the other plans fail (reason, count, one example).
- planning_what_if: per scenario and what-if (catalog figures scaled), the best plan and its speed-up.
- planning_zero_ladder: the ZeRO rungs on one scenario's cluster as the decision tree sees them (a view
  of the planner: `costs.zero_tree`), each with its memory and why it fits or not.
- planning_published: every published run (costs/published.yaml) against its prediction: throughput
  per GPU published and predicted, the error, the split (calibration, held out, informed), whether it
  is predicted to fit.
- planning_published_by_source, planning_published_by_stack: the held-out rows' mean, worst and signed
  error and the false "does not fit" count, per source and per software stack.
- planning_published_memory: Korthikanti et al.'s memory per GPU against the planner's.
- planning_crosscheck: the planner beside DeepSpeed's estimator and Megatron's formula.
"""

from __future__ import annotations


import pandas as pd

from shardlab.costs import comparison, crosscheck
from shardlab.costs.planner import Scenario, known_models, model_shape, scenarios
from shardlab.costs.predict import MEMORY_CATEGORIES, Prediction
from shardlab.costs.search import SearchResult, search
from shardlab.costs.zero_tree import choose, ladder
from shardlab.core.pool import ordered_map
from shardlab.strategies.zero import deepspeed_ladder
from shardlab.tables import TableInputs

GB = 1e9


def prediction_row(p: Prediction) -> dict:
    row = {"plan": p.plan.label(), **{f"plan_{k}": v for k, v in p.plan.as_dict().items()},
           "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "hfu": p.hfu, "tflops_per_gpu": p.tflops_per_gpu,
           "step_s": p.step_s, "bottleneck": p.bottleneck, "stack": p.stack, "implausible": p.flag,
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
    return search(s.model, s.cluster.scaled(**factors) if factors else s.cluster, s.workload, top=top, space=s.space,
                  stack=s.stack)


def run_searches(tasks: list, workers: int) -> list[SearchResult]:
    """The searches are independent: in `workers` processes when the rule gives the topic more than one
    core (the default scenarios' 20 searches took 32 s in one; the MoE scenario's four, 22 s of it)."""
    return ordered_map(search_task, tasks, workers)


def scenario_tables(s: Scenario, result: SearchResult, alternatives: dict[str, SearchResult]) -> dict[str, list[dict]]:
    """The tables of one scenario: its search, and each what-if's search (`alternatives`, by name)."""
    base = {"scenario": s.name}
    best = result.ranked[0] if result.ranked else None
    band, basis = comparison.error_band(s.stack, s.cluster.device["generation"])
    summary = dict(base, description=s.description, parameters_b=s.model.parameters() / 1e9,
                   active_parameters_b=s.model.active_parameters() / 1e9, hardware=s.cluster.accelerator,
                   stack=s.stack, published_row=s.published, error_band_pct=band, error_band_basis=basis,
                   implausible=best.flag if best else "",
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
    """Each ZeRO rung on the scenario's devices as pure data parallelism, as the decision tree sees it
    (`costs.zero_tree`: the planner's memory, one micro-batch per device), and the rung it chooses."""
    rows = ladder(s.model, s.cluster, s.workload.seq_len, deepspeed_ladder(), micro_batch)
    choice = choose(rows)
    return [{"scenario": s.name, **{k.replace("_bytes", "_gb") if k.endswith("_bytes") else k:
                                     v / GB if k.endswith("_bytes") else v for k, v in r.items()},
             "chosen": r["rung"] == choice} for r in rows]


def published_tables() -> dict[str, list[dict]]:
    """Every published run against its prediction, summarised per source and per stack, and
    Korthikanti et al.'s memory values."""
    rows = comparison.results()
    return {"planning_published": rows, "planning_published_by_source": comparison.summary(rows, "source"),
            "planning_published_by_stack": comparison.summary(rows, "stack"),
            "planning_published_memory": comparison.memory_results()}


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
    zero = planning.get("zero_ladder")
    out["planning_zero_ladder"] = zero_ladder_rows(found[zero["scenario"]], zero["micro_batch"]) if zero else []
    out.update(published_tables())
    out["planning_crosscheck"] = crosscheck.rows({name: model_shape(name) for name in known_models()})
    return {name: pd.DataFrame(rows, columns=COLUMNS.get(name)) for name, rows in out.items()}


# Tables that may have no rows (no ladder, no rejected plan) keep their columns.
COLUMNS = {
    "planning_rejected": ["scenario", "reason", "plans", "example"],
    "planning_zero_ladder": ["scenario", "rung", "device_gb", "usable_gb", "host_per_node_gb", "parameters_gb",
                             "gradients_gb", "optimizer_gb", "activations_gb", "comm_buffers_gb", "fits", "why",
                             "chosen"],
}
