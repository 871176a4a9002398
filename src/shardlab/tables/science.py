"""Science runs and domain metrics -> the tables of the report's science section.

Science experiments are those whose data format is a science format (`shardlab.science.formats.FORMATS`);
the rule declares their runs (summaries with step logs), their settings and each one's domain
evaluation (`science_metrics.<experiment>.csv`, from `shardlab.science.evaluate`).

- science_curves: one row per validation point (experiment, domain, strategy, step, elapsed_s, val_loss)
- science_runs: one row per run (status, tokens/s, step time, peak memory, final validation loss,
  the domain's target validation loss and the time each run took to reach it, its saved weights' digest and
  its registry reference, the run it is checked against)
- science_metrics: the evaluators' rows of each run's final model (value, baseline, their bootstrap intervals)
- science_fine_tuning: each final model's metrics against the base model's on the same test rows (the
  paired difference's interval: what fine-tuning changed)
- science_domain_curves: the evaluators' rows at every evaluated step (0: the base model before
  fine-tuning; training.save_model_every snapshots; the final model), a domain metric against step
- science_published: each metric's final value (median over runs) beside one published figure from a real
  domain model (`science/published.yaml`: source, and how its setting differs)
- science_tokenizers: the tokenizer comparison of each pretrained base model (rule pretrain), with
  the choice per domain and the one the base model uses
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import yaml

from shardlab.science.domains import metric_title
from shardlab.science.evaluate import BASE_MODEL
from shardlab.science.evaluate import COLUMNS as METRIC_COLUMNS
from shardlab.science.formats import FORMATS
from shardlab.science.tokenization import TABLE_PREFIX
from shardlab.strategies import REGISTRY
from shardlab.tables import TableInputs

RUN_COLUMNS = ["experiment", "domain", "strategy", "status", "reason", "world_size", "steps", "tokens_per_s",
               "step_time_median_s", "peak_bytes_max_rank", "peak_kind", "final_val_loss", "target_val_loss",
               "time_to_target_s", "weights", "reference"]
CURVE_COLUMNS = ["experiment", "domain", "strategy", "step", "elapsed_s", "val_loss"]
PUBLISHED = Path(__file__).parents[1] / "science" / "published.yaml"
PUBLISHED_COLUMNS = ["domain", "metric", "metric_title", "test_set", "value", "low", "high", "runs", "better", "published", "unit", "model",
                     "source", "url", "differs"]
TOKENIZER_COLUMNS = ["model", "domain", "tokenizer", "vocab_size", "bodies", "tokens_per_char", "unit_crossing_fraction",
                     "rare_token_fraction", "types_used", "chosen_for_domain", "used_by_base_model", "reason"]


def is_science(exp: dict) -> bool:
    return exp["data"]["format"] in FORMATS


def metrics_table_name(experiment: str) -> str:
    """The stem of an experiment's evaluation table (rule science_evaluate), as TableInputs keys it."""
    return f"science_metrics.{experiment}"


def time_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    """Wall seconds at the first validation point with loss <= target (None if never reached)."""
    return next((t for t, loss in curve if loss <= target), None)


def validation_points(summary: dict) -> list[dict]:
    return [r for r in summary.get("step_log") or [] if r.get("val_loss") is not None]


def run_row(exp: dict, domain: str, summary: dict) -> dict:
    ranks = [r for r in summary.get("ranks") or [] if r]
    ok = summary["status"] == "ok"
    return {
        "experiment": exp["name"], "domain": domain, "strategy": summary["strategy"],
        "status": summary["status"], "reason": summary.get("reason"), "world_size": summary.get("world_size"),
        # The summary's step count (TableInputs puts the step records under "steps"): a finished run ran them all.
        "steps": exp["training"]["steps"] if ok else None,
        "tokens_per_s": summary.get("tokens_per_s"), "step_time_median_s": summary.get("step_time_median_s"),
        "peak_bytes_max_rank": max((r.get("peak_bytes") or 0 for r in ranks), default=None),
        "peak_kind": ranks[0].get("peak_kind") if ranks else None,
        "final_val_loss": summary.get("final_val_loss"),
        "reference": REGISTRY[summary["strategy"]].reference,
    }


def run_rows(exp: dict, summaries: list[dict]) -> tuple[list[dict], list[dict]]:
    """(runs, curves) of one experiment; time-to-target needs all its runs, so it is filled here."""
    domain = FORMATS[exp["data"]["format"]].domain
    by_strategy = {s["strategy"]: s for s in summaries if s["experiment"] == exp["name"]}
    runs, curves, per_run_curve = [], [], {}
    for strategy in (s for s in exp["strategies"] if s in by_strategy):
        summary = by_strategy[strategy]
        points = validation_points(summary)
        per_run_curve[strategy] = [(r["elapsed_s"], r["val_loss"]) for r in points]
        curves += [{"experiment": exp["name"], "domain": domain, "strategy": strategy, "step": r["step"] + 1,
                    "elapsed_s": r["elapsed_s"], "val_loss": r["val_loss"]} for r in points]
        runs.append(run_row(exp, domain, summary))
    finals = [r["final_val_loss"] for r in runs if r["status"] == "ok" and r["final_val_loss"] is not None]
    # Unless the experiment sets one, the target is the worst final loss: every finished run reaches it.
    target = (exp.get("evaluation") or {}).get("target_val_loss") or (max(finals) if finals else None)
    for row in runs:
        row["target_val_loss"] = target
        curve = per_run_curve[row["strategy"]]
        row["time_to_target_s"] = time_to_target(curve, target) if target is not None and row["status"] == "ok" else None
    return runs, curves


