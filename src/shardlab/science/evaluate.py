"""Domain evaluation of each run's saved models (rule science_evaluate): one CSV row per (strategy,
step, metric), the final model's marked `final`, each against the domain's trivial baseline; and,
for every metric that is a mean over test rows, one more row per final model against the base model
it was fine-tuned from (`compared_with` "base model": the paired difference over the same rows, what
fine-tuning taught).

    python -m shardlab evaluate-science --experiment-config exp.json --runs DIR --splits DIR --out CSV [--base-model DIR] [--workers N]

The scoring is in `domains` (one evaluation per domain), `measures` (the metric functions) and
`language_model` (the model as scorer and sampler); this module runs it over an experiment's runs.
A run without a saved model (failed, or training.save_model off) is recorded, not fatal; a model whose
weights are byte-identical to one already scored shares its rows (the evaluation is deterministic).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import time
from pathlib import Path

from shardlab import cli
from shardlab.core.model import snapshots
from shardlab.core.pool import ordered_map
from shardlab.science.domains import DOMAIN_EVALUATORS, row as metric_row
from shardlab.science.formats import FORMATS
from shardlab.science.language_model import LanguageModel
from shardlab.core.bootstrap import bootstrap_interval

DEFAULT_SETTINGS = {"max_examples": 100, "samples_per_condition": 16, "conditions": [-6.0, -4.0, -2.0, 0.0],
                    "extra_test_sets": {}, "temperature": 1.0}
COLUMNS = ["experiment", "strategy", "run_status", "step", "final", "domain", "test_set", "metric", "value", "low",
           "high", "baseline", "baseline_low", "baseline_high", "difference_low", "difference_high", "better", "beats_baseline",
           "baseline_name", "n", "note", "compared_with", "weights"]
TRIVIAL_BASELINE, BASE_MODEL = "trivial baseline", "base model"  # compared_with: the domain's baseline, or the
# model before fine-tuning


def evaluate_runs(exp: dict, runs_dir: Path, splits: Path, seed: int = 0, base_model: Path | None = None,
                  workers: int = 1) -> list[dict]:
    """One metric row per (strategy, step, metric): the fine-tuned model's (`final`), each snapshot's
    (training.save_model_every) and the base model's at step 0, the points of a domain metric's curve
    against step. A run without a model is recorded, not fatal. Distinct models are scored by `workers`
    processes at once; the rows do not depend on how many (each scoring seeds its own draws)."""
    rows, points = [], []
    for strategy in exp["strategies"]:
        run = runs_dir / strategy
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        status = summary.get("status", "missing")
        base = {"experiment": exp["name"], "strategy": strategy, "run_status": status}
        if status != "ok" or not (run / "model").is_dir():
            reason = summary.get("reason") or "no saved model (training.save_model off?)"
            domain = FORMATS[exp["data"]["format"]].domain
            rows.append({**base, "final": True, "compared_with": TRIVIAL_BASELINE,
                         **metric_row(domain, "-", "not_evaluated", "-", 0,
                                      {"value": float("nan"), "baseline": float("nan")}, reason)})
            continue
        steps = {**({0: base_model} if base_model else {}), **snapshots(run), exp["training"]["steps"]: run / "model"}
        for step, model_dir in steps.items():
            label = "the base model, before fine-tuning" if step == 0 and base_model else f"{strategy} after {step} steps"
            final = model_dir == run / "model"
            points.append(ModelPoint(model_dir, label, final, extra_test_sets=final or step == 0,
                                     row={**base, "step": step, "weights": weights_digest(model_dir)[:16]}))
    scored = score_distinct(points, functools.partial(score_model, exp, splits, seed), workers)
    for point in points:
        rows += [{**r, **point.row, "final": point.final, "compared_with": TRIVIAL_BASELINE} for r in scored[point]]
    return rows + fine_tuning_gains(points, scored, seed)


def fine_tuning_gains(points: list[ModelPoint], scored: dict, seed: int) -> list[dict]:
    """Each final model's metrics against its run's step 0 (the base model) on the same test rows: the
    paired bootstrap interval of their difference, for the metrics that are means over test rows."""
    base = {p.row["strategy"]: p for p in points if p.row["step"] == 0}
    out = []
    for point in (p for p in points if p.final and p.row["strategy"] in base):
        before = {(r["test_set"], r["metric"]): r for r in scored[base[point.row["strategy"]]] if "per_example" in r}
        for after in (r for r in scored[point] if "per_example" in r):
            earlier = before.get((after["test_set"], after["metric"]))
            if earlier is None or len(earlier["per_example"]) != len(after["per_example"]):
                continue  # not scored on the base model's rows
            a, b = after["per_example"], earlier["per_example"]
            low, high = bootstrap_interval(lambda i: float(a[i].mean() - b[i].mean()), (len(a),), seed=seed + 3)
            improved = None if after["better"] is None else bool(low > 0 if after["better"] == "higher" else high < 0)
            out.append({**after, **point.row, "final": True, "compared_with": BASE_MODEL,
                        "baseline": earlier["value"], "baseline_low": earlier["low"], "baseline_high": earlier["high"],
                        "difference_low": low, "difference_high": high, "beats_baseline": improved,
                        "baseline_name": "the base model, before fine-tuning",
                        "note": "paired over the same test rows"})
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class ModelPoint:
    """A saved model to score: `final` (the fine-tuned model) or a point along the curve; the final and the
    base model are also scored on the extra test sets (what fine-tuning taught out of distribution, on the
    same rows); `row` holds the columns that say whose model it is."""

    model_dir: Path
    label: str
    final: bool
    extra_test_sets: bool
    row: dict


def score_model(exp: dict, splits: Path, seed: int, model_dir: Path, extra_test_sets: bool) -> list[dict]:
    """The domain's metric rows for one saved model. Snapshots skip the extra test sets: they would double
    the cost of every point of a curve."""
    fmt = FORMATS[exp["data"]["format"]]
    settings = {**DEFAULT_SETTINGS, **(exp.get("evaluation") or {})}
    if not extra_test_sets:
        settings["extra_test_sets"] = {}
    lm = LanguageModel(model_dir, context=exp["training"]["seq_len"])
    return DOMAIN_EVALUATORS[fmt.domain](lm, fmt, splits, settings, seed)


def score_distinct(points: list[ModelPoint], score, workers: int = 1) -> dict[ModelPoint, list[dict]]:
    """Each point's rows, each set of weights scored once: the same bytes score the same (the evaluation is
    deterministic), e.g. the base model of every curve, or DDP and FSDP2 saving identical weights; a twin's
    rows say whose they share. Those scored on the extra test sets first: they cost the most."""
    key = {point: (point.row["weights"], point.extra_test_sets) for point in points}
    firsts: dict[tuple[str, bool], ModelPoint] = {}
    for point in sorted(points, key=lambda p: not p.extra_test_sets):
        firsts.setdefault(key[point], point)
    done = dict(zip(firsts.values(), _map(_timed, [(score, p) for p in firsts.values()], workers)))
    scored = {}
    for point in points:
        first = firsts[key[point]]
        scored[point] = done[first] if first is point else [
            {**r, "note": f"{r['note']}; weights identical (sha256) to those of {first.label}".lstrip("; ")}
            for r in done[first]]
    return scored


def _timed(job) -> list[dict]:
    score, point = job
    started = time.perf_counter()
    rows = score(point.model_dir, point.extra_test_sets)
    print(f"[evaluate] {point.label}: {len(rows)} metrics in {time.perf_counter() - started:.1f} s", flush=True)
    return rows


def _map(fn, jobs: list, workers: int) -> list:
    """`ordered_map` with transformers imported once before the fork (about 2 s a process saved)."""
    if workers > 1 and len(jobs) > 1:
        import transformers.models.gpt_neox.modeling_gpt_neox  # noqa: F401  (the study's models; others import in the worker)
    return ordered_map(fn, jobs, workers, initializer=_one_thread)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # tiny forwards: extra threads only spin against each other (24 s vs 1.4 s measured)


def weights_digest(model_dir: Path) -> str:
    """sha256 of a saved model's weight files: equal digests mean the evaluation would repeat itself exactly."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def write_rows(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, restval="", extrasaction="ignore")  # not per_example
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab evaluate-science --experiment-config exp.json --runs DIR --splits DIR --out CSV`."""
    parser = cli.Parser(prog="shardlab evaluate-science", description=__doc__.splitlines()[0])
    parser.add_argument("--experiment-config", type=cli.existing_file, required=True, help="resolved experiment JSON")
    parser.add_argument("--runs", type=cli.existing_dir, required=True, help="results/<experiment>/runs")
    parser.add_argument("--splits", type=cli.existing_dir, required=True, help="the experiment's saved splits")
    parser.add_argument("--base-model", type=Path, default=None,
                        help="the model the runs fine-tuned: scored as step 0 of every curve")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=cli.count, default=1, help="models scored at once, one process and thread each")
    args = parser.parse_args(argv)
    _one_thread()
    exp = json.loads(args.experiment_config.read_text())
    rows = evaluate_runs(exp, args.runs, args.splits, seed=exp["training"]["seed"], base_model=args.base_model,
                         workers=args.workers)
    write_rows(rows, args.out)
    for r in (r for r in rows if r["final"] and r["compared_with"] != BASE_MODEL):
        print(f"{r['strategy']:>16s} {r['test_set']:>10s} {r['metric']:>28s} {r['value']:.4g} "
              f"[{r.get('low', float('nan')):.4g}, {r.get('high', float('nan')):.4g}] (baseline "
              f"{r['baseline']:.4g}: {r['baseline_name']}; beats it: {r.get('beats_baseline')})")
    return 0
