"""`python -m shardlab <command> ...` (or `shardlab <command>`): the project's command line.

Each command lives in the module that owns its logic; this file only dispatches.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "check-config": ("shardlab.study:check_main", "validate a config file without running anything"),
    "prepare-model": ("shardlab.prepare:model_main", "build or download an experiment's model"),
    "pretrain": ("shardlab.pretrain:main", "pretrain the science base model on the science experiments' training parts"),
    "prepare-data": ("shardlab.prepare:data_main", "tokenize an experiment's corpus"),
    "launch": ("shardlab.runner.launch:main", "run one strategy under torchrun and record the outcome"),
    "plan": ("shardlab.costs.planner:main", "predict a parallel plan's memory and step time (evaluate) or rank all plans (search)"),
    "plan-export": ("shardlab.strategies.composed.export:main",
                    "write an experiment that runs the planner's top plans as composed runs (plan to run)"),
    "plan-zero": ("shardlab.strategies.zero.tree:main", "pick a ZeRO stage from model size, device memory and count"),
    "tables": ("shardlab.tables:main", "build one topic's tables from run summaries (what the workflow's rules run)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m shardlab <command> [args]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:16s} {help_text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func = COMMANDS[argv[0]][0].split(":")
    return getattr(importlib.import_module(module), func)(argv[1:]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
