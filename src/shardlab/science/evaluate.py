"""Domain evaluation of each run's saved models (rule science_evaluate): one CSV row per (strategy,
step, metric), the final model's marked `final`.

    python -m shardlab.science.evaluate --experiment-config exp.json --runs DIR --splits DIR --out CSV [--base-model DIR]

The scoring is in `domains` (one evaluation per domain), `measures` (the metric functions) and
`language_model` (the model as scorer and sampler); this module runs it over an experiment's runs.
A run without a saved model (failed, or training.save_model off) is recorded, not fatal; a model whose
weights are byte-identical to one already scored shares its rows (the evaluation is deterministic).
"""

from __future__ import annotations

import csv
import hashlib
import json
import time
from pathlib import Path

from shardlab.core.model import snapshots
from shardlab.science.domains import DOMAIN_EVALUATORS, row as metric_row
from shardlab.science.formats import FORMATS
from shardlab.science.language_model import LanguageModel

DEFAULT_SETTINGS = {"max_examples": 100, "samples_per_condition": 16, "conditions": [-6.0, -4.0, -2.0, 0.0],
                    "extra_test_sets": {}, "temperature": 1.0}
COLUMNS = ["experiment", "strategy", "run_status", "step", "final", "domain", "test_set", "metric", "value", "low",
           "high", "baseline", "baseline_low", "baseline_high", "difference_low", "difference_high", "better", "beats_baseline",
           "baseline_name", "n", "note"]


def evaluate_runs(exp: dict, runs_dir: Path, splits: Path, seed: int = 0, base_model: Path | None = None) -> list[dict]:
    """One metric row per (strategy, step, metric): the fine-tuned model's (`final`), each snapshot's
    (training.save_model_every) and the base model's at step 0, the points of a domain metric's curve
    against step. A run without a model is recorded, not fatal."""
    fmt = FORMATS[exp["data"]["format"]]
    settings = {**DEFAULT_SETTINGS, **(exp.get("evaluation") or {})}
    # A curve's earlier points (the base model, snapshots) skip the extra test sets: those check the
    # fine-tuned model out of distribution, and would double the cost of every point.
    along_the_curve = {**settings, "extra_test_sets": {}}
    score = ModelScorer(lambda model_dir, final: DOMAIN_EVALUATORS[fmt.domain](
        LanguageModel(model_dir, context=exp["training"]["seq_len"]), fmt, splits,
        settings if final else along_the_curve, seed))
    rows = []
    for strategy in exp["strategies"]:
        run = runs_dir / strategy
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        status = summary.get("status", "missing")
        base = {"experiment": exp["name"], "strategy": strategy, "run_status": status}
        if status != "ok" or not (run / "model").is_dir():
            reason = summary.get("reason") or "no saved model (training.save_model off?)"
            rows.append({**base, "final": True, **metric_row(fmt.domain, "-", "not_evaluated", "-", 0,
                                                           {"value": float("nan"), "baseline": float("nan")}, reason)})
            continue
        points = {**({0: base_model} if base_model else {}), **snapshots(run), exp["training"]["steps"]: run / "model"}
        for step, model_dir in points.items():
            label = "the base model, before fine-tuning" if step == 0 and base_model else f"{strategy} after {step} steps"
            final = model_dir == run / "model"
            rows += [{**r, **base, "step": step, "final": final} for r in score(model_dir, label, final)]
    return rows


class ModelScorer:
    """Scores saved models, each set of weights once: the same bytes score the same (the evaluation is
    deterministic), e.g. the base model of every curve, or DDP and FSDP2 saving identical weights."""

    def __init__(self, evaluate):
        self.evaluate, self.done = evaluate, {}

    def __call__(self, model_dir: Path, label: str, final: bool) -> list[dict]:
        key = (weights_digest(model_dir), final)
        if key in self.done:
            twin, rows = self.done[key]
            return [{**r, "note": f"{r['note']}; weights identical (sha256) to those of {twin}".lstrip("; ")} for r in rows]
        started = time.perf_counter()
        rows = self.evaluate(model_dir, final)
        print(f"[evaluate] {label}: {len(rows)} metrics in {time.perf_counter() - started:.1f} s", flush=True)
        self.done[key] = (label, rows)
        return rows


def weights_digest(model_dir: Path) -> str:
    """sha256 of a saved model's weight files: equal digests mean the evaluation would repeat itself exactly."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def write_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab.science.evaluate --experiment-config exp.json --runs DIR --splits DIR --out CSV`."""
    import argparse

    parser = argparse.ArgumentParser(prog="shardlab.science.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment-config", type=Path, required=True, help="resolved experiment JSON")
    parser.add_argument("--runs", type=Path, required=True, help="results/<experiment>/runs")
    parser.add_argument("--splits", type=Path, required=True, help="the experiment's saved splits")
    parser.add_argument("--base-model", type=Path, default=None,
                        help="the model the runs fine-tuned: scored as step 0 of every curve")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # tiny forwards: extra threads only spin against each other (24 s vs 1.4 s measured)
    exp = json.loads(args.experiment_config.read_text())
    rows = evaluate_runs(exp, args.runs, args.splits, seed=exp["training"]["seed"], base_model=args.base_model)
    write_rows(rows, args.out)
    for r in (r for r in rows if r["final"]):
        print(f"{r['strategy']:>16s} {r['test_set']:>10s} {r['metric']:>28s} {r['value']:.4g} "
              f"[{r.get('low', float('nan')):.4g}, {r.get('high', float('nan')):.4g}] (baseline "
              f"{r['baseline']:.4g}: {r['baseline_name']}; beats it: {r.get('beats_baseline')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