def published_rows(finals: pd.DataFrame, references: list[dict]) -> pd.DataFrame:
    """Each measured metric (median over the final models) beside its published reference, if any; a
    reference without a `test_set` stands for the metric on every test set."""
    rows = []
    for (domain, test_set, metric), g in finals.groupby(["domain", "test_set", "metric"]):
        ref = next((r for r in references if (r["domain"], r["metric"]) == (domain, metric)
                    and r.get("test_set", test_set) == test_set), None)
        if ref is None:
            continue
        rows.append({"domain": domain, "metric": metric, "metric_title": metric_title(metric, test_set),
                     "test_set": test_set, "value": g["value"].median(),
                     "low": g["low"].median(), "high": g["high"].median(), "runs": len(g), "better": g["better"].iloc[0],
                     "published": ref["value"], **{k: ref.get(k) for k in ("unit", "model", "source", "url", "differs")}})
    return pd.DataFrame(rows, columns=PUBLISHED_COLUMNS)


OUTCOME_COLUMNS = ["domain", "experiment", "test_set", "metric", "metric_title", "better", "runs", "value", "baseline",
                   "baseline_name", "beats_baseline", "before", "improved", "worse"]
EVERY, SOME, NONE = "every run", "some runs", "no run"  # how many of an experiment's runs a statement holds for


def _in_runs(flags: pd.Series) -> str | None:
    """'every run', 'some runs' or 'no run' for a boolean per run (None where none was decided)."""
    decided = flags.dropna().astype(str).str.lower().eq("true")
    if decided.empty:
        return None
    return EVERY if decided.all() else SOME if decided.any() else NONE


def outcomes(finals: pd.DataFrame, gains: pd.DataFrame) -> pd.DataFrame:
    """One row per metric of a science experiment, each verdict over its runs computed once: whether the fine-tuned
    models beat the trivial baseline beyond noise, and whether fine-tuning improved (or worsened) the metric
    against the base model on the same rows. The report's counts of metrics are counts of these rows."""
    keys = ["domain", "experiment", "test_set", "metric"]
    rows = []
    for key, g in finals.groupby(keys, sort=True):
        row = dict(zip(keys, key), metric_title=metric_title(key[3], key[2]), better=g["better"].iloc[0],
                   runs=len(g), value=g["value"].median(), baseline=g["baseline"].median(),
                   baseline_name=g["baseline_name"].iloc[0],
                   beats_baseline=_in_runs(g["beats_baseline"]) if g["baseline"].notna().any() else None)
        paired = gains[(gains[keys] == pd.Series(dict(zip(keys, key)))).all(axis=1)] if len(gains) else gains
        if len(paired):
            higher = paired["better"].iloc[0] == "higher"  # worse: the whole interval of after − before on the bad side
            bad = paired["difference_high"] < 0 if higher else paired["difference_low"] > 0
            row.update(before=paired["baseline"].median(), improved=_in_runs(paired["beats_baseline"]),
                       worse=_in_runs(bad))
        rows.append(row)
    return pd.DataFrame(rows, columns=OUTCOME_COLUMNS)


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    runs, curves, metrics = [], [], []
    for name, exp in inputs.experiments.items():
        if not is_science(exp):
            continue
        r, c = run_rows(exp, inputs.summaries)
        runs += r
        curves += c
        if metrics_table_name(name) in inputs.tables:
            metrics.append(inputs.tables[metrics_table_name(name)])
    metrics = [m for m in metrics if len(m)]
    every = (pd.concat(metrics, ignore_index=True) if metrics else pd.DataFrame(columns=METRIC_COLUMNS)).reindex(
        columns=METRIC_COLUMNS)
    every["metric_title"] = [metric_title(m, t) for m, t in zip(every["metric"], every["test_set"])]
    final = every["final"].astype(str).str.lower().eq("true")
    gains = every["compared_with"].eq(BASE_MODEL)
    tokenizers = [table.assign(model=name.removeprefix(TABLE_PREFIX)) for name, table in inputs.tables.items()
                  if name.startswith(TABLE_PREFIX)]
    # Each run's saved model by digest (the evaluation's), so that identical weights can be named.
    digests = every[final].drop_duplicates(["experiment", "strategy"]).set_index(["experiment", "strategy"])["weights"]
    for row in runs:
        row["weights"] = digests.get((row["experiment"], row["strategy"]))
    return {"science_runs": pd.DataFrame(runs, columns=RUN_COLUMNS),
            "science_curves": pd.DataFrame(curves, columns=CURVE_COLUMNS),
            "science_metrics": every[final & ~gains].reset_index(drop=True),
            "science_fine_tuning": every[gains].reset_index(drop=True),
            "science_outcomes": outcomes(every[final & ~gains & every["value"].notna()], every[gains]),
            "science_published": published_rows(every[final & ~gains & every["value"].notna()],
                                                yaml.safe_load(PUBLISHED.read_text())),
            "science_domain_curves": every[every["value"].notna() & ~gains].sort_values(
                ["experiment", "strategy", "test_set", "metric", "step"], kind="stable").reset_index(drop=True),
            "science_tokenizers": (pd.concat(tokenizers, ignore_index=True) if tokenizers
                                   else pd.DataFrame(columns=TOKENIZER_COLUMNS)).reindex(columns=TOKENIZER_COLUMNS)}
