"""Communication share of each run's step time, and a what-if model of step time per network link.

This is a MODEL, never a measurement, built on stated assumptions:
- compute time = measured median step time - communication time, where communication time is the
  run's own timed blocking waits when it records them (hand-written DP), else the alpha-beta
  prediction of its plan (`volume.comm_plan`) with the benchmark's fitted parameters;
- on another link, communication = sum over the plan's calls of count x (latency + bus bytes / bandwidth),
  with the link's nominal per-direction bandwidth and an assumed per-call latency (`LINKS`);
  the ring algorithms of nccl-tests' bus-bandwidth convention; no contention, no congestion;
- step time is bounded by two overlap assumptions: none (compute + communication) and perfect
  (max(compute, communication)); real overlap lies between;
- compute does not change with the link (same devices), and what was not counted in the plan
  (see `volume`) is ignored.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from shardlab.costs.alpha_beta import AlphaBeta, models_from_table
from shardlab.costs.comm_volume import Call, ModelShape, StepShape, bytes_per_rank, comm_plan, experiment_plan


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_GBps: float  # nominal, per direction, 1e9 bytes/s
    latency_s: float  # assumed fixed cost of one collective call (order of magnitude)


LINKS = [
    Link("10 Gb/s Ethernet", 1.25, 30e-6),
    Link("100 Gb/s InfiniBand", 12.5, 5e-6),
    Link("400 Gb/s InfiniBand", 50.0, 5e-6),
    Link("NVLink 4 (H100, 450 GB/s)", 450.0, 3e-6),
]
MEASURED_LINK = "this machine (fitted alpha-beta)"


def plan_seconds(plan: list[Call], models: dict[str, AlphaBeta]) -> float | None:
    """Predicted communication seconds of a plan; None if a collective has no fitted model."""
    if any(call.collective not in models for call in plan if call.group_size > 1):
        return None
    return sum(call.count * models[call.collective].seconds_for(call.collective, call.size_bytes, call.group_size)
               for call in plan)


def link_models(link: Link) -> dict[str, AlphaBeta]:
    from shardlab.costs.collectives import COLLECTIVES

    return {c: AlphaBeta(link.latency_s, link.bandwidth_GBps * 1e9) for c in COLLECTIVES}


def _value(row, column):
    value = row.get(column) if hasattr(row, "get") else None
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def volume_table(runs: pd.DataFrame, experiments: dict[str, dict], resources_dir: Path | str) -> pd.DataFrame:
    """One row per (run, call of its plan); runs without a known plan get one row with plan = 'unknown'."""
    rows = []
    for run in runs.to_dict("records"):
        exp = experiments.get(run["experiment"])
        world = _value(run, "world_size") or (exp or {}).get("launch", {}).get("world_size")
        plan = experiment_plan(exp, run["strategy"], int(world), resources_dir) if exp and world not in (None, "auto") else None
        key = {"experiment": run["experiment"], "strategy": run["strategy"], "world_size": world}
        if plan is None:
            rows.append(dict(key, plan="unknown"))
        for call in plan or []:
            rows.append(dict(key, plan="known", collective=call.collective, purpose=call.purpose, size_bytes=call.size_bytes,
                             count=call.count, group_size=call.group_size, bus_bytes=call.bus_bytes))
    return pd.DataFrame(rows, columns=["experiment", "strategy", "world_size", "plan", "collective", "purpose",
                                       "size_bytes", "count", "group_size", "bus_bytes"])


def share_table(runs: pd.DataFrame, experiments: dict[str, dict], fits: pd.DataFrame,
                resources_dir: Path | str) -> pd.DataFrame:
    """Per successful run: communication time (measured or predicted, labelled) and its share of step time."""
    models = models_from_table(fits)
    rows = []
    for run in runs.to_dict("records"):
        if run.get("status") != "ok" or run["experiment"] not in experiments:
            continue
        exp, step = experiments[run["experiment"]], float(run["step_time_median_s"])
        plan = experiment_plan(exp, run["strategy"], int(run["world_size"]), resources_dir)
        predicted = plan_seconds(plan, models) if plan is not None else None
        measured = _value(run, "comm_time_median_s")
        if plan == []:
            comm, source = 0.0, "none (one process)"
        elif measured is not None:
            comm, source = float(measured), "measured (timed blocking waits)"
        elif predicted is not None:
            comm, source = predicted, "predicted (alpha-beta)"
        else:
            comm, source = None, "unknown"
        rows.append({"experiment": run["experiment"], "strategy": run["strategy"], "world_size": int(run["world_size"]),
                     "step_time_s": step, "bytes_per_rank": bytes_per_rank(plan), "comm_measured_s": measured,
                     "comm_predicted_s": predicted, "comm_s": comm, "comm_source": source,
                     "comm_share": None if comm is None else min(comm / step, 1.0),
                     "compute_s": None if comm is None else max(step - comm, 0.0)})
    return pd.DataFrame(rows, columns=["experiment", "strategy", "world_size", "step_time_s", "bytes_per_rank",
                                       "comm_measured_s", "comm_predicted_s", "comm_s", "comm_source", "comm_share",
                                       "compute_s"])


def whatif_table(share: pd.DataFrame, experiments: dict[str, dict], fits: pd.DataFrame,
                 resources_dir: Path | str, links: list[Link] = LINKS) -> pd.DataFrame:
    """Predicted step time per (run, link, overlap assumption), from measured compute + modelled communication."""
    scenarios = [(MEASURED_LINK, None, models_from_table(fits))] + [(l.name, l.bandwidth_GBps, link_models(l)) for l in links]
    rows = []
    for run in share.to_dict("records"):
        if run["compute_s"] is None or (isinstance(run["compute_s"], float) and math.isnan(run["compute_s"])):
            continue
        plan = experiment_plan(experiments[run["experiment"]], run["strategy"], int(run["world_size"]), resources_dir)
        if plan is None:
            continue
        for name, bandwidth, models in scenarios:
            comm = plan_seconds(plan, models)
            if comm is None:
                continue
            compute = float(run["compute_s"])
            for overlap, step in (("none", compute + comm), ("perfect", max(compute, comm))):
                rows.append({"experiment": run["experiment"], "strategy": run["strategy"], "link": name,
                             "bandwidth_GBps": bandwidth, "overlap": overlap, "compute_s": compute, "comm_s": comm,
                             "predicted_step_s": step, "measured_step_s": run["step_time_s"]})
    return pd.DataFrame(rows, columns=["experiment", "strategy", "link", "bandwidth_GBps", "overlap", "compute_s",
                                       "comm_s", "predicted_step_s", "measured_step_s"])


# The study's scale: the Pythia-6.9B shape it fine-tunes, on 8 ranks, bf16 activations, 32 sequences of 2048
# tokens per step in micro-batches of 1. Communication only: no compute time exists at this scale here.
PROJECTION_LABEL = "Pythia-6.9B shape, 8 ranks, 32 x 2048 tokens/step, bf16 activations, fp32 gradients"
PROJECTION_MODEL = ModelShape(vocab_size=50432, hidden_size=4096, num_layers=32, num_heads=32, intermediate_size=16384)
PROJECTION_STEP = StepShape(global_batch=32, seq_len=2048, micro_batch=1, activation_bytes=2)
PROJECTION_STRATEGIES = ("ddp", "zero2", "zero3", "tp", "tp_sp", "pp_1f1b", "cp_ring", "ep_moe", "hybrid")


def projection_table(world: int = 8, links: list[Link] = LINKS) -> pd.DataFrame:
    """Communication seconds per step of each strategy at the study's scale, per link (a model)."""
    rows = []
    for strategy in PROJECTION_STRATEGIES:
        plan = comm_plan(strategy, PROJECTION_MODEL, PROJECTION_STEP, world, {"dp": world // 2, "tp": 2} if strategy == "hybrid" else {})
        for link in links:
            rows.append({"scenario": PROJECTION_LABEL, "strategy": strategy, "world_size": world, "link": link.name,
                         "bandwidth_GBps": link.bandwidth_GBps, "bytes_per_rank": bytes_per_rank(plan),
                         "calls_per_step": sum(c.count for c in plan), "comm_s": plan_seconds(plan, link_models(link))})
    return pd.DataFrame(rows)


def load_experiments(paths: list[Path]) -> dict[str, dict]:
    experiments = {}
    for path in paths:
        exp = json.loads(Path(path).read_text())
        experiments[exp["name"]] = exp
    return experiments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlab.tables.communication", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, required=True, help="results/tables/runs.csv")
    parser.add_argument("--fit", type=Path, required=True, help="results/tables/comm_fit.csv")
    parser.add_argument("--experiments", type=Path, nargs="+", required=True, help="results/<exp>/experiment.json")
    parser.add_argument("--resources", type=Path, default=Path("resources"))
    parser.add_argument("--out-dir", type=Path, required=True,
                        help="writes comm_volume/comm_share/comm_whatif/comm_projection.csv")
    args = parser.parse_args(argv)
    runs, fits = pd.read_csv(args.runs), pd.read_csv(args.fit)
    experiments = load_experiments(args.experiments)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    volume_table(runs, experiments, args.resources).to_csv(args.out_dir / "comm_volume.csv", index=False)
    share = share_table(runs, experiments, fits, args.resources)
    share.to_csv(args.out_dir / "comm_share.csv", index=False)
    whatif = whatif_table(share, experiments, fits, args.resources)
    whatif.to_csv(args.out_dir / "comm_whatif.csv", index=False)
    projection_table().to_csv(args.out_dir / "comm_projection.csv", index=False)
    print(f"[comm] {len(share)} runs with communication shares, {len(whatif)} what-if rows -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
