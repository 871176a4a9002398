"""The layout's rules, checked: imports only go down the layers (and never in a cycle), the
registry is the single source of strategy facts (every strategy has a communication plan, a
memory prediction and a place in its topic's rule, tables and report section), and neither the
workflow rules nor the report keep their own lists of strategy or experiment names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from helpers import REPO
from shardlab.costs.plan import Cluster, Workload, rejection
from shardlab.costs.predict import collectives, rank_states
from shardlab.costs.shapes import ModelShape
from shardlab.strategies import REGISTRY, TOPICS as STRATEGY_TOPICS, Family
from shardlab.tables import TOPICS as TABLE_TOPICS

SRC = REPO / "src" / "shardlab"

# What each part of the package may import (besides itself). Lower layers never import higher ones.
ALLOWED = {
    "errors": set(),
    "cli": set(),  # the command line's contract (one-line errors), below every layer that has a command
    "config": {"errors"},
    "core": {"cli", "errors", "config"},
    "costs": {"cli", "errors"},
    "strategies": {"cli", "errors", "config", "core", "costs"},
    "runner": {"cli", "errors", "config", "core", "costs", "strategies"},
    "bench": {"cli", "errors", "config", "core", "costs", "strategies", "runner"},
    "science": {"cli", "errors", "config", "core"},
    "tables": {"cli", "errors", "config", "core", "costs", "strategies", "science"},
    "reporting": {"cli", "tables"},  # tables.has_columns: the table files' one reader
    "provenance": set(),
    "study": {"cli", "errors", "config", "core", "costs", "strategies", "science", "tables", "provenance"},  # tables.parity: which runs the rule needs
    "prepare": {"cli", "errors", "core", "science"},
    "pretrain": {"cli", "errors", "core", "science", "runner"},  # builds a model by running the runner
    "__main__": {"errors"},  # dispatches by name (importlib), imports no command module
    "__init__": set(),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(("shardlab", *path.relative_to(SRC).with_suffix("").parts))
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every shardlab module `name` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {m for m in found if m in mods and m != name}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_only_go_down_the_layers():
    mods = _modules()
    assert set(map(_part, mods)) <= set(ALLOWED), sorted(set(map(_part, mods)) - set(ALLOWED))
    upward = [(m, dep) for m, path in mods.items() for dep in _imports(m, path, mods)
              if _part(dep) != _part(m) and _part(dep) not in ALLOWED[_part(m)]]
    assert not upward, "imports against the layering:\n" + "\n".join(f"  {m} -> {d}" for m, d in sorted(upward))


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for dep in graph[m]:
            if state.get(dep) == 1:
                return [*path, m, dep]
            if dep not in state and (cycle := visit(dep, [*path, m])):
                return cycle
        state[m] = 2
        return None

    for m in graph:
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, " -> ".join(cycle)


def test_the_report_imports_only_reporting():
    for qmd in (REPO / "reports").rglob("*.qmd"):
        for module in re.findall(r"^\s*(?:from|import)\s+(shardlab[\w.]*)", qmd.read_text(), re.MULTILINE):
            assert module.startswith("shardlab.reporting"), f"{qmd.name} imports {module}"


def test_no_source_file_is_over_300_lines():
    long = {str(p.relative_to(REPO)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert not long, long


# --- the registry is the single source of strategy facts ----------------------------------------
SHAPE = ModelShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256)
EXP = {"training": {"global_batch_size": 8, "seq_len": 32, "micro_batch_size": None, "dtype": "fp32",
                    "optimizer": "adamw"}, "strategy_options": {}}


def _world(spec) -> int:
    return 1 if spec.single_process else 4 if spec.family == Family.HYBRID else 2


def predicted_run(spec, world: int):
    """(model, plan, collectives, per-rank model states) of a run of `spec`, as the tables predict it."""
    model, plan = spec.run_model(SHAPE, EXP), spec.run_plan(EXP, world)
    calls = collectives(model, plan, Workload.from_training(EXP["training"]))
    return model, plan, calls, [rank_states(model, plan, r) for r in range(world)]


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_strategy_is_a_valid_plan_with_a_prediction_and_a_home(name):
    spec = REGISTRY[name]
    world = _world(spec)
    model, plan, calls, states = predicted_run(spec, world)
    assert rejection(model, plan, Cluster("H100-SXM", 1, world), Workload(8, 32), "shardlab") is None, name
    assert plan.world == world and isinstance(spec.family, Family)
    assert spec.single_process or calls, f"{name}: no communication"
    assert all(call.bus_bytes > 0 for call in calls), f"{name}: a call moves no bytes"
    assert all(s.param_bytes > 0 and s.optimizer_bytes > 0 for s in states), name
    assert sum(s.param_bytes for s in states) >= 4 * model.parameters() - 1, f"{name}: parameters lost"
    assert REGISTRY[spec.reference].reference == spec.reference, f"{name}: reference {spec.reference} is not a reference"
    assert spec.twin is None or REGISTRY[spec.twin].family == spec.family
    assert spec.topic in TABLE_TOPICS
    for path in (f"workflow/rules/{spec.topic}.smk", f"reports/sections/{spec.topic}.qmd",
                 f"src/shardlab/tables/{spec.topic}.py"):
        assert (REPO / path).is_file(), f"{name}: topic '{spec.topic}' has no {path}"


def test_registry_topics_are_table_topics_and_every_topic_has_its_three_files():
    assert set(STRATEGY_TOPICS) <= set(TABLE_TOPICS)
    for topic in TABLE_TOPICS:
        for path in (f"workflow/rules/{topic}.smk", f"reports/sections/{topic}.qmd", f"src/shardlab/tables/{topic}.py"):
            assert (REPO / path).is_file(), path


def test_a_strategy_whose_plan_communicates_nothing_is_caught(monkeypatch):
    """The walk above can fail: a multi-rank strategy whose Plan puts every rank alone is reported."""
    from dataclasses import replace

    monkeypatch.setitem(REGISTRY, "ddp", replace(REGISTRY["ddp"], plan=lambda world, options: {"dp": 1}))
    with pytest.raises(AssertionError):
        test_every_strategy_is_a_valid_plan_with_a_prediction_and_a_home("ddp")


# One implementation per prediction: the tables ask `costs.predict`, never the models behind it.
PREDICTION_MODULES = {"shardlab.costs.rank_memory", "shardlab.costs.step_time", "shardlab.costs.comm_volume"}
PREDICTION_NAMES = {"shardlab.costs.sharded_states": {"predict", "unsharded"}}


def test_tables_take_predictions_only_from_the_one_entry_point():
    bad = []
    for path in (SRC / "tables").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {a.name for a in node.names}
                if node.module in PREDICTION_MODULES and names - {"Call", "bytes_per_rank"}:
                    bad.append(f"{path.name}: {node.module} {sorted(names)}")
                if names & PREDICTION_NAMES.get(node.module, set()):
                    bad.append(f"{path.name}: {node.module} {sorted(names)}")
                if node.module == "shardlab.costs" and names & {m.rsplit(".", 1)[1] for m in PREDICTION_MODULES}:
                    bad.append(f"{path.name}: {node.module} {sorted(names)}")
    assert not bad, "tables predicting around costs.predict:\n" + "\n".join(bad)


# --- no name lists outside the registry and the configs -----------------------------------------
def _experiment_names() -> set[str]:
    """Experiment names of the shipped configs; a topic name (e.g. "zero") is allowed in code even where
    an experiment shares it."""
    names = {name for cfg in (REPO / "config").glob("*.yaml") for name in yaml.safe_load(cfg.read_text()).get("experiments", {})}
    return names - set(TABLE_TOPICS)


def _python_chunks(qmd: Path) -> str:
    return "\n".join(re.findall(r"```\{python\}\n(.*?)```", qmd.read_text(), re.DOTALL))


def _quoted_names(code: str, names: set[str]) -> set[str]:
    return {s for s in re.findall(r"[\"']([A-Za-z0-9_]+)[\"']", code) if s in names}


@pytest.mark.parametrize("path", [*sorted((REPO / "workflow").rglob("*.smk")), REPO / "Snakefile",
                                  *sorted((REPO / "reports").rglob("*.qmd"))], ids=lambda p: p.name)
def test_rules_and_report_name_no_strategy_or_experiment(path):
    code = _python_chunks(path) if path.suffix == ".qmd" else path.read_text()
    assert not _quoted_names(code, (set(REGISTRY) - set(TABLE_TOPICS)) | _experiment_names()), path


# --- roles, not names: tables, captions and benchmarks ask the registry (strategies.roles) ------------
ROLE_FREE = ("tables", "reporting", "bench")


def _name_literals() -> set[str]:
    """Strings that would name a strategy: every registered name, less those that are also a Plan field
    (`"tp"` is the tensor-parallel degree as much as a strategy) or a table topic (`"composed"`)."""
    from dataclasses import fields

    from shardlab.costs.plan import Plan

    return set(REGISTRY) - {f.name for f in fields(Plan)} - set(TABLE_TOPICS)


def strategy_literals(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every string constant in `source` equal to one of `names` (docstrings and f-string
    text included: a name in prose is a name all the same)."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


@pytest.mark.parametrize("part", ROLE_FREE)
def test_no_strategy_name_literal_in_tables_reporting_or_bench(part):
    names = _name_literals()
    found = [f"{path.relative_to(SRC)}:{line} {name!r}" for path in sorted((SRC / part).glob("*.py"))
             for line, name in strategy_literals(path.read_text(), names)]
    assert not found, "strategy names written out (ask shardlab.strategies.roles):\n" + "\n".join(found)


def test_a_strategy_name_literal_is_caught():
    """The scan above can fail: a table that picks the single device by name is reported, an axis is not."""
    names = _name_literals()
    table = 'REFERENCE = "single"\nAXES = ("dp", "tp")\n'
    assert strategy_literals(table, names) == [(1, "single")]


# --- one prediction per run: the runs step writes it (tables.rank_predictions), every other table reads it --
PREDICTION_WRITER = "rank_predictions.py"
# What costs.predict says about one rank of a run. Other names stay open to every table: `evaluate` (the
# planner on a cluster the table chooses: a calibrated step time, a fit on a smaller device), `collectives`
# (a run's calls), `Prediction` and `MEMORY_CATEGORIES`.
PER_RANK_PREDICTIONS = {"rank_states", "stage_states", "rank_activations", "exact_tensors", "predicted_ranks"}


def predictions_around_the_table(module: str, source: str) -> list[str]:
    """Imports in table module `module` (a file name) that reach a per-rank prediction without the table:
    the names above, or `costs.predict` as a module (every function behind one name)."""
    if module == PREDICTION_WRITER:
        return []
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "shardlab.costs.predict":
            bad += [f"{module}: {a.name}" for a in node.names if a.name in PER_RANK_PREDICTIONS | {"*"}]
        elif isinstance(node, ast.ImportFrom) and node.module == "shardlab.costs":
            bad += [f"{module}: shardlab.costs.predict" for a in node.names if a.name == "predict"]
        elif isinstance(node, ast.Import):
            bad += [f"{module}: {a.name}" for a in node.names if a.name == "shardlab.costs.predict"]
    return bad


def test_tables_read_the_one_prediction_per_rank():
    bad = [b for path in sorted((SRC / "tables").glob("*.py"))
           for b in predictions_around_the_table(path.name, path.read_text())]
    assert not bad, f"tables predicting a rank themselves (read {PREDICTION_WRITER}'s table):\n" + "\n".join(bad)


def test_a_table_predicting_a_rank_itself_is_caught():
    """The check above can fail: a table importing rank_states (or the whole module) is reported; the writer,
    and a table asking the planner about a cluster, are not."""
    own = "from shardlab.costs.predict import evaluate, rank_states\nfrom shardlab.costs import predict\n"
    assert predictions_around_the_table("zero.py", own) == ["zero.py: rank_states", "zero.py: shardlab.costs.predict"]
    assert predictions_around_the_table(PREDICTION_WRITER, own) == []
    assert predictions_around_the_table("zero.py", "from shardlab.costs.predict import Prediction, evaluate\n") == []
