"""Every run's summary and step log -> the tidy tables of the report's main sections.

- runs: one row per run (status, reason, throughput, loss, settings, environment, topic, reference)
- steps: one row per run step (loss, step time, tokens/s, communication time, validation loss, and
  `timed`: whether it counts in the run's step-time statistics, `core.step_stats`)
- ranks: one row per run rank: measured parameter/gradient/optimizer/activation bytes, peak, extras,
  and the cost model's model-state prediction beside them (`predicted_*_bytes`, from rank_predictions)
- rank_predictions: the cost model's per-rank prediction of every run, the one the other topics read
  (`tables.rank_predictions`)
- activations: one row per run rank module (bytes saved for backward)
- parity: one row per parallel run: its largest loss deviation from its reference run (same
  experiment) against the rounding tolerance of `tables.parity` (a bound, or its measured noise floor)
- parity_rule: the rule's constants (one row), for the report
- parity_sensitivity (when the study has `parity_sensitivity`): the same rule against errors injected
  on purpose, per dtype (`bench.parity_sensitivity`); parity_caught: how many it caught, and the smallest
- resharding (when the study has `resharding`): a checkpoint resumed under other plans (`bench.resharding`),
  each resumed curve against the uninterrupted one and the single-device reference, by the same rule
- environments: the distinct software/hardware environments the finished runs ran in
- launch_cost: where a launch's time goes, per phase (`startup` in each summary: agent start, rendezvous
  and spawn, the ranks' imports, process group, model load, strategy set-up, data and resume, training,
  save, the agent's exit), median and 10-90 % range over the finished runs that launched, and the fixed
  cost (the launch's wall time less training)
- experiments: one row per experiment: model, parameters, steps, tokens per step, finished runs
"""

from __future__ import annotations

import json

import pandas as pd

from shardlab.core.step_stats import timed_steps
from shardlab.strategies import REGISTRY
from shardlab.tables import TableInputs
from shardlab.tables.mechanisms import mechanisms, strategies
from shardlab.tables.parity import parity_rows, rule_rows, sensitivity_rows
from shardlab.tables.resharding import resharding_rows
from shardlab.tables.rank_predictions import STATES, of_run, rank_predictions

RUN_KEYS = ("experiment", "strategy", "status")


def _scalars(d: dict, prefix: str = "") -> dict:
    """Scalar fields as columns; nested dicts flattened with a prefix; lists as JSON text."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_scalars(value, f"{prefix}{key}."))
        elif isinstance(value, list):
            out[f"{prefix}{key}"] = json.dumps(value)
        else:
            out[f"{prefix}{key}"] = value
    return out


def predicted_states(summary: dict, predictions: pd.DataFrame) -> dict[int, dict]:
    """A finished run's predicted model states by rank (`predicted_*`), from `rank_predictions`."""
    if summary.get("status") != "ok":
        return {}
    mine = of_run(predictions, summary.get("experiment"), summary.get("strategy"))
    return {rank: {f"predicted_{key}": row[f"predicted_{key}"] for key in STATES} for rank, row in mine.iterrows()}


def run_tables(summary: dict, inputs: TableInputs,
               predictions: pd.DataFrame) -> tuple[dict, list[dict], list[dict], list[dict]]:
    summary = dict(summary)
    key = {k: summary.get(k) for k in RUN_KEYS}
    ranks = summary.pop("ranks", []) or []
    steps = summary.pop("step_log", [])
    exp = inputs.experiments.get(summary.get("experiment"))
    timed = {r["step"] for r in timed_steps(steps, exp["training"]["warmup_steps"])} if exp else set()
    steps = [dict(s, timed=s["step"] in timed) for s in steps]
    spec = REGISTRY.get(summary.get("strategy"))
    run = dict(_scalars(summary), topic=spec and spec.topic, reference=spec and spec.reference)
    predicted = predicted_states(summary, predictions)
    rank_rows, activation_rows = [], []
    for rank in ranks:
        rank = dict(rank)
        by_module = rank.pop("activation_by_module", {}) or {}
        rank_rows.append(dict(key, **_scalars(rank), **predicted.get(rank["rank"], {})))
        activation_rows += [dict(key, rank=rank["rank"], module=m, bytes=b) for m, b in by_module.items()]
    return run, [dict(key, **s) for s in steps], rank_rows, activation_rows


