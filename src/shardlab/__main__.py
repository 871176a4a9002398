"""`python -m shardlab <command> ...` (or `shardlab <command>`): the project's one command line; the
workflow's rules and the scripts call these commands, never a module's own entry point (the only
`python -m shardlab.<module>` runs are the per-rank programs torchrun starts).

Each command lives in the module that owns its logic; this file only dispatches, and turns a bad
config or a missing prepared file into one line and exit 2 (a bad flag does so in `shardlab.cli`).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "check-config": ("shardlab.study:check_main", "validate a config file without running anything"),
    "prepare-model": ("shardlab.prepare:model_main", "build or download an experiment's model"),
    "prepare-data": ("shardlab.prepare:data_main", "tokenize an experiment's corpus"),
    "fetch-dataset": ("shardlab.science.sources:main", "download a Hugging Face dataset's split as a corpus CSV"),
    "save-splits": ("shardlab.core.splits:main", "save an experiment's train/validation/test splits"),
    "pretrain": ("shardlab.pretrain:main", "pretrain the science base model on the science experiments' training parts"),
    "launch": ("shardlab.runner.launch:main", "run one strategy under torchrun and record the outcome"),
    "share-run": ("shardlab.runner.launch:share_main",
                  "record an experiment's reference run as another's identical one"),
    "bench-comm": ("shardlab.bench.comm:main", "time each collective over message sizes and fit alpha-beta"),
    "bench-inference": ("shardlab.bench.inference:main", "time tensor-parallel generation"),
    "bench-paired": ("shardlab.bench.paired_timing:main",
                     "time an experiment's strategies side by side in rotated rounds (the speed claims' evidence)"),
    "parity-sensitivity": ("shardlab.bench.parity_sensitivity:main",
                           "how far each dtype's loss moves under injected errors (what parity can see)"),
    "resharding": ("shardlab.bench.resharding:main",
                   "train a plan, then continue its checkpoint under other plans (resharded on load)"),
    "evaluate-science": ("shardlab.science.evaluate:main", "score the science runs' models on their test splits"),
    "plan": ("shardlab.costs.planner:main", "predict a parallel plan's memory and step time (evaluate) or rank all plans (search)"),
    "plan-export": ("shardlab.strategies.composed.export:main",
                    "write an experiment that runs the planner's top plans as composed runs (plan to run)"),
    "plan-zero": ("shardlab.strategies.zero.tree:main", "pick a ZeRO stage from model size, device memory and count"),
    "tables": ("shardlab.tables:main", "build one topic's tables from run summaries (what the workflow's rules run)"),
    "render-report": ("shardlab.reporting.render:main", "render the report from the study's tables"),
}


def usage() -> str:
    return "usage: python -m shardlab <command> [args]\n\ncommands:\n" + "\n".join(
        f"  {name:18s} {help_text}" for name, (_, help_text) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"shardlab: error: unknown command {argv[0]!r} (python -m shardlab --help lists them)", file=sys.stderr)
        return 2
    module, func = COMMANDS[argv[0]][0].split(":")
    command = getattr(importlib.import_module(module), func)
    from shardlab.errors import ArtifactError, ConfigError, Interrupted
    try:
        return command(argv[1:]) or 0
    except (ConfigError, ArtifactError) as err:  # bad input named by the layer that found it
        print(f"shardlab {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as err:  # what the command started is stopped and recorded; its job must fail
        print(f"shardlab {argv[0]}: {err}", file=sys.stderr)
        return 128 + err.signum


if __name__ == "__main__":
    raise SystemExit(main())
