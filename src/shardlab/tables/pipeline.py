"""Pipeline runs (the strategies whose registry topic is `pipeline`) -> the tables of the pipeline
section, with the bubble theory (`shardlab.costs.bubble`) beside the measurements.

- pipeline: one row per run rank: schedule, p, v, m, the rank's stages, measured busy/span/idle
  fraction/bubble ratio, the theory, whether the rank is its pipeline's bottleneck (most compute)
  and, for the bottleneck, its idle share minus the theory's (`idle_error`) and whether that is
  within the model's stated tolerance (`idle_tolerance`, `follows_theory`: `costs.bubble.TOLERANCE`), and memory (the loop probe's activation bytes, all activations saved over the step, their peak
  live bytes across the schedule, parameters, gradients). A failed run is one row that says so.
- pipeline_timeline: one row per op (forward, loss, backward) of one measured step per rank, with
  a `run` label, for a timeline per run.
- pipeline_theory: the theory curve over m = 1..16 for every (p, v) the finished runs used.
- pipeline_memory: the finished runs' per-rank memory measures in long form (one row per measure).
- pipeline_hybrid: every finished run with more than one pipeline replica (dp x pp) beside the
  single-pipeline runs of its experiment with the same schedule, p, v and m, and each hybrid rank's
  peak live activations relative to the same stage of that pipeline.
"""

from __future__ import annotations

import json

import pandas as pd

from shardlab.costs.bubble import TOLERANCE as BUBBLE_TOLERANCE
from shardlab.costs.bubble import theory_bubble_ratio, theory_idle_fraction
from shardlab.strategies import REGISTRY
from shardlab.tables import TableInputs

TOPIC = "pipeline"
COLUMNS = ["experiment", "strategy", "status", "reason", "schedule", "world_size", "pp_size", "virtual_stages",
           "n_microbatches", "rank", "dp_rank", "stage_ids", "stage_units", "busy_s", "span_s", "idle_fraction",
           "bubble_ratio", "theory_idle_fraction", "theory_bubble_ratio", "bottleneck", "idle_error", "idle_tolerance",
           "follows_theory",
           "activation_bytes",
           "saved_activation_bytes", "peak_live_activation_bytes", "param_bytes", "grad_bytes", "step_time_median_s",
           "tokens_per_s", "final_loss"]
TIMELINE_COLUMNS = ["experiment", "strategy", "n_microbatches", "rank", "op", "stage", "micro_batch", "start_s", "end_s",
                    "run"]
THEORY_COLUMNS = ["p", "v", "m", "theory_idle_fraction", "theory_bubble_ratio", "theory"]
THEORY_MICROBATCHES = range(1, 17)
MEMORY_MEASURES = {"saved_activation_bytes": "activations saved over the step",
                   "peak_live_activation_bytes": "peak live activations", "param_bytes": "parameters"}
MEMORY_COLUMNS = ["experiment", "strategy", "n_microbatches", "run", "rank", "measure", "bytes"]
HYBRID_COLUMNS = ["experiment", "strategy", "role", "pipelines", "world_size", "rank", "dp_rank", "stage_ids",
                  "param_bytes", "peak_live_activation_bytes", "peak_live_ratio_to_pipeline", "idle_fraction",
                  "tokens_per_s", "final_loss"]


def _in_topic(summary: dict) -> bool:
    spec = REGISTRY.get(summary.get("strategy"))
    return spec is not None and spec.topic == TOPIC


def _theory(p, m, v) -> tuple[float | None, float | None]:
    if not (p and m and v):
        return None, None
    return theory_idle_fraction(p, m, v), theory_bubble_ratio(p, m, v)


def _rank_row(base: dict, r: dict) -> dict:
    p, v, m = r.get("pp_size"), r.get("pp_virtual_stages"), r.get("pp_n_microbatches")
    idle, ratio = _theory(p, m, v)
    return dict(
        base, schedule=r.get("pp_schedule"), pp_size=p, virtual_stages=v, n_microbatches=m, rank=r["rank"],
        dp_rank=r.get("dp_rank", 0), stage_ids=json.dumps(r.get("pp_stage_ids")),
        stage_units=json.dumps(r.get("pp_stage_units")), busy_s=r.get("pp_busy_s"), span_s=r.get("pp_step_span_s"),
        idle_fraction=r.get("pp_idle_fraction"), bubble_ratio=r.get("pp_bubble_ratio"),
        theory_idle_fraction=idle, theory_bubble_ratio=ratio,
        activation_bytes=r.get("activation_bytes"), saved_activation_bytes=r.get("pp_saved_activation_bytes"),
        peak_live_activation_bytes=r.get("pp_peak_live_activation_bytes"),
        param_bytes=r.get("param_bytes"), grad_bytes=r.get("grad_bytes"))