def compute_units(runs: pd.DataFrame) -> dict[tuple[str, str], tuple[int, str]]:
    """(GPUs or CPU cores, unit) of every finished run by (experiment, strategy): what a throughput used."""
    if "compute.count" not in runs:
        return {}
    ok = _ok(runs).dropna(subset=["compute.count"])
    return {(r["experiment"], r["strategy"]): (int(r["compute.count"]), r["compute.unit"]) for _, r in ok.iterrows()}


def unequal_compute(units: dict, experiment: str, a: str, b: str) -> str:
    """'' when runs a and b of an experiment used as many cores (or GPUs), else what each used, to state beside
    their throughput ratio (a one-process run gets the cores of the widest run on CPU, never more GPUs)."""
    ua, ub = units.get((experiment, a)), units.get((experiment, b))
    if ua is None or ub is None or ua == ub:
        return ""
    return f"{ua[0]} {ua[1]}{'s' * (ua[0] != 1)} against {ub[0]}"


ENVIRONMENT = ("device_type", "device_name", "cpu_model", "cpu_cores", "memory_gib", "backend", "world_size",
               "threads_per_rank", "torch", "cuda", "nccl", "transformers", "deepspeed", "python", "git_commit", "git_dirty")


def _ok(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["status"] == "ok"] if "status" in runs else runs


def environments(runs: pd.DataFrame) -> pd.DataFrame:
    ok = _ok(runs)
    cols = [f"environment.{c}" for c in ENVIRONMENT if f"environment.{c}" in ok]
    # A field that no run has (CUDA and NCCL on a CPU) is left out rather than shown empty.
    return ok[cols].dropna(axis=1, how="all").drop_duplicates().rename(columns=lambda c: c.removeprefix("environment."))


LAUNCH_PHASES = ("agent_start_s", "rendezvous_and_spawn_s", "worker_imports_s", "process_group_s", "model_load_s",
                 "strategy_setup_s", "data_and_resume_s", "training_s", "save_and_gather_s")
LAUNCH_COST_COLUMNS = ["phase", "median_s", "p10_s", "p90_s", "runs", "rank_server"]


def launch_cost(runs: pd.DataFrame) -> pd.DataFrame:
    """Per launch phase, the median and 10-90 % range (seconds) over the finished runs that launched
    (not shared references); `exit_s` is the rest of the launch's wall time, `fixed_s` all but training."""
    ok = _ok(runs)
    if "reused_from" in ok:  # a shared reference repeats the launch it borrows
        ok = ok[ok["reused_from"].isna()]
    columns = [f"startup.{phase}" for phase in (*LAUNCH_PHASES, "launch_wall_s")]
    if ok.empty or not set(columns) <= set(ok):
        return pd.DataFrame(columns=LAUNCH_COST_COLUMNS)
    phases = ok[columns].dropna().rename(columns=lambda c: c.removeprefix("startup."))
    phases["exit_s"] = phases["launch_wall_s"] - phases[list(LAUNCH_PHASES)].sum(axis=1)
    phases["fixed_s"] = phases["launch_wall_s"] - phases["training_s"]
    forked = ok.loc[phases.index].get("environment.rank_server", pd.Series(False, index=phases.index))
    quantiles = phases.quantile([0.5, 0.1, 0.9]).T
    return pd.DataFrame({"phase": quantiles.index, "median_s": quantiles[0.5].values, "p10_s": quantiles[0.1].values,
                         "p90_s": quantiles[0.9].values, "runs": len(phases),
                         "rank_server": f"{int(forked.fillna(False).astype(bool).sum())} of {len(phases)}"},
                        columns=LAUNCH_COST_COLUMNS)


