"""Tensor and sequence parallelism's tables, from the runs of the strategies whose registry topic is
`tensor_parallel` (and their reference runs).

- tp_activation_components: per run, rank and transformer-layer component, the activation bytes
  saved for backward (mean per layer) beside the Korthikanti et al. formula (fp32 values, 1-byte
  masks) and the formula adapted to what this model saves (`shardlab.costs.activations`), both under
  the run's activation recompute, and the measured/formula ratios. How a strategy splits activations follows from its Plan (`Plan.activation_split`).
- tp_activation_totals: the same per run and rank, summed over the components (bytes per layer).
- tp_throughput: per run, tokens/s and the ratios to its reference and to its twin
  (`tables.data_parallel.throughput_rows`).
- tp_twins: per hand-written strategy, its throughput over its production twin's, against the goal.
- tp_recompute: per strategy and activation recompute mode, the bytes a layer keeps (rank 0, measured
  and by both formulas), each as a share of the same strategy's run without recompute in the
  experiment that differs only in it, and the step time's ratio to that run.
- tp_memory_categories: per run, the mean over ranks of parameter, gradient, optimizer and
  activation bytes, for the TP experiment's runs and for the runs of every other experiment with
  the same model and training settings (one run per strategy; ranks from the `ranks` table), with
  each run's registry reference (the row its run is held against).

The sequence length, the micro-batch the probe measured on a rank and the model's sizes come from
each run's experiment and model record (`TableInputs`).
"""

from __future__ import annotations

import pandas as pd

from shardlab.costs.activations import comparison_rows
from shardlab.strategies import REGISTRY
from shardlab.tables import TableInputs
from shardlab.tables.data_parallel import of_topic, step_times, throughput_rows
from shardlab.tables.rank_predictions import run_setting

TOPIC = "tensor_parallel"
TWIN_GOAL = 0.95  # the study's goal: a hand-written strategy reaches 95 % of its production twin's throughput
COLUMNS = ["experiment", "strategy", "rank", "mode", "tp", "recompute", "component", "measured_bytes", "paper_formula_bytes",
           "model_formula_bytes", "paper_assumptions_hold", "s", "b", "h", "a", "n_layers", "activation_split",
           "measured_over_model", "measured_over_paper"]
BYTES = ["measured_bytes", "paper_formula_bytes", "model_formula_bytes"]
TWIN_COLUMNS = ["experiment", "strategy", "twin", "tokens_per_s", "twin_tokens_per_s", "ratio_to_twin",
                "ratio_to_twin_low", "ratio_to_twin_high", "goal_ratio", "goal_met"]
CATEGORIES = ["param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"]
RECOMPUTE_COLUMNS = ["strategy", "recompute", "experiment", *BYTES, "measured_over_model", "kept_of_none",
                     "paper_kept_of_none", "step_time_ratio"]
MEMORY_COLUMNS = ["tp_experiment", "experiment", "strategy", "family", "topic", "run", "ranks", *CATEGORIES, "reference"]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def activation_rows(summary: dict, inputs: TableInputs) -> list[dict]:
    if summary.get("status") != "ok":
        return []  # failed runs have no activation measurement; runs.csv already records them
    exp = inputs.experiment(summary)
    shape = inputs.model_shape(exp)
    if shape is None:
        raise ValueError(f"no model shape for {exp['model']['name']}: its model record has no 'shape'")
    _, plan, _ = run_setting(summary, exp, inputs)
    split = plan.activation_split
    # What the activation probe saw: one micro-batch on one rank, stored at the run's precision.
    dims = {"s": exp["training"]["seq_len"], "b": plan.micro_batch, "h": shape.hidden_size, "a": shape.num_heads,
            "n_layers": shape.num_layers, "intermediate": shape.intermediate_size, "precision": plan.activation_precision}
    rows = []
    for rank in summary["ranks"]:
        for row in comparison_rows(split, rank.get("activation_by_module") or {}, dims, t=summary["world_size"],
                                   recompute=plan.recompute):
            rows.append({"experiment": summary["experiment"], "strategy": summary["strategy"], "rank": rank["rank"],
                         "recompute": plan.recompute, **row, **dims, "activation_split": split,
                         "measured_over_model": _ratio(row["measured_bytes"], row["model_formula_bytes"]),
                         "measured_over_paper": _ratio(row["measured_bytes"], row["paper_formula_bytes"])})
    return rows


def activation_totals(components: pd.DataFrame) -> pd.DataFrame:
    keys = ["experiment", "strategy", "rank", "mode", "tp", "recompute"]
    return components.groupby(keys, sort=False)[BYTES].sum().reset_index()


def twin_rows(throughput: pd.DataFrame) -> pd.DataFrame:
    twins = throughput[throughput["twin"].notna() & throughput["strategy"].map(lambda s: REGISTRY[s].topic == TOPIC)]
    table = twins[["experiment", "strategy", "twin", "tokens_per_s", "twin_tokens_per_s", "ratio_to_twin",
                   "ratio_to_twin_low", "ratio_to_twin_high"]].copy()
    table["goal_ratio"] = TWIN_GOAL
    table["goal_met"] = table["ratio_to_twin"].map(lambda r: None if pd.isna(r) else bool(r >= TWIN_GOAL))
    return table.reset_index(drop=True)[TWIN_COLUMNS]


