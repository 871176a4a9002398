"""Context- and expert-parallel runs (registry topic `context_expert`) -> the tables of their section.

- cp_memory: one row per run rank of every run in an experiment with a context-parallel run:
  sequence length, context-parallel size (1 for the reference), activation bytes, throughput.
- cp_activation: per finished run of those experiments, the mean activation bytes per rank (the
  chart's points) with a `run` label.
- cp_activation_ratio: each context-parallel run against its registry reference in the same
  experiment: activation bytes per rank over the reference's, next to the naive 1/c (`expected_ratio`)
  and the cost model's ratio (`predicted_ratio`, from `rank_predictions`).
- expert_load: one row per (run, layer, expert) of every run that records expert routing:
  assignments routed to the expert, kept within capacity, dropped, and the processed/dropped
  shares of the layer's assignments.
- expert_load_shares: the load chart in long form (one row per expert and fate), for the runs whose
  experts are sharded over several ranks (every routing run when none is).
- moe_dense: the finished mixture-of-experts runs beside the dense runs they match (experiments
  with the same model, data and training settings; see `dense_strategies`): throughput, loss,
  largest per-rank parameter and activation bytes, dropped assignments. Reads the runs and ranks
  tables and every experiment's settings.
"""

from __future__ import annotations

import pandas as pd

from shardlab.strategies import REGISTRY, Family
from shardlab.tables import TableInputs
from shardlab.tables.rank_predictions import of_run
from shardlab.tables.rank_predictions import given as given_predictions

CONTEXT, EXPERT, DATA = Family.CONTEXT_PARALLEL, Family.EXPERT_PARALLEL, Family.DATA_PARALLEL
CP_COLUMNS = ["experiment", "strategy", "status", "seq_len", "global_batch_size", "cp_size", "rank",
              "activation_bytes", "param_bytes", "tokens_per_s", "step_time_median_s", "final_loss"]
CP_RUN_COLUMNS = ["experiment", "strategy", "seq_len", "cp_size", "run", "activation_bytes_per_rank", "tokens_per_s"]
RATIO_COLUMNS = ["experiment", "strategy", "reference", "seq_len", "cp_size", "reference_activation_bytes",
                 "activation_bytes_per_rank", "activation_ratio", "expected_ratio", "reference_tokens_per_s",
                 "tokens_per_s", "predicted_ratio"]
LOAD_COLUMNS = ["experiment", "strategy", "world_size", "layer", "expert", "routed", "kept", "dropped", "routed_share",
                "processed_share", "dropped_share"]
SHARE_COLUMNS = ["experiment", "strategy", "world_size", "layer", "expert", "fate", "share"]
DENSE_COLUMNS = ["moe_experiment", "experiment", "strategy", "role", "world_size", "tokens_per_s", "final_loss",
                 "max_rank_param_bytes", "max_rank_activation_bytes", "tokens_fully_dropped", "dropped_assignments_pct"]
SAME_SETTINGS = ("model", "data", "training")  # what makes a dense run comparable with a MoE run


def _family(strategy: str) -> str | None:
    spec = REGISTRY.get(strategy)
    return spec and spec.family


# --- context parallelism ------------------------------------------------------------------------
def cp_rows(summary: dict, exp: dict) -> list[dict]:
    training = exp.get("training", {})
    base = {"experiment": summary.get("experiment"), "strategy": summary.get("strategy"), "status": summary.get("status"),
            "seq_len": training.get("seq_len"), "global_batch_size": training.get("global_batch_size"),
            "tokens_per_s": summary.get("tokens_per_s"), "step_time_median_s": summary.get("step_time_median_s"),
            "final_loss": summary.get("final_loss")}
    ranks = summary.get("ranks") or []
    if not ranks:  # a failed run: one row that says so
        return [dict(base, cp_size=None, rank=None, activation_bytes=None, param_bytes=None)]
    return [dict(base, cp_size=r.get("cp_size", 1), rank=r["rank"], activation_bytes=r.get("activation_bytes"),
                 param_bytes=r.get("param_bytes")) for r in ranks]


