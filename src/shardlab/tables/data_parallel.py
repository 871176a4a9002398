"""Data parallelism's tables, from the runs of the strategies whose registry topic is `data_parallel`
(and their reference runs), per experiment.

- dp_throughput: per run, tokens/s, the ratio to its registry `reference` run and, for a
  hand-written strategy, to its production `twin` (same experiment). Reference runs are rows too
  (ratio 1), so a chart of every run reads this table alone.
- dp_pairs: every ordered pair of finished runs of one family in one experiment (the hand-written
  strategies against each other and against their twin): the throughput ratio.
Every ratio has a 95 % bootstrap interval over the two runs' timed steps (`*_low`, `*_high`:
`core.step_stats.throughput_ratio`), where the runs' step logs are given.
- dp_comm_steps: per step, the time a rank was blocked in gradient communication, for the runs
  that record it (hand-written strategies time their collectives; DDP's run inside backward).
- dp_buckets: the bucket-size sweep of interleaved DP (its `bucket_mb` option, per experiment): per
  run, the buckets its plan issues, the alpha-beta prediction of their all-reduces (with the
  latency part, buckets x alpha) beside the communication the run left exposed, and its tokens/s
  against DDP in the same experiment, with the within-run interval and the interval widened by the
  measured run-to-run noise (`core.step_stats.with_run_noise`, as the verdicts).

`throughput_rows` serves every topic whose strategies have references and twins (tensor parallel too).
"""

from __future__ import annotations

import pandas as pd

from shardlab.core.step_stats import run_to_run_sigma, throughput_ratio, timed_times, with_run_noise
from shardlab.costs.alpha_beta import models_from_table
from shardlab.costs.network import plan_seconds
from shardlab.costs.predict import collectives
from shardlab.strategies import REGISTRY
from shardlab.strategies.roles import hand_written_data_parallel
from shardlab.tables import TableInputs
from shardlab.tables.rank_predictions import run_setting

TOPIC = "data_parallel"
THROUGHPUT_COLUMNS = ["experiment", "strategy", "family", "reference", "twin", "status", "world_size", "compute",
                      "tokens_per_s", "step_time_median_s", "reference_compute", "reference_tokens_per_s", "ratio_to_reference",
                      "ratio_to_reference_low", "ratio_to_reference_high", "twin_tokens_per_s", "ratio_to_twin",
                      "ratio_to_twin_low", "ratio_to_twin_high"]
PAIR_COLUMNS = ["experiment", "family", "strategy", "other", "tokens_per_s", "other_tokens_per_s", "ratio",
                "ratio_low", "ratio_high"]
BUCKET_COLUMNS = ["experiment", "bucket_mb", "buckets", "tokens_per_s", "step_time_median_s", "comm_exposed_s",
                  "comm_predicted_s", "latency_predicted_s", "ddp_tokens_per_s", "ratio_to_ddp", "ratio_to_ddp_low",
                  "ratio_to_ddp_high", "ratio_to_ddp_noise_low", "ratio_to_ddp_noise_high"]
BUCKETED, PRODUCTION = hand_written_data_parallel(bucketed=True)  # the bucket sweep and its yardstick
COMM_COLUMNS = ["experiment", "strategy", "status", "step", "timed", "comm_time_s", "step_time_s", "comm_fraction"]


def of_topic(summaries: list[dict], topic: str) -> list[dict]:
    return [s for s in summaries if REGISTRY[s["strategy"]].topic == topic]


def _rate(run: dict | None) -> float | None:
    """tokens/s of a finished run, None for a missing or failed one (it has no throughput to compare)."""
    return run.get("tokens_per_s") if run and run.get("status") == "ok" else None


def _compute(run: dict | None) -> str | None:
    """What a finished run computed on ('2 cores', '8 GPUs'), beside its throughput."""
    if not run or run.get("status") != "ok" or "compute" not in run:
        return None
    count, unit = run["compute"]["count"], run["compute"]["unit"]
    return f"{count} {unit}{'s' * (count != 1)}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def step_times(summaries: list[dict], experiments: dict[str, dict]) -> dict[tuple[str, str], list[float]]:
    """Timed step times of every finished run with a step log, by (experiment, strategy)."""
    times = {}
    for s in summaries:
        exp = experiments.get(s["experiment"])
        if exp and (t := timed_times(s, exp["training"]["warmup_steps"])):
            times[s["experiment"], s["strategy"]] = t
    return times


def interval(times: dict, experiment: str, a: str | None, b: str | None) -> tuple[float | None, float | None]:
    """The 95 % interval of run a's tokens/s over run b's, (None, None) without both step logs."""
    if a is None or b is None or (experiment, a) not in times or (experiment, b) not in times:
        return None, None
    _, low, high = throughput_ratio(times[experiment, a], times[experiment, b])
    return low, high


