"""How much does a run's throughput move from one run to the next on this machine? Runs the
strategies of one experiment of a config several times, alternating (A B C A B C ...) so that slow
drift hits all alike, and prints, per strategy, the spread of tokens/s over the repeats and, per
pair, the spread of the throughput ratio, beside the within-run 95 % bootstrap interval the report
uses (`shardlab.tables.verdicts`). Needs the experiment's prepared model and tokens (run the DAG
first). Usage:

    python scripts/timing-noise.py [--config config/config.yaml] [--experiment data_parallel] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path

import yaml

from shardlab.runner.launch import launch
from shardlab.study import load_study
from shardlab.core.timing import throughput_ratio, timed_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    parser.add_argument("--experiment", default="data_parallel")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    exp = load_study(config).experiments[args.experiment]
    model_dir = Path(config.get("resources_dir", "resources")) / "models" / exp["model"]["name"]
    tokens = Path(config.get("resources_dir", "resources")) / "data" / exp["model"]["name"] / exp["data"]["corpus"] / "tokens.npy"
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
    report(times)


def report(times: dict[str, list[list[float]]]) -> None:
    print("\nstrategy: median step time per repeat (s), spread over repeats (max/min - 1)")
    medians = {s: [statistics.median(t) for t in runs] for s, runs in times.items()}
    for s, m in medians.items():
        print(f"  {s:<16} {', '.join(f'{x:.4f}' for x in m)}   spread {max(m) / min(m) - 1:.1%}")
    print("\npair: tokens/s ratio per repeat, [within-run 95 % interval]; range over repeats")
    for a, b in itertools.permutations(times, 2):
        if a > b:
            continue
        rows = [throughput_ratio(ta, tb) for ta, tb in zip(times[a], times[b])]
        shown = ", ".join(f"{r:.2f} [{lo:.2f}-{hi:.2f}]" for r, lo, hi in rows)
        ratios = [r for r, _, _ in rows]
        print(f"  {a} / {b}: {shown}; range {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
