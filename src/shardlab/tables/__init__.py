"""Run results -> the tidy tables the report draws, one module per topic.

Each topic (`runs`, `data_parallel`, `zero`, `tensor_parallel`, `pipeline`, `context_expert`,
`composed`, `communication`, `science`) has a module here with `build(inputs) -> {table name: DataFrame}`, a
rule file `workflow/rules/<topic>.smk` that declares its inputs, and a report section
`reports/sections/<topic>.qmd` that only draws its tables. Every derived number (parity against
the reference, theory and model predictions beside the measurements) is a column computed here,
once. Builders receive their inputs as arguments (what the rule declared), never by walking the
results folder, and every table is written by `write_tables`.

    python -m shardlab tables TOPIC --out-dir results/tables --summaries ... --metrics ... \\
        --experiments ... --models ... --tables name=path ...
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from shardlab import cli
from shardlab.core.step_stats import read_step_log

TOPICS = ("runs", "data_parallel", "zero", "tensor_parallel", "pipeline", "context_expert", "composed",
          "communication", "science", "verdicts", "planning", "predictions", "guide", "abstract")


@dataclass
class TableInputs:
    """What a topic's rule declared, read: run summaries (their step records under `step_log` when given), resolved
    experiment settings by name, model records (`shardlab_model.json`) by name, and other tables."""

    summaries: list[dict] = field(default_factory=list)
    experiments: dict[str, dict] = field(default_factory=dict)
    models: dict[str, dict] = field(default_factory=dict)
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)  # config blocks a topic reads (e.g. `planning`)
    records: list[dict] = field(default_factory=list)  # measurements kept in the repository (reports/gpu/*.json)
    workers: int = 1  # processes a topic may use: the rule's threads, so never more cores than it was given

    @classmethod
    def read(cls, summaries=(), metrics=(), experiments=(), models=(), tables=(), settings=None,
             records=()) -> TableInputs:
        runs = [json.loads(Path(p).read_text()) for p in summaries]
        for run, steps in zip(runs, metrics):
            run["step_log"] = read_step_log(steps)
        return cls(runs, {e["name"]: e for e in map(_read_json, experiments)},
                   {m["name"]: m for m in map(_read_json, models)},
                   {Path(p).stem: read_table(p) for p in tables}, settings or {}, [_read_json(p) for p in records])

    def experiment(self, summary: dict) -> dict:
        return self.experiments[summary["experiment"]]

    def model_shape(self, exp: dict):
        """The experiment's ModelShape: from its settings (local models) or the model record (any model)."""
        from shardlab.costs.shapes import ModelShape

        record = self.models.get(exp["model"]["name"])
        if record and "shape" in record:
            return ModelShape.from_dict(record["shape"])
        return ModelShape.from_dict(exp["model"]) if exp["model"]["source"] == "local" else None


def _read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def has_columns(path) -> bool:
    """Whether a table file names any column: `write_tables` writes a frame without columns (a topic with
    nothing to say) as one newline, and an interrupted writer may leave nothing."""
    with Path(path).open() as table:
        return bool(table.readline().strip())


def read_table(path) -> pd.DataFrame:
    """A table as `write_tables` wrote it, one without columns as an empty frame."""
    return pd.read_csv(path) if has_columns(path) else pd.DataFrame()


def write_tables(tables: dict[str, pd.DataFrame], out_dir: Path) -> None:
    """The one CSV writer: each table as out_dir/<name>.csv."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, frame in tables.items():
        frame.to_csv(out_dir / f"{name}.csv", index=False)
        print(f"{name}.csv: {len(frame)} rows")


def build(topic: str, inputs: TableInputs) -> dict[str, pd.DataFrame]:
    if topic not in TOPICS:
        raise ValueError(f"unknown table topic '{topic}' (known: {', '.join(TOPICS)})")
    return importlib.import_module(f"shardlab.tables.{topic}").build(inputs)


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="shardlab tables", description=__doc__)
    parser.add_argument("topic", choices=TOPICS)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--summaries", type=cli.existing_file, nargs="*", default=[], help="results/<exp>/runs/<strategy>/summary.json")
    parser.add_argument("--metrics", type=cli.existing_file, nargs="*", default=[], help="the runs' metrics.jsonl, same order")
    parser.add_argument("--experiments", type=cli.existing_file, nargs="*", default=[], help="results/<exp>/experiment.json")
    parser.add_argument("--models", type=cli.existing_file, nargs="*", default=[], help="resources/models/<name>/shardlab_model.json")
    parser.add_argument("--tables", type=cli.existing_file, nargs="*", default=[], help="other tables the topic reads (CSV)")
    parser.add_argument("--records", type=cli.existing_file, nargs="*", default=[],
                        help="measurement records kept in the repository (JSON, e.g. reports/gpu/<date>-<device>.json)")
    parser.add_argument("--settings", type=cli.json_value, default=None, help="config blocks the topic reads, as JSON (e.g. planning)")
    parser.add_argument("--workers", type=cli.count, default=1, help="processes the topic may use (the rule's threads)")
    args = parser.parse_args(argv)
    if args.metrics and len(args.metrics) != len(args.summaries):
        parser.error(f"--metrics: {len(args.metrics)} step logs for {len(args.summaries)} run summaries "
                     "(one per run, in the same order)")
    inputs = TableInputs.read(args.summaries, args.metrics, args.experiments, args.models, args.tables, args.settings,
                              args.records)
    inputs.workers = args.workers
    write_tables(build(args.topic, inputs), args.out_dir)
    return 0
