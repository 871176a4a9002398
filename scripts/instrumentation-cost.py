"""What the study's instrumentation costs per step, per strategy: runs `shardlab.bench.instrumentation`
(instrumented and bare steps in alternating blocks, one torchrun job per strategy) on an experiment's
prepared model and tokens (run the DAG first) and prints the overhead with its 95 % interval.

    python scripts/instrumentation-cost.py [--config config/config.yaml] [--experiment data_parallel]
        [--strategies dp_naive dp_interleaved ddp] [--blocks 8] [--steps-per-block N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

from shardlab.runner.launch import launch_module, resolve_world_size, run_environment
from shardlab.study import load_study, prepared_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    parser.add_argument("--experiment", default="data_parallel")
    parser.add_argument("--strategies", nargs="+", help="default: the experiment's")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps-per-block", type=int, help="default: the experiment's training.log_every")
    parser.add_argument("--out", type=Path, help="keep each strategy's JSON result here")
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    exp = load_study(config).experiments[args.experiment]
    model_dir, tokens = prepared_inputs(config, exp)
    out = args.out or Path(tempfile.mkdtemp(prefix="instrumentation-"))
    settings = out / "experiment.json"
    out.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(exp))
    results = []
    for strategy in args.strategies or exp["strategies"]:
        run_dir = out / strategy
        result = run_dir / "result.json"
        run_args = ["--experiment-config", str(settings), "--strategy", strategy, "--model-dir", str(model_dir),
                    "--tokens", str(tokens), "--blocks", str(args.blocks), "--out", str(result)]
        if args.steps_per_block:
            run_args += ["--steps-per-block", str(args.steps_per_block)]
        failure = launch_module(resolve_world_size(exp, strategy), "shardlab.bench.instrumentation", run_args, run_dir,
                                result, exp["launch"]["timeout_s"], f"experiments.{args.experiment}.launch.timeout_s",
                                env=run_environment(exp, strategy))
        if failure:
            sys.exit(f"instrumentation-cost: {strategy}: {failure}")
        results.append(json.loads(result.read_text()))
    print(f"\ninstrumentation cost per step ({args.blocks} blocks per mode of {results[0]['steps_per_block']} steps):")
    for r in results:
        print(f"  {r['strategy']:<16} {r['overhead']:+6.1%}  (95 % {r['overhead_low']:+.1%} to {r['overhead_high']:+.1%})"
              f"  bare {r['bare_step_s'] * 1e3:6.1f} ms, instrumented {r['instrumented_step_s'] * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
