"""Tensor-parallel runs -> `tp_activation_components.csv`: activation bytes per transformer-layer
component, measured on every rank, beside the Korthikanti et al. formula (fp32 values, 1-byte masks)
and the formula adapted to what this model saves (`shardlab.costs.activations`).

    python -m shardlab.tables.tensor_parallel --models-dir resources/models --out results/tables/tp_activation_components.csv \
        results/E/runs/*/summary.json

Everything comes from each run's experiment (`results/<exp>/experiment.json`): sequence length, the
micro-batch the probe measured on a rank, and the model's sizes (for hub models, from
`<models-dir>/<name>/config.json`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from shardlab.costs.activations import comparison_rows

COLUMNS = ["experiment", "strategy", "rank", "mode", "tp", "component", "measured_bytes", "paper_formula_bytes",
           "model_formula_bytes", "paper_assumptions_hold", "s", "b", "h", "a", "n_layers"]


def probed_micro_batch(exp: dict, strategy: str, world_size: int) -> int:
    from shardlab.strategies import get_spec

    training = exp["training"]
    options = exp.get("strategy_options", {}).get(strategy, {})
    local = training["global_batch_size"] // get_spec(strategy).data_parallel_size(world_size, options)
    return min(local, training.get("micro_batch_size") or local)


def model_sizes(model: dict, models_dir: Path | None) -> dict:
    if model["source"] == "local":
        return {"h": model["hidden_size"], "a": model["num_heads"], "n_layers": model["num_layers"]}
    config = json.loads((models_dir / model["name"] / "config.json").read_text())
    return {"h": config["hidden_size"], "a": config["num_attention_heads"], "n_layers": config["num_hidden_layers"]}


def rows_for(summary_path: Path, models_dir: Path | None) -> list[dict]:
    summary = json.loads(summary_path.read_text())
    if summary.get("status") != "ok":
        return []  # failed runs have no activation measurement; runs.csv already records them
    exp = json.loads((summary_path.parents[2] / "experiment.json").read_text())
    dims = {"s": exp["training"]["seq_len"], "b": probed_micro_batch(exp, summary["strategy"], summary["world_size"]),
            **model_sizes(exp["model"], models_dir)}
    rows = []
    for rank in summary["ranks"]:
        for row in comparison_rows(summary["strategy"], rank.get("activation_by_module") or {}, dims,
                                   t=summary["world_size"]):
            rows.append({"experiment": summary["experiment"], "rank": rank["rank"], **row, **dims})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shardlab.tables.tensor_parallel", description=__doc__)
    parser.add_argument("--models-dir", type=Path, help="folder of model folders (needed for hub models)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("summaries", type=Path, nargs="+")
    args = parser.parse_args(argv)
    rows = [row for path in args.summaries for row in rows_for(path, args.models_dir)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=COLUMNS).to_csv(args.out, index=False)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
