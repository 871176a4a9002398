"""Tensor-parallel runs -> `tp_activation_components.csv`: activation bytes per transformer-layer
component, measured on every rank, beside the Korthikanti et al. formula (fp32 values, 1-byte masks)
and the formula adapted to what this model saves (`shardlab.activation_model`).

    python -m shardlab.tp_tables --model-dir resources/models/M --out results/tables/tp_activation_components.csv \
        results/E/runs/*/summary.json

Model sizes come from the model folder's config.json; sequence length and batch from the run's
experiment (`results/<exp>/experiment.json`). The batch is the micro-batch the probe measured on a rank.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from shardlab.activation_model import comparison_rows

COLUMNS = ["experiment", "strategy", "rank", "mode", "tp", "component", "measured_bytes", "paper_formula_bytes",
           "model_formula_bytes", "paper_assumptions_hold", "s", "b", "h", "a", "n_layers"]


def probed_micro_batch(exp: dict, strategy: str, world_size: int) -> int:
    from shardlab.strategies import get_spec

    training = exp["training"]
    options = exp.get("strategy_options", {}).get(strategy, {})
    local = training["global_batch_size"] // get_spec(strategy).data_parallel_size(world_size, options)
    return min(local, training.get("micro_batch_size") or local)


def rows_for(summary_path: Path, model_config: dict) -> list[dict]:
    summary = json.loads(summary_path.read_text())
    if summary.get("status") != "ok":
        return []  # failed runs have no activation measurement; runs.csv already records them
    exp = json.loads((summary_path.parents[2] / "experiment.json").read_text())
    dims = {"s": exp["training"]["seq_len"], "b": probed_micro_batch(exp, summary["strategy"], summary["world_size"]),
            "h": model_config["hidden_size"], "a": model_config["num_attention_heads"],
            "n_layers": model_config["num_hidden_layers"]}
    rows = []
    for rank in summary["ranks"]:
        for row in comparison_rows(summary["strategy"], rank.get("activation_by_module") or {}, dims,
                                   t=summary["world_size"]):
            rows.append({"experiment": summary["experiment"], "rank": rank["rank"], **row, **dims})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="shardlab.tp_tables", description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("summaries", type=Path, nargs="+")
    args = parser.parse_args(argv)
    model_config = json.loads((args.model_dir / "config.json").read_text())
    rows = [row for path in args.summaries for row in rows_for(path, model_config)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=COLUMNS).to_csv(args.out, index=False)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
