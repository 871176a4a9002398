"""The GPU check's result folder, from a finished `config/gpu-check.yaml` study (scripts/gpu-check.sh):
per run, tokens/s and MFU against the device's peak for the run's dtype (`costs.hardware.device_peak_flops`: TF32
for fp32, bf16 otherwise), the memory allocator's peak and the measured model-state bytes beside the memory
model's prediction per category with its signed error (`tables.prediction_error`), and the
loss against single device in bf16 with the parity rule's tolerance (`tables.parity`: from the noise floor
the study's reordered and DeepSpeed-recipe runs measured).

    python scripts/gpu-summary.py RESULTS_DIR OUT_DIR

Writes OUT_DIR/summary.json, OUT_DIR/summary.md and copies the tables it read.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd

from shardlab.costs.hardware import device_peak_flops, training_flops_per_token
from shardlab.tables.prediction_error import relative_error

CATEGORIES = ("param", "grad", "optimizer")
TABLES = ("runs", "ranks", "parity", "environments")


def run_rows(tables: dict[str, pd.DataFrame], experiments: dict[str, dict]) -> list[dict]:
    runs, ranks, parity = tables["runs"], tables["ranks"], tables["parity"]
    rows = []
    for run in runs.to_dict("records"):
        exp = experiments[run["experiment"]]
        model, training = exp["model"], exp["training"]
        row = {"strategy": run["strategy"], "status": run["status"], "reason": run.get("reason"),
               "world_size": run["world_size"], "device": run.get("environment.device_name")}
        if run["status"] == "ok":
            flops = training_flops_per_token(int(run["model.parameters"]), model["num_layers"], model["hidden_size"],
                                             training["seq_len"])
            peak = device_peak_flops(str(row["device"]), training["dtype"])
            row.update(tokens_per_s=run["tokens_per_s"], step_time_median_s=run["step_time_median_s"],
                       mfu=run["tokens_per_s"] * flops / (peak * run["world_size"]) if peak else None)
            mine = ranks[(ranks["experiment"] == run["experiment"]) & (ranks["strategy"] == run["strategy"])]
            fullest = mine.loc[mine["param_bytes"].idxmax()] if len(mine) else None
            if fullest is not None:
                row.update(peak_bytes=fullest["peak_bytes"], peak_kind=fullest["peak_kind"])
                for c in CATEGORIES:
                    measured, predicted = fullest[f"{c}_bytes"], fullest.get(f"predicted_{c}_bytes")
                    row[f"{c}_bytes"], row[f"predicted_{c}_bytes"] = measured, predicted
                    known = pd.notna(predicted) and measured
                    row[f"{c}_error"] = relative_error(measured, predicted) if known else None
            match = parity[(parity["experiment"] == run["experiment"]) & (parity["strategy"] == run["strategy"])]
            if len(match):
                verdict = match["within_tolerance"].item()
                row.update(max_loss_deviation=match["max_loss_deviation"].item(), tolerance=match["tolerance"].item(),
                           tolerance_fraction=match["tolerance_fraction"].item(),
                           noise_floor=match["noise_floor"].item(),
                           within_tolerance=None if pd.isna(verdict) else bool(verdict),
                           undecided=match["undecided"].item() if pd.isna(verdict) else None)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| strategy | status | ranks | tokens/s | MFU | peak GiB | model-state error (param/grad/opt) | "
             "loss vs single (tolerance, % of loss) |", "|" + "---|" * 8]
    for r in rows:
        errors = "/".join("–" if r.get(f"{c}_error") is None else f"{r[f'{c}_error']:+.1%}" for c in CATEGORIES)
        parity = "–"
        if r.get("undecided"):
            parity = f"{r['max_loss_deviation']:.2e}: undecided ({r['undecided']})"
        elif "max_loss_deviation" in r:
            parity = (f"{r['max_loss_deviation']:.2e} ({r['tolerance']:.2e}, {r['tolerance_fraction']:.3%}) "
                      f"{'ok' if r['within_tolerance'] else 'OUTSIDE'}")
        lines.append(f"| {r['strategy']} | {r['status']} | {r['world_size']} | {r.get('tokens_per_s', 0):,.0f} | "
                     f"{'–' if r.get('mfu') is None else format(r['mfu'], '.1%')} | "
                     f"{r.get('peak_bytes', 0) / 2**30:.2f} | {errors} | {parity} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    results, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    tables = {name: pd.read_csv(results / "tables" / f"{name}.csv") for name in TABLES}
    experiments = {p.parent.name: json.loads(p.read_text()) for p in results.glob("*/experiment.json")}
    rows = run_rows(tables, experiments)
    (out / "summary.json").write_text(json.dumps(rows, indent=2, default=str))
    (out / "summary.md").write_text(markdown(rows))
    for name in TABLES:
        shutil.copy2(results / "tables" / f"{name}.csv", out / f"{name}.csv")
    print(markdown(rows))
    failed = [r["strategy"] for r in rows if r["status"] != "ok" or r.get("within_tolerance") is False or r.get("undecided")]
    if failed:
        raise SystemExit(f"gpu check: {', '.join(failed)} failed, left the single-device loss, or could not be checked")


if __name__ == "__main__":
    main()