def cp_memory(inputs: TableInputs) -> pd.DataFrame:
    cp_experiments = {s["experiment"] for s in inputs.summaries if _family(s["strategy"]) == CONTEXT}
    rows = [row for s in inputs.summaries if s["experiment"] in cp_experiments
            for row in cp_rows(s, inputs.experiments.get(s["experiment"], {}))]
    return pd.DataFrame(rows, columns=CP_COLUMNS)


def cp_per_run(memory: pd.DataFrame) -> pd.DataFrame:
    ok = memory[(memory["status"] == "ok") & memory["activation_bytes"].notna()]
    if ok.empty:
        return pd.DataFrame(columns=CP_RUN_COLUMNS)
    per = ok.groupby(["experiment", "strategy", "seq_len", "cp_size"], as_index=False, sort=False).agg(
        activation_bytes_per_rank=("activation_bytes", "mean"), tokens_per_s=("tokens_per_s", "first"))
    per["run"] = [f"{s} (c={int(c)})" for s, c in zip(per["strategy"], per["cp_size"])]
    return per[CP_RUN_COLUMNS]


def predicted_per_rank(predictions: pd.DataFrame, experiment: str, strategy: str) -> float | None:
    """The cost model's activation bytes of a run, mean over its ranks (`rank_predictions`)."""
    mine = of_run(predictions, experiment, strategy)
    return mine["predicted_activation_bytes"].mean() if len(mine) else None


def cp_ratio(per: pd.DataFrame, predictions: pd.DataFrame) -> pd.DataFrame:
    """Each context-parallel run over its registry reference of the same experiment, measured and as the
    cost model predicts it."""
    rows = []
    for _, run in per[per["strategy"].map(_family) == CONTEXT].iterrows():
        reference = REGISTRY[run["strategy"]].reference
        ref = per[(per["experiment"] == run["experiment"]) & (per["strategy"] == reference)]
        if ref.empty:
            continue
        ref = ref.iloc[0]
        predicted = predicted_per_rank(predictions, run["experiment"], run["strategy"])
        predicted_ref = predicted_per_rank(predictions, run["experiment"], reference)
        rows.append({"experiment": run["experiment"], "strategy": run["strategy"], "reference": reference,
                     "seq_len": run["seq_len"], "cp_size": run["cp_size"],
                     "reference_activation_bytes": ref["activation_bytes_per_rank"],
                     "activation_bytes_per_rank": run["activation_bytes_per_rank"],
                     "activation_ratio": run["activation_bytes_per_rank"] / ref["activation_bytes_per_rank"],
                     "expected_ratio": 1 / run["cp_size"],
                     "predicted_ratio": predicted / predicted_ref if predicted and predicted_ref else None,
                     "reference_tokens_per_s": ref["tokens_per_s"],
                     "tokens_per_s": run["tokens_per_s"]})
    return pd.DataFrame(rows, columns=RATIO_COLUMNS)


# --- expert parallelism -------------------------------------------------------------------------
def load_rows(summary: dict) -> list[dict]:
    ranks = summary.get("ranks") or []
    if not ranks or "expert_routed" not in ranks[0]:
        return []
    rank = ranks[0]  # routing counts are group totals, identical on every rank
    rows = []
    for layer, (routed, kept) in enumerate(zip(rank["expert_routed"], rank["expert_kept"])):
        total = sum(routed) or 1
        for expert, (r, k) in enumerate(zip(routed, kept)):
            rows.append({"experiment": summary["experiment"], "strategy": summary["strategy"],
                         "world_size": summary.get("world_size"), "layer": layer, "expert": expert, "routed": r,
                         "kept": k, "dropped": r - k, "routed_share": r / total, "processed_share": k / total,
                         "dropped_share": (r - k) / total})
    return rows


