"""Tables for the report's ZeRO section, from one experiment's run summaries.

- `zero_memory.csv`: per run and rank, measured vs predicted parameter/gradient/optimizer bytes
  (the memory model's error in %), with the run's throughput and outcome.
- `zero_tree_check.csv`: per run, does the decision tree's verdict (fits / does not fit the device)
  agree with what happened (ok / oom)?
- `zero_plan.csv`: the decision tree's choice over a grid of model sizes and device counts (80 GB
  devices, bf16 + AdamW), the study's decision-tree figure as data.

    python -m shardlab.tables.zero --experiment-configs results/zero/experiment.json --out-dir results/tables
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from shardlab.costs.memory import RUNGS, predict
from shardlab.costs.zero_tree import DEFAULT_HEADROOM, choose, feasibility

STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")
PLAN_PARAMS = [1.25e8, 1e9, 2.8e9, 6.9e9, 1.2e10, 3e10, 7e10, 1.75e11]
PLAN_GPUS = [1, 2, 4, 8, 16, 64]


def load_summaries(results_dir: Path, experiment: str, strategies: list[str]) -> dict[str, dict]:
    out = {}
    for strategy in strategies:
        path = results_dir / experiment / "runs" / strategy / "summary.json"
        if path.exists():
            out[strategy] = json.loads(path.read_text())
    return out


def memory_rows(summaries: dict, training: dict) -> list[dict]:
    rows = []
    for strategy, s in summaries.items():
        if strategy not in RUNGS:
            continue
        base = {"experiment": s["experiment"], "strategy": strategy, "status": s["status"],
                "tokens_per_s": s.get("tokens_per_s"), "world_size": s.get("world_size")}
        if s["status"] != "ok":
            rows.append(dict(base, rank=None))
            continue
        want = predict(strategy, s["model"]["parameters"], s["world_size"], training["dtype"], training["optimizer"])
        for rank in s["ranks"]:
            row = dict(base, rank=rank["rank"])
            for key in STATES:
                predicted = getattr(want, key)
                row[f"measured_{key}"] = rank[key]
                row[f"predicted_{key}"] = predicted
                row[f"error_{key}_pct"] = 100 * (rank[key] - predicted) / predicted if predicted else 0.0
            measured = sum(rank[k] for k in STATES)
            row.update(measured_model_state_bytes=measured, predicted_model_state_bytes=want.total_bytes,
                       error_model_state_pct=100 * (measured - want.total_bytes) / want.total_bytes,
                       activation_bytes=rank.get("activation_bytes"))
            rows.append(row)
    return rows


def device_memory(summaries: dict, fallback: float | None) -> float | None:
    """Memory per device from any successful run's ranks (the runs share one machine)."""
    seen = [r["device_memory_bytes"] for s in summaries.values() for r in s.get("ranks", [])
            if r.get("device_memory_bytes")]
    return max(seen) if seen else fallback


def tree_check_rows(summaries: dict, training: dict, device_mem: float | None,
                    headroom: float = DEFAULT_HEADROOM) -> list[dict]:
    rows = []
    for strategy, s in summaries.items():
        if strategy not in RUNGS or s["status"] not in ("ok", "oom") or device_mem is None:
            continue  # a run that failed for another reason says nothing about memory
        n_params = s["model"]["parameters"] if s.get("model") else None
        if n_params is None:
            continue
        states = predict(strategy, n_params, s["world_size"], training["dtype"], training["optimizer"])
        fits = states.device_peak_bytes <= device_mem * (1 - headroom)
        rows.append({"experiment": s["experiment"], "strategy": strategy, "world_size": s["world_size"],
                     "parameters": n_params, "device_memory_bytes": device_mem, "headroom": headroom,
                     "predicted_device_peak_bytes": states.device_peak_bytes, "tree_says_fits": fits,
                     "outcome": s["status"], "consistent": fits == (s["status"] == "ok")})
    return rows


def plan_rows(gpu_mem: float = 80e9, dtype: str = "bf16", optimizer: str = "adamw") -> list[dict]:
    rows = []
    for n_params in PLAN_PARAMS:
        for gpus in PLAN_GPUS:
            choice = choose(feasibility(n_params, gpus, gpu_mem, dtype, optimizer))
            rows.append({"parameters": n_params, "gpus": gpus, "gpu_memory_bytes": gpu_mem,
                         "headroom": DEFAULT_HEADROOM, "choice": choice or "none (needs TP/PP)"})
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row)) or ["empty"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    from shardlab.costs.zero_tree import parse_bytes

    parser = argparse.ArgumentParser(prog="shardlab zero-tables", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment-configs", type=Path, nargs="+", required=True,
                        help="results/<exp>/experiment.json of each experiment with ZeRO/FSDP2 runs")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--device-mem", default=None, help="memory per device if no run recorded it (e.g. 24GiB)")
    args = parser.parse_args(argv)
    memory, check = [], []
    for path in args.experiment_configs:
        exp = json.loads(path.read_text())
        summaries = load_summaries(path.parent.parent, exp["name"], exp["strategies"])
        mem = device_memory(summaries, parse_bytes(args.device_mem) if args.device_mem else None)
        memory += memory_rows(summaries, exp["training"])
        check += tree_check_rows(summaries, exp["training"], mem)
    write_csv(args.out_dir / "zero_memory.csv", memory)
    write_csv(args.out_dir / "zero_tree_check.csv", check)
    write_csv(args.out_dir / "zero_plan.csv", plan_rows())
    print(f"[zero-tables] {len(args.experiment_configs)} experiment(s) -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
