"""The GPU check's record, from a finished `config/gpu-check.yaml` study (scripts/gpu-check.sh):
`shardlab.tables.gpu_check` per run (throughput and MFU, memory per category against the memory model,
loss against single device under the parity rule, the planner's step time before and after calibration
on this GPU) and the environment (device, torch, CUDA, NCCL, DeepSpeed).

    python scripts/gpu-summary.py RESULTS_DIR OUT_DIR

Writes OUT_DIR/<date>-<device>.json and .md (what reports/gpu/ keeps and the report's "Measured on a
GPU" section reads) and copies the tables it read; exits non-zero if a run failed or left the
single-device loss.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from shardlab.tables import TableInputs, read_table
from shardlab.tables.gpu_check import CATEGORIES, TABLES, failures, name, record


def _pct(value) -> str:
    return "–" if value is None else f"{value:+.1%}"


def markdown(rec: dict) -> str:
    env = rec["environment"]
    lines = [f"# GPU check, {rec['date']}: {env['device_name']}", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, DeepSpeed {env['deepspeed']}, "
             f"transformers {env['transformers']}, Python {env['python']}; commit {env['git_commit']}"
             f"{' (with uncommitted changes)' if env['git_dirty'] else ''}; {rec['dtype']}.", "",
             "| strategy | status | ranks | tokens/s | MFU | peak GiB | error of the memory model (param/grad/opt/act) "
             "| loss vs single (tolerance, % of loss) | planner device memory error | planner step time error, "
             "before / after calibration |",
             "|" + "---|" * 10]
    for r in rec["runs"]:
        errors = "/".join(_pct(r.get(f"{c}_error")) for c in CATEGORIES)
        parity = "–"
        if r.get("undecided"):
            parity = f"{r['max_loss_deviation']:.2e}: undecided ({r['undecided']})"
        elif "max_loss_deviation" in r:
            parity = (f"{r['max_loss_deviation']:.2e} ({r['tolerance']:.2e}, {r['tolerance_fraction']:.3%}) "
                      f"{'ok' if r['within_tolerance'] else 'OUTSIDE'}")
        planned = f"{_pct(r.get('planner_before_error'))} / {_pct(r.get('planner_after_error'))}"
        if r.get("calibration_run"):
            planned += " (calibration run)"
        lines.append(f"| {r['strategy']} | {r['status']}{': ' + r['reason'] if r.get('reason') else ''} | "
                     f"{r['world_size']} | {r.get('tokens_per_s', 0):,.0f} | "
                     f"{'–' if r.get('mfu') is None else format(r['mfu'], '.1%')} | "
                     f"{r.get('peak_bytes', 0) / 2**30:.2f} | {errors} | {parity} | "
                     f"{_pct(r.get('planner_device_bytes_error'))} | {planned} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    results, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    tables = {t: read_table(results / "tables" / f"{t}.csv") for t in TABLES}
    experiments = {p.parent.name: json.loads(p.read_text()) for p in results.glob("*/experiment.json")}
    # The prepared models' records (architecture of a hub model), where the study's resources are here.
    model_records = [json.loads(p.read_text()) for p in Path("resources/models").glob("*/shardlab_model.json")]
    models = {m["name"]: m for m in model_records}
    rec = record(TableInputs(experiments=experiments, models=models, tables=tables))
    (out / f"{name(rec)}.json").write_text(json.dumps(rec, indent=2) + "\n")
    (out / f"{name(rec)}.md").write_text(markdown(rec))
    for t in TABLES:
        shutil.copy2(results / "tables" / f"{t}.csv", out / f"{t}.csv")
    print(markdown(rec))
    if failures(rec):
        raise SystemExit(f"gpu check: {', '.join(failures(rec))} failed, left the single-device loss, "
                         "or could not be checked")


if __name__ == "__main__":
    main()