def load_shares(load: pd.DataFrame) -> pd.DataFrame:
    """The load chart's bars: processed and dropped shares per expert, for the expert-sharded runs."""
    sharded = load[load["world_size"] > 1]
    chosen = sharded if len(sharded) else load
    fates = chosen[["experiment", "strategy", "world_size", "layer", "expert", "processed_share", "dropped_share"]]
    long = fates.rename(columns={"processed_share": "processed", "dropped_share": "dropped"}).melt(
        id_vars=["experiment", "strategy", "world_size", "layer", "expert"], value_vars=["processed", "dropped"],
        var_name="fate", value_name="share")
    return long[SHARE_COLUMNS]


def dense_strategies() -> set[str]:
    """The dense runs a mixture of experts is measured against, from the registry: the dense references
    (strategies that are their own reference: the single device) and the production data-parallel
    strategy (the twin the hand-written data-parallel strategies are measured against), which splits
    the batch over its ranks as the expert-parallel run does."""
    moe = {name for name, spec in REGISTRY.items() if spec.family == EXPERT}
    references = {name for name, spec in REGISTRY.items() if spec.reference == name} - moe
    twins = {spec.twin for spec in REGISTRY.values() if spec.family == DATA and spec.twin}
    return references | twins


def _same_settings(a: dict, b: dict) -> bool:
    return all(a.get(key) == b.get(key) for key in SAME_SETTINGS)


def _rank_measures(ranks: pd.DataFrame) -> pd.DataFrame:
    per = ranks.groupby(["experiment", "strategy"], as_index=False, sort=False).agg(
        max_rank_param_bytes=("param_bytes", "max"), max_rank_activation_bytes=("activation_bytes", "max"))
    first = ranks[ranks["rank"] == 0].reindex(
        columns=["experiment", "strategy", "dropped_assignments", "assignments", "tokens_fully_dropped"])
    first["dropped_assignments_pct"] = 100 * first["dropped_assignments"] / first["assignments"]
    return per.merge(first.drop(columns=["dropped_assignments", "assignments"]), on=["experiment", "strategy"],
                     how="left")


def _dense_runs(ok: pd.DataFrame, moe_experiment: str, experiments: dict[str, dict]) -> pd.DataFrame:
    """Dense runs of other experiments with the MoE experiment's settings; a run reused from an earlier
    experiment is that run again, so it is left out."""
    mine = experiments[moe_experiment]
    same = [name for name, exp in experiments.items() if name != moe_experiment and _same_settings(exp, mine)]
    dense = ok[ok["experiment"].isin(same) & ok["strategy"].isin(dense_strategies())]
    if "reused_from" in dense:
        dense = dense[dense["reused_from"].isna()]
    return dense


def moe_dense(inputs: TableInputs) -> pd.DataFrame:
    runs, ranks = inputs.tables.get("runs"), inputs.tables.get("ranks")
    if runs is None or ranks is None or runs.empty:
        return pd.DataFrame(columns=DENSE_COLUMNS)
    ok = runs[runs["status"] == "ok"]
    moe = ok[ok["strategy"].map(_family) == EXPERT]
    parts = []
    for name in dict.fromkeys(moe["experiment"]):
        if name not in inputs.experiments:
            continue
        parts.append(moe[moe["experiment"] == name].assign(moe_experiment=name, role="mixture of experts"))
        parts.append(_dense_runs(ok, name, inputs.experiments).assign(moe_experiment=name, role="dense"))
    if not parts:
        return pd.DataFrame(columns=DENSE_COLUMNS)
    table = pd.concat(parts).merge(_rank_measures(ranks), on=["experiment", "strategy"], how="left")
    return table.reindex(columns=DENSE_COLUMNS)


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    memory = cp_memory(inputs)
    per_run = cp_per_run(memory)
    load = pd.DataFrame([row for s in inputs.summaries for row in load_rows(s)], columns=LOAD_COLUMNS)
    return {"cp_memory": memory, "cp_activation": per_run, "cp_activation_ratio": cp_ratio(per_run, given_predictions(inputs)),
            "expert_load": load, "expert_load_shares": load_shares(load), "moe_dense": moe_dense(inputs)}