def run_rows(summary: dict) -> list[dict]:
    base = {"experiment": summary.get("experiment"), "strategy": summary.get("strategy"),
            "status": summary.get("status"), "reason": summary.get("reason"), "world_size": summary.get("world_size"),
            "step_time_median_s": summary.get("step_time_median_s"), "tokens_per_s": summary.get("tokens_per_s"),
            "final_loss": summary.get("final_loss")}
    ranks = [r for r in summary.get("ranks") or [] if r]
    if not ranks:  # a failed run: one row that says so
        return [base]
    rows = [_rank_row(base, r) for r in ranks]
    # The bottleneck is the rank with the most compute in its pipeline (data-parallel replica): its idle
    # time is the schedule's bubble; lighter stages also wait for it (stage imbalance).
    for dp in {row["dp_rank"] for row in rows}:
        replica = [row for row in rows if row["dp_rank"] == dp and row["busy_s"] is not None]
        for row in replica:
            row["bottleneck"] = row is max(replica, key=lambda x: x["busy_s"])
            if row["bottleneck"] and row["idle_fraction"] is not None and row["theory_idle_fraction"] is not None:
                row["idle_error"] = row["idle_fraction"] - row["theory_idle_fraction"]
                row["idle_tolerance"] = BUBBLE_TOLERANCE
                row["follows_theory"] = abs(row["idle_error"]) <= BUBBLE_TOLERANCE
    return rows


def _run_label(experiment: str, strategy: str, m) -> str:
    return f"{experiment}: {strategy}, m={m}"


def timeline_rows(summary: dict) -> list[dict]:
    rows = []
    for r in summary.get("ranks") or []:
        m = (r or {}).get("pp_n_microbatches")
        for op, stage, micro, start, end in (r or {}).get("pp_timeline", []):
            rows.append({"experiment": summary["experiment"], "strategy": summary["strategy"], "n_microbatches": m,
                         "rank": r["rank"], "op": op, "stage": stage, "micro_batch": micro, "start_s": start,
                         "end_s": end, "run": _run_label(summary["experiment"], summary["strategy"], m)})
    return rows


def _finished(pipe: pd.DataFrame) -> pd.DataFrame:
    return pipe[pipe["status"] == "ok"].dropna(subset=["rank"])


def theory_rows(pipe: pd.DataFrame) -> pd.DataFrame:
    """The theory curve over m for every stage count p and virtual-stage count v the finished runs used."""
    ok = _finished(pipe)
    sizes = sorted(ok["pp_size"].dropna().astype(int).unique())
    virtual = sorted(ok["virtual_stages"].dropna().astype(int).unique())
    rows = [{"p": p, "v": v, "m": m, "theory_idle_fraction": theory_idle_fraction(p, m, v),
             "theory_bubble_ratio": theory_bubble_ratio(p, m, v), "theory": f"(p-1)/(v·m+p-1), p={p}, v={v}"}
            for p in sizes for v in virtual for m in THEORY_MICROBATCHES]
    return pd.DataFrame(rows, columns=THEORY_COLUMNS)


def memory_rows(pipe: pd.DataFrame) -> pd.DataFrame:
    ok = _finished(pipe)
    if ok.empty:
        return pd.DataFrame(columns=MEMORY_COLUMNS)
    ok = ok.assign(run=[f"{s} m={int(m)}" for s, m in zip(ok["strategy"], ok["n_microbatches"])])
    long = ok.melt(id_vars=["experiment", "strategy", "n_microbatches", "run", "rank"],
                   value_vars=list(MEMORY_MEASURES), var_name="measure", value_name="bytes")
    long["measure"] = long["measure"].map(MEMORY_MEASURES)
    return long[MEMORY_COLUMNS]


SCHEDULE_KEY = ["experiment", "schedule", "pp_size", "virtual_stages", "n_microbatches"]


def hybrid_rows(pipe: pd.DataFrame) -> pd.DataFrame:
    """Runs with several pipeline replicas (dp x pp) beside their experiment's single-pipeline runs of the
    same schedule, p, v and m: the same pipeline, one replica, twice the micro-batch size."""
    ok = _finished(pipe)
    if ok.empty:
        return pd.DataFrame(columns=HYBRID_COLUMNS)
    ok = ok.assign(pipelines=ok.groupby(["experiment", "strategy"])["dp_rank"].transform("nunique"))
    tables = []
    for key, hybrid in ok[ok["pipelines"] > 1].groupby(["experiment", "strategy"], sort=False):
        same = (ok[SCHEDULE_KEY] == hybrid[SCHEDULE_KEY].iloc[0]).all(axis=1)
        peers = ok[same & (ok["pipelines"] == 1)]
        if peers.empty:
            continue
        reference = peers[peers["strategy"] == peers["strategy"].iloc[0]].set_index("stage_ids")
        ratio = hybrid["peak_live_activation_bytes"] / hybrid["stage_ids"].map(reference["peak_live_activation_bytes"])
        tables += [peers.assign(role="single pipeline", peak_live_ratio_to_pipeline=float("nan")),
                   hybrid.assign(role="dp x pp hybrid", peak_live_ratio_to_pipeline=ratio)]
    if not tables:
        return pd.DataFrame(columns=HYBRID_COLUMNS)
    return pd.concat(tables)[HYBRID_COLUMNS].reset_index(drop=True)


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    summaries = [s for s in inputs.summaries if _in_topic(s)]
    pipe = pd.DataFrame([row for s in summaries for row in run_rows(s)], columns=COLUMNS)
    timeline = pd.DataFrame([row for s in summaries for row in timeline_rows(s)], columns=TIMELINE_COLUMNS)
    return {"pipeline": pipe, "pipeline_timeline": timeline, "pipeline_theory": theory_rows(pipe),
            "pipeline_memory": memory_rows(pipe), "pipeline_hybrid": hybrid_rows(pipe)}
