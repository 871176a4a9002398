"""A checkpoint resumed under other plans, in the DAG (config `resharding`, table `resharding`):

    python -m shardlab resharding --experiment-config results/E/experiment.json --model-dir M \
        --tokens T --settings '{"plan": "zero3", "at_step": 6, "resume_under": [...], ...}' --out losses.csv

Plan A trains all of the experiment's steps with its settings and keeps its checkpoint after step
`at_step` - 1 (plan-independent: `runner.checkpoint`); then each plan of `resume_under` loads that
checkpoint, resharded for its own strategy, degrees and world size, and trains the remaining steps.
Every launch is a real run (`runner.launch`, its folder under the output's), so a failed one is a row
with its reason. The output is each run's loss per step with what it resumed from;
`tables.runs.resharding_rows` holds each resumed curve against A's uninterrupted one and the
experiment's single-device reference.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from shardlab import cli
from shardlab.bench.driver import write_rows
from shardlab.config import deep_merge
from shardlab.core.step_stats import read_step_log
from shardlab.runner.launch import checkpoint_dir, launch

COLUMNS = ["experiment", "role", "strategy", "world_size", "written_by", "written_on", "from_step", "status", "reason",
           "step", "loss"]


def _run(exp: dict, strategy: str, options: dict, overrides: dict, args) -> tuple[dict, list[dict]]:
    """One launch of `strategy` with the experiment's settings and `overrides`: (summary, step records)."""
    root = args.out.parent
    settings = deep_merge(copy.deepcopy(exp), overrides)
    settings.update(strategies=[strategy], strategy_options={strategy: options.get(strategy, {})})
    path = root / f"{strategy}.json"
    path.write_text(json.dumps(settings))
    out = root / "runs" / strategy
    return launch(settings, path, strategy, args.model_dir, args.tokens, out), read_step_log(out / "metrics.jsonl")


def loss_rows(role: str, strategy: str, summary: dict, steps: list[dict]) -> list[dict]:
    """One run's rows of the output: its loss per step with what it resumed from (one row, without a step,
    for a run that failed before its first step)."""
    resumed = (summary.get("resumes") or [{}])[-1]
    written = resumed.get("written_by", {})
    run = {"role": role, "strategy": strategy, "world_size": summary.get("world_size"), "written_by": written.get("strategy"),
           "written_on": written.get("world_size"), "from_step": resumed.get("from_step"), "status": summary["status"],
           "reason": summary.get("reason")}
    return [dict(run, step=s["step"], loss=s["loss"]) for s in steps] or [dict(run, step=None, loss=None)]


def run(args) -> None:
    exp = json.loads(args.experiment_config.read_text())
    block = json.loads(args.settings)
    plan, at, options = block["plan"], block["at_step"], block.get("strategy_options", {})
    root = args.out.parent
    for owned in ("runs", "checkpoints"):  # this job's own: a rerun must not resume from the last one's checkpoint
        shutil.rmtree(root / owned, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    print(f"[resharding] {exp['name']}: {plan} trains {exp['training']['steps']} steps, keeping its checkpoint after "
          f"step {at - 1}", flush=True)
    # The experiment's test hooks (fault_injection) and checkpoint schedule are not this job's: A checkpoints
    # once, where the others resume, and they do not checkpoint.
    own = {"fault_injection": "none", "checkpoint_every": 0}
    summary, steps = _run(exp, plan, options, {"training": dict(own, checkpoint_every=at, keep_checkpoints=True)}, args)
    rows = loss_rows("uninterrupted", plan, summary, steps)
    folder = checkpoint_dir(root / "runs" / plan, plan) / f"step-{at - 1:08d}"
    for strategy in block["resume_under"]:
        if summary["status"] != "ok":
            rows += loss_rows("resumed", strategy, {"status": "failed",
                                                    "reason": f"plan {plan}, whose checkpoint it resumes, failed"}, [])
            continue
        print(f"[resharding] {strategy} resumes from {folder}", flush=True)
        resumed, resumed_steps = _run(exp, strategy, options, {"training": dict(own, resume_from=str(folder))}, args)
        rows += loss_rows("resumed", strategy, resumed, resumed_steps)
    write_rows(exp["name"], rows, COLUMNS, args.out)


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="shardlab resharding", description=__doc__)
    parser.add_argument("--experiment-config", type=cli.existing_file, required=True)
    parser.add_argument("--model-dir", type=cli.existing_dir, required=True)
    parser.add_argument("--tokens", type=cli.existing_file, required=True)
    parser.add_argument("--settings", required=True, help="the config's `resharding` block, as JSON")
    parser.add_argument("--out", type=Path, required=True)
    run(parser.parse_args(argv))
    return 0