def throughput_rows(summaries: list[dict], topic: str, times: dict | None = None) -> pd.DataFrame:
    """One row per run of `topic` and per reference run they are compared with, in input order; with
    `times` (`step_times`), each ratio's interval."""
    times = times or {}
    by_run = {(s["experiment"], s["strategy"]): s for s in summaries}
    wanted = set()
    for s in of_topic(summaries, topic):
        wanted |= {(s["experiment"], s["strategy"]), (s["experiment"], REGISTRY[s["strategy"]].reference)}
    rows = []
    for key, s in by_run.items():
        if key not in wanted:
            continue
        spec = REGISTRY[s["strategy"]]
        rate = _rate(s)
        reference = _rate(by_run.get((s["experiment"], spec.reference)))
        twin = _rate(by_run.get((s["experiment"], spec.twin))) if spec.twin else None
        ref_low, ref_high = interval(times, s["experiment"], s["strategy"], spec.reference)
        twin_low, twin_high = interval(times, s["experiment"], s["strategy"], spec.twin)
        rows.append({"experiment": s["experiment"], "strategy": s["strategy"], "family": spec.family,
                     "reference": spec.reference, "twin": spec.twin, "status": s["status"],
                     "world_size": s.get("world_size"), "compute": _compute(s), "tokens_per_s": rate,
                     "step_time_median_s": s.get("step_time_median_s"),
                     "reference_compute": _compute(by_run.get((s["experiment"], spec.reference))),
                     "reference_tokens_per_s": reference,
                     "ratio_to_reference": _ratio(rate, reference), "ratio_to_reference_low": ref_low,
                     "ratio_to_reference_high": ref_high, "twin_tokens_per_s": twin, "ratio_to_twin": _ratio(rate, twin),
                     "ratio_to_twin_low": twin_low, "ratio_to_twin_high": twin_high})
    return pd.DataFrame(rows, columns=THROUGHPUT_COLUMNS)


def pair_rows(throughput: pd.DataFrame, topic: str, times: dict | None = None) -> pd.DataFrame:
    """Every ordered pair (strategy, other) of finished runs of the topic's strategies that share a
    family and an experiment: tokens/s of strategy over tokens/s of other."""
    mine = throughput[throughput["strategy"].map(lambda s: REGISTRY[s].topic == topic)
                      & throughput["tokens_per_s"].notna()]
    rows = []
    for (experiment, family), group in mine.groupby(["experiment", "family"], sort=False):
        for a in group.itertuples():
            for b in group.itertuples():
                if a.strategy != b.strategy:
                    low, high = interval(times or {}, experiment, a.strategy, b.strategy)
                    rows.append({"experiment": experiment, "family": family, "strategy": a.strategy,
                                 "other": b.strategy, "tokens_per_s": a.tokens_per_s,
                                 "other_tokens_per_s": b.tokens_per_s, "ratio": a.tokens_per_s / b.tokens_per_s,
                                 "ratio_low": low, "ratio_high": high})
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


def comm_step_rows(summaries: list[dict], experiments: dict[str, dict], topic: str) -> pd.DataFrame:
    """Steps whose blocked communication time was recorded; `timed`: past the warm-up steps, the
    ones the run's medians use."""
    rows = []
    for s in of_topic(summaries, topic):
        warmup = experiments[s["experiment"]]["training"]["warmup_steps"] if s["experiment"] in experiments else 0
        for step in s.get("step_log", []):
            comm = step.get("comm_time_s")
            if comm is None:
                continue
            step_time = step.get("step_time_s")
            rows.append({"experiment": s["experiment"], "strategy": s["strategy"], "status": s["status"],
                         "step": step["step"], "timed": step["step"] >= warmup, "comm_time_s": comm,
                         "step_time_s": step_time, "comm_fraction": comm / step_time if step_time else None})
    return pd.DataFrame(rows, columns=COMM_COLUMNS)


def bucket_rows(inputs: TableInputs, times: dict) -> pd.DataFrame:
    """One row per finished interleaved-DP run whose model shape is known (see the module docstring)."""
    fits = inputs.tables.get("comm_fit")
    models = models_from_table(fits) if fits is not None else {}
    sigma = run_to_run_sigma(inputs.tables.get("timing_noise"))
    by_run = {(s["experiment"], s["strategy"]): s for s in inputs.summaries}
    rows = []
    for (experiment, strategy), run in by_run.items():
        exp = inputs.experiments.get(experiment)
        shape = exp and inputs.model_shape(exp)
        if strategy != BUCKETED or run["status"] != "ok" or shape is None:
            continue
        spec = REGISTRY[strategy]
        plan = collectives(*run_setting(run, exp, inputs))
        ddp = _rate(by_run.get((experiment, PRODUCTION)))
        low, high = interval(times, experiment, strategy, PRODUCTION)
        ratio = _ratio(run["tokens_per_s"], ddp)
        noisy = with_run_noise(ratio, low, high, sigma) if low is not None else (None, None)
        buckets = sum(c.count for c in plan)
        rows.append({"experiment": experiment, "bucket_mb": spec.options(exp).get("bucket_mb"),
                     "buckets": buckets, "tokens_per_s": run["tokens_per_s"],
                     "step_time_median_s": run["step_time_median_s"], "comm_exposed_s": run.get("comm_time_median_s"),
                     "comm_predicted_s": plan_seconds(plan, models) if models else None,
                     "latency_predicted_s": buckets * models["all_reduce"].alpha_s
                     if "all_reduce" in models else None,
                     "ddp_tokens_per_s": ddp, "ratio_to_ddp": ratio, "ratio_to_ddp_low": low, "ratio_to_ddp_high": high,
                     "ratio_to_ddp_noise_low": noisy[0], "ratio_to_ddp_noise_high": noisy[1]})
    return pd.DataFrame(rows, columns=BUCKET_COLUMNS).sort_values("buckets", ascending=False)


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    times = step_times(inputs.summaries, inputs.experiments)
    throughput = throughput_rows(inputs.summaries, TOPIC, times)
    return {"dp_throughput": throughput, "dp_pairs": pair_rows(throughput, TOPIC, times),
            "dp_comm_steps": comm_step_rows(inputs.summaries, inputs.experiments, TOPIC),
            "dp_buckets": bucket_rows(inputs, times)}
