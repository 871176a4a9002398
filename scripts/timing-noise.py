"""How much does a run's throughput move from one run to the next on this machine? Runs the
strategies of one experiment of a config several times, alternating (A B C A B C ...) so that slow
drift hits all alike, and prints, per strategy, the spread of tokens/s over the repeats and, per
pair, the spread of the throughput ratio, beside the within-run 95 % bootstrap interval the report
uses (`shardlab.tables.verdicts`). Needs the experiment's prepared model and tokens (run the DAG
first). With `--out`, writes one row per pair and repeat: the measurement the report's verdicts read
(`report.timing_noise`) to widen every throughput interval by the run-to-run noise
(`shardlab.core.step_stats.run_to_run_sigma`). Usage:

    python scripts/timing-noise.py [--config config/config.yaml] [--experiment data_parallel] [--repeats 5]
        [--out reports/timing_noise.csv]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import json
import statistics
import tempfile
from pathlib import Path

import pandas as pd
import yaml

from shardlab.core.step_stats import run_to_run_sigma, throughput_ratio, timed_steps
from shardlab.runner.launch import launch
from shardlab.runner.metrics import cpu_model
from shardlab.study import load_study, prepared_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    parser.add_argument("--experiment", default="data_parallel")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the pair ratios per repeat to this CSV")
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    exp = load_study(config).experiments[args.experiment]
    model_dir, tokens = prepared_inputs(config, exp)
    times: dict[str, list[list[float]]] = {s: [] for s in exp["strategies"]}
    with tempfile.TemporaryDirectory() as tmp:
        settings = Path(tmp) / "experiment.json"
        settings.write_text(json.dumps(exp))
        for repeat, strategy in itertools.product(range(args.repeats), exp["strategies"]):
            out = Path(tmp) / str(repeat) / "runs" / strategy
            summary = launch(exp, settings, strategy, model_dir, tokens, out)
            steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
            times[strategy].append([r["step_time_s"] for r in timed_steps(steps, exp["training"]["warmup_steps"])])
            print(f"repeat {repeat} {strategy}: {summary['status']}, median step {summary.get('step_time_median_s')}")
    rows = pair_ratios(times, args.experiment)
    report(times, rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        rows.to_csv(args.out, index=False)
        print(f"wrote {args.out}")


def pair_ratios(times: dict[str, list[list[float]]], experiment: str) -> pd.DataFrame:
    """One row per strategy pair and repeat: the tokens/s ratio and its within-run interval."""
    rows = []
    for a, b in itertools.combinations(sorted(times), 2):
        for repeat, (ta, tb) in enumerate(zip(times[a], times[b])):
            ratio, low, high = throughput_ratio(ta, tb)
            rows.append({"experiment": experiment, "strategy": a, "versus": b, "repeat": repeat, "ratio": ratio,
                         "ratio_low": low, "ratio_high": high})
    return pd.DataFrame(rows).assign(cpu_model=cpu_model(), cpu_cores=os.cpu_count(),
                                     date=datetime.date.today().isoformat())


def report(times: dict[str, list[list[float]]], rows: pd.DataFrame) -> None:
    print("\nstrategy: median step time per repeat (s), spread over repeats (max/min - 1)")
    medians = {s: [statistics.median(t) for t in runs] for s, runs in times.items()}
    for s, m in medians.items():
        print(f"  {s:<16} {', '.join(f'{x:.4f}' for x in m)}   spread {max(m) / min(m) - 1:.1%}")
    print("\npair: tokens/s ratio per repeat, [within-run 95 % interval]; range over repeats")
    for (a, b), g in rows.groupby(["strategy", "versus"]):
        shown = ", ".join(f"{r.ratio:.2f} [{r.ratio_low:.2f}-{r.ratio_high:.2f}]" for r in g.itertuples())
        print(f"  {a} / {b}: {shown}; range {g.ratio.min():.2f}-{g.ratio.max():.2f}")
    print(f"\nrun-to-run sigma of log(ratio), pooled over pairs: {run_to_run_sigma(rows):.3f}")


if __name__ == "__main__":
    main()