def peer_experiments(name: str, experiments: dict[str, dict]) -> list[str]:
    """The other experiments with the same model and training settings as `name` (settings order)."""
    mine = experiments[name]
    return [other for other, exp in experiments.items()
            if other != name and exp["model"] == mine["model"] and exp["training"] == mine["training"]]


def memory_rows(tp_experiment: str, inputs: TableInputs) -> list[dict]:
    """The TP experiment's references, then each peer experiment's parallel runs checked against the
    same references, one per strategy not yet shown (first peer wins), then the TP experiment's
    other runs. A reference of other strategies (e.g. the single-process mixture of experts) stands
    for another model, so peers contribute no reference runs."""
    ranks = inputs.tables.get("ranks")
    if ranks is None or ranks.empty:
        return []
    ok = ranks[ranks["status"] == "ok"]
    means = ok.groupby(["experiment", "strategy"], sort=False)
    runs = list(means.groups)  # (experiment, strategy) in table order
    own = [r for r in runs if r[0] == tp_experiment]
    every_reference = {spec.reference for spec in REGISTRY.values()}
    is_reference = lambda run: run[1] in every_reference  # noqa: E731
    chosen = [r for r in own if is_reference(r)]
    references = {REGISTRY[s].reference for _, s in own}
    for peer in peer_experiments(tp_experiment, inputs.experiments):
        shown = {s for _, s in chosen} | {s for _, s in own}
        chosen += [r for r in runs if r[0] == peer and r[1] not in shown and not is_reference(r)
                   and REGISTRY[r[1]].reference in references]
    chosen += [r for r in own if not is_reference(r)]
    table = means[CATEGORIES].mean()
    counts = means.size()
    rows = []
    for experiment, strategy in chosen:
        spec = REGISTRY[strategy]
        rows.append({"tp_experiment": tp_experiment, "experiment": experiment, "strategy": strategy,
                     "family": spec.family, "topic": spec.topic, "run": f"{strategy} ({experiment})",
                     "ranks": int(counts[(experiment, strategy)]), **table.loc[(experiment, strategy)].to_dict(),
                     "reference": spec.reference})
    return rows


def without_recompute(name: str, experiments: dict[str, dict]) -> list[str]:
    """The experiments whose settings are `name`'s but for activation recompute, which they leave off."""
    def setting(exp: dict) -> tuple:
        training = {k: v for k, v in exp["training"].items() if k != "recompute"}
        return exp["model"], exp["data"], exp["launch"], training

    mine = setting(experiments[name])
    return [other for other, exp in experiments.items()
            if exp["training"].get("recompute", "none") == "none" and setting(exp) == mine]


def recompute_rows(totals: pd.DataFrame, throughput: pd.DataFrame, experiments: dict[str, dict]) -> pd.DataFrame:
    """Per strategy and recompute mode (Korthikanti et al.'s activation result at this scale): the bytes a
    layer keeps on rank 0, measured and by both formulas, each as a share of what the same strategy keeps
    without recompute (its run in an experiment that differs only in that), and the step time's ratio."""
    rank0 = totals[totals["rank"] == 0].set_index(["experiment", "strategy"])
    steps = throughput.set_index(["experiment", "strategy"])["step_time_median_s"]
    rows = []
    for name, strategy in rank0.index:
        if experiments[name]["training"].get("recompute", "none") == "none":
            continue
        base = next((e for e in without_recompute(name, experiments) if (e, strategy) in rank0.index), None)
        for experiment in ([base, name] if base else []):
            run, none = rank0.loc[(experiment, strategy)], rank0.loc[(base, strategy)]
            rows.append({"strategy": strategy, "recompute": run["recompute"], "experiment": experiment,
                         **{key: run[key] for key in BYTES},
                         "measured_over_model": _ratio(run["measured_bytes"], run["model_formula_bytes"]),
                         "kept_of_none": _ratio(run["measured_bytes"], none["measured_bytes"]),
                         "paper_kept_of_none": _ratio(run["paper_formula_bytes"], none["paper_formula_bytes"]),
                         "step_time_ratio": _ratio(steps.get((experiment, strategy), float("nan")),
                                                   steps.get((base, strategy), float("nan")))})
    table = pd.DataFrame(rows, columns=RECOMPUTE_COLUMNS).drop_duplicates(["strategy", "experiment"])
    return table.sort_values(["strategy", "kept_of_none"], ascending=[True, False], kind="stable")


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    components = pd.DataFrame([row for s in inputs.summaries for row in activation_rows(s, inputs)], columns=COLUMNS)
    throughput = throughput_rows(inputs.summaries, TOPIC, step_times(inputs.summaries, inputs.experiments))
    tp_experiments = list(dict.fromkeys(s["experiment"] for s in of_topic(inputs.summaries, TOPIC)))
    memory = [row for name in tp_experiments if name in inputs.experiments for row in memory_rows(name, inputs)]
    totals = activation_totals(components)
    return {"tp_activation_components": components, "tp_activation_totals": totals,
            "tp_throughput": throughput, "tp_twins": twin_rows(throughput),
            "tp_memory_categories": pd.DataFrame(memory, columns=MEMORY_COLUMNS),
            "tp_recompute": recompute_rows(totals, throughput, inputs.experiments)}