def experiments(runs: pd.DataFrame) -> pd.DataFrame:
    ok = _ok(runs)
    if ok.empty:
        return pd.DataFrame(columns=["experiment", "model", "parameters", "steps", "tokens_per_step", "runs"])
    return ok.groupby("experiment", sort=False).agg(
        model=("model.name", "first"), parameters=("model.parameters", "first"), steps=("steps", "first"),
        tokens_per_step=("tokens_per_step", "first"), config_hash=("config_hash", "first"),
        runs=("strategy", "count")).reset_index()


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    predictions = rank_predictions(inputs)
    runs, steps, ranks, activations = [], [], [], []
    for summary in inputs.summaries:
        r, s, k, a = run_tables(summary, inputs, predictions)
        runs.append(r)
        steps += s
        ranks += k
        activations += a
    tables = {
        "runs": pd.DataFrame(runs),
        "steps": pd.DataFrame(steps, columns=None if steps else [*RUN_KEYS, "step", "loss"]),
        "ranks": pd.DataFrame(ranks, columns=None if ranks else [*RUN_KEYS, "rank"]),
        "activations": pd.DataFrame(activations, columns=[*RUN_KEYS, "rank", "module", "bytes"]),
    }
    tables["parity"] = parity_rows(inputs.summaries, inputs.experiments)
    tables["parity_rule"] = rule_rows()
    if "parity_sensitivity_losses" in inputs.tables:  # the rule against injected errors (bench.parity_sensitivity)
        tables["parity_sensitivity"] = sensitivity_rows(inputs.tables["parity_sensitivity_losses"], inputs.experiments)
        tables["parity_caught"] = caught_per_dtype(tables["parity_sensitivity"])
    if "resharding_losses" in inputs.tables:  # a checkpoint resumed under other plans (bench.resharding)
        tables["resharding"] = resharding_rows(inputs.tables["resharding_losses"], inputs.experiments, inputs.summaries)
    tables["environments"] = environments(tables["runs"])
    tables["launch_cost"] = launch_cost(tables["runs"])
    tables["experiments"] = experiments(tables["runs"])
    tables["rank_predictions"] = predictions
    tables["strategies"] = strategies(s["strategy"] for s in inputs.summaries)
    tables["mechanisms"] = mechanisms(inputs.summaries, predictions)
    ok = int((tables["runs"]["status"] == "ok").sum()) if len(runs) else 0
    print(f"aggregated {len(runs)} runs ({ok} ok, {len(runs) - ok} failed/oom)")
    return tables


def caught_per_dtype(sensitivity: pd.DataFrame) -> pd.DataFrame:
    """Per dtype, of the errors injected on purpose (parity_sensitivity): how many the check caught, of how many,
    and the smallest relative change of the mean gradient among those caught (NaN where none of known size was)."""
    ok = sensitivity[(sensitivity["status"] == "ok") & (sensitivity["injected"] != "none")]
    rows = []
    for dtype, g in ok.groupby("dtype", sort=False):
        caught = g[g["outcome"] == "fail"]
        sized = caught.dropna(subset=["gradient_error"])
        smallest = sized.loc[sized["gradient_error"].idxmin()] if len(sized) else None
        rows.append({"dtype": dtype, "caught": len(caught), "injected": len(g),
                     "smallest_gradient_error": smallest["gradient_error"] if smallest is not None else float("nan"),
                     "smallest_case": smallest["case"] if smallest is not None else ""})
    return pd.DataFrame(rows, columns=["dtype", "caught", "injected", "smallest_gradient_error", "smallest_case"])


def timed_on(runs: pd.DataFrame | None, experiment: str, strategies: tuple[str, ...]) -> str:
    """'on CPU, 2 cores, 2 ranks each' for the runs compared; flags more ranks than cores (they time-share)."""
    if runs is None or runs.empty or "environment.cpu_cores" not in runs:
        return ""
    mine = runs[(runs["experiment"] == experiment) & runs["strategy"].isin(strategies)]
    if mine.empty:
        return ""
    first = mine.iloc[0]
    ranks = sorted(mine["world_size"].dropna().astype(int).unique())
    if first.get("environment.device_type") == "cuda":
        return f"on {first['environment.device_name']}, {' and '.join(map(str, ranks))} ranks"
    cores = int(first["environment.cpu_cores"])
    crowded = [r for r in ranks if r > cores]
    return (f"on CPU, {cores} cores, {' and '.join(map(str, ranks))} ranks"
            + (" (more ranks than cores: they time-share)" if crowded else ""))
