"""The study: a configuration checked in full, its experiments resolved, and the runs they make.

This is the one check path: the Snakefile (`workflow/rules/common.smk`) and
`python -m shardlab check-config` both call `load_study`, so they accept and reject exactly the
same files. It joins what the lower layers cannot see on their own: the config (schema and
settings checks), the strategy registry (names, options, batch splits) and the text formats.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from shardlab.science.formats import FORMATS as SCIENCE_FORMATS  # importing registers the text formats
from shardlab import cli
from shardlab.config import check_settings, load_schema, resolve_experiment, run_layout, validate_against_schema
from shardlab.core.data import TEXT_FORMATS
from shardlab.errors import ConfigError
from shardlab.provenance import sources
from shardlab.strategies import REGISTRY, SINGLE, get_spec, threads_per_rank
from shardlab.strategies.composed.export import plan_search
from shardlab.tables.parity import check_sensitivity_config, noise_floor_runs, planned_tolerance
from shardlab.tables.resharding import check_resharding


@dataclass(frozen=True)
class Study:
    experiments: dict[str, dict]  # name -> resolved settings
    shared_references: dict[str, str]  # experiment -> earlier experiment whose identical `single` run it reuses
    plan_search: dict  # what the plan-to-run loop found (strategies.composed.export.plan_search), or {}

    @property
    def runs(self) -> list[tuple[str, str]]:
        return [(name, s) for name, exp in self.experiments.items()
                for s in [*exp["strategies"], *exp.get("noise_floor_runs", [])]]

    def runs_of(self, topic: str) -> list[tuple[str, str]]:
        """Runs of the topic's strategies, with the references they are compared with (same experiment)."""
        wanted = set()
        for name, strategy in self.runs:
            spec = get_spec(strategy)
            if spec.topic == topic:
                wanted |= {(name, strategy), (name, spec.reference)}
        return [run for run in self.runs if run in wanted]

    def experiments_of(self, topic: str) -> list[str]:
        return list(dict.fromkeys(name for name, _ in self.runs_of(topic)))

    @property
    def science_experiments(self) -> list[str]:
        """Experiments whose data is a science format (chemistry, biology, materials): split, evaluated."""
        return [name for name, exp in self.experiments.items() if exp["data"]["format"] in SCIENCE_FORMATS]

    def pretrain_settings(self, model_name: str) -> dict:
        """What rule pretrain runs for a `source: pretrain` model (shardlab.pretrain)."""
        return pretrain_settings(self.by_name("model")[model_name], self.experiments)

    @property
    def pretrained_models(self) -> list[str]:
        return [name for name, model in self.by_name("model").items() if model["source"] == "pretrain"]

    def by_name(self, section: str) -> dict[str, dict]:
        """Models (section 'model') or corpora ('data') by name: one name, one definition."""
        key = "name" if section == "model" else "corpus"
        return {exp[section][key]: exp[section] for exp in self.experiments.values()}


def check_experiment(exp: dict, base_dir: Path | str = ".") -> None:
    """Every check of one resolved experiment; raises ConfigError naming the field."""
    where = f"experiments.{exp['name']}"
    check_settings(exp, base_dir)
    if exp["data"]["format"] not in TEXT_FORMATS:
        raise ConfigError(f"{where}.data.format",
                          f"unknown format '{exp['data']['format']}' (known: {', '.join(sorted(TEXT_FORMATS))})")
    for i, name in enumerate(exp.get("strategies", [])):
        if name not in REGISTRY:
            raise ConfigError(f"{where}.strategies[{i}]", f"unknown strategy '{name}' (known: {', '.join(sorted(REGISTRY))})")
    for name in exp.get("strategy_options", {}):
        if name not in REGISTRY:
            raise ConfigError(f"{where}.strategy_options.{name}", "options given for an unknown strategy")
        if name not in exp.get("strategies", []):  # a typo'd list, or options that would silently do nothing
            raise ConfigError(f"{where}.strategy_options.{name}",
                              f"options given for '{name}', which this experiment does not run (strategies: "
                              f"{', '.join(exp.get('strategies', []))})")
    for name in [*exp.get("strategies", []), *exp.get("noise_floor_runs", [])]:
        REGISTRY[name].check(exp, where)
        check_placement(exp, name, where)


def check_placement(exp: dict, strategy: str, where: str) -> None:
    """A run fills whole nodes, and its tensor-parallel group stays inside one node unless
    launch.allow_tp_across_nodes (the rule of `config.run_layout`); raises ConfigError naming the field."""
    spec = REGISTRY[strategy]
    world = spec.world_size(exp)
    field = f"{where}.strategy_options.{strategy}.world_size" if "world_size" in spec.options(exp) else f"{where}.launch.nodes"
    nodes, per_node = run_layout(exp["launch"], world, field)
    tp = spec.plan_fields(int(world), spec.options(exp)).get("tp", 1) if world != "auto" else 1
    if tp == 1 or nodes == 1 or exp["launch"].get("allow_tp_across_nodes"):
        return
    if tp > per_node:
        raise ConfigError(f"{where}.launch.nodes",
                          f"'{strategy}' would put its tensor-parallel group of {tp} ranks across {nodes} nodes of "
                          f"{per_node}; TP belongs inside a node (give the run one node with strategy_options."
                          f"{strategy}.world_size, or set launch.allow_tp_across_nodes: true)")


def _check_unique_names(experiments: dict[str, dict]) -> None:
    """Models and corpora are shared by name across experiments (resources/models/<name>, ...)."""
    for section, key in (("model", "name"), ("data", "corpus")):
        seen: dict[str, dict] = {}
        for exp in experiments.values():
            spec = exp[section]
            if seen.setdefault(spec[key], spec) != spec:
                raise ConfigError(f"experiments.{exp['name']}.{section}",
                                  f"{section} '{spec[key]}' is defined differently in another experiment; "
                                  f"give the variant its own {key}")


def shared_references(experiments: dict[str, dict]) -> dict[str, str]:
    """{experiment: earlier experiment} for each single-device reference run identical to an earlier one's.

    Same model, data, training, launch and evaluation settings give the same deterministic
    single-device run and the same saved model, so the workflow runs it once and shares it.
    """
    first: dict[str, str] = {}
    shared: dict[str, str] = {}
    for name, exp in experiments.items():
        if SINGLE.name not in exp.get("strategies", []):
            continue
        settings = {k: exp.get(k) for k in ("model", "data", "training", "launch", "evaluation")}
        # A budget only changes how the tables judge the runs, not the run itself.
        settings["launch"] = {k: v for k, v in exp["launch"].items() if k != "device_memory_budget_bytes"}
        settings["options"] = exp.get("strategy_options", {}).get(SINGLE.name)
        key = json.dumps(settings, sort_keys=True)
        if key in first:
            shared[name] = first[key]
        else:
            first[key] = name
    return shared


def run_resources(exp: dict, strategy: str) -> dict:
    """What a run of `strategy` in `exp` uses, per node of its layout (`config.run_layout`): nodes,
    processes (ranks) per node, CPU threads per node (`strategies.threads_per_rank`), one GPU per rank when
    launch.device is cuda ('auto' ranks take every GPU of the machine they land on, so none is requested;
    `gpus` is the total), and host memory per node (launch.mem_mb_per_rank x ranks; 'auto': one rank's)."""
    launch = exp["launch"]
    world = REGISTRY[strategy].world_size(exp)
    nodes, per_node = run_layout(launch, world, f"experiments.{exp['name']}.launch")
    cuda = launch["device"] == "cuda" and per_node != "auto"
    ranks = 1 if per_node == "auto" else per_node
    return {"nodes": nodes, "ranks_per_node": per_node, "threads": threads_per_rank(exp, strategy) * ranks,
            "gpus_per_node": per_node if cuda else 0, "gpus": nodes * per_node if cuda else 0,
            "mem_mb": launch.get("mem_mb_per_rank", 2000) * ranks}


def run_sources(strategy: str) -> list[str]:
    """The source files a run of `strategy` executes (config, core, runner, and the strategy's module with
    everything it imports): a run declares them, so editing one reruns only the runs it touches."""
    package = Path(__file__).parent
    own = sources(REGISTRY[strategy].target.split(":")[0])
    shared = [*package.glob("core/*.py"), *package.glob("runner/*.py"), package / "config.py"]
    return sorted(str(f) for f in {*own, *shared})


def prepared_inputs(config: dict, exp: dict) -> tuple[Path, Path]:
    """(model folder, token file) the DAG's prepare rules write for an experiment (workflow/rules/common.smk)."""
    resources = Path(config.get("resources_dir", "resources"))
    return (resources / "models" / exp["model"]["name"],
            resources / "data" / exp["model"]["name"] / exp["data"]["corpus"] / "tokens.npy")


def check_output_dirs(config: dict, base_dir: Path | str) -> None:
    """results_dir and resources_dir stay inside the working directory or the repository (`base_dir`)
    unless `allow_outside_project`: the workflow clears and replaces folders under them."""
    if config["allow_outside_project"]:
        return
    roots = [Path.cwd().resolve(), Path(base_dir).resolve()]
    for key in ("results_dir", "resources_dir"):
        path = Path(config[key]).expanduser().resolve()
        if not any(path == root or root in path.parents for root in roots):
            raise ConfigError(key, f"'{config[key]}' resolves to {path}, outside the project ({roots[0]}); "
                                   f"set allow_outside_project: true to write there")


def check_report(config: dict, base_dir: Path | str) -> None:
    noise = config["report"]["timing_noise"]
    if noise and not (Path(base_dir) / noise).is_file():
        raise ConfigError("report.timing_noise", f"file not found: {noise} (write one with scripts/timing-noise.py "
                                                 f"--out {noise}, or set it to '' to judge on within-run noise alone)")


def check_planning(config: dict) -> None:
    """Every planning scenario names a known model and accelerator (costs/models.yaml, hardware.yaml)."""
    from shardlab.costs.planner import scenarios

    names = [s.name for s in scenarios(config["planning"])]
    ladder = config["planning"].get("zero_ladder")
    if ladder and ladder["scenario"] not in names:
        raise ConfigError("planning.zero_ladder.scenario", f"no scenario named {ladder['scenario']!r} (scenarios: {names})")


def pretrain_settings(model: dict, experiments: dict[str, dict]) -> dict:
    """{model, experiment, corpora} of a pretrained base model: the corpora are the listed science
    experiments' data (their training parts only); the pretraining run is the first listed experiment
    with `pretrain.training` over its training settings, run by `pretrain.strategy`, its final model saved."""
    spec = model["pretrain"]
    first = experiments[spec["experiments"][0]]
    cap = spec.get("max_documents")
    corpora = [dict(experiments[e]["data"], max_documents=cap.get(e) if isinstance(cap, dict) else cap)
               for e in spec["experiments"]]
    # The base model's snapshots are not needed: only the fine-tuned models' curves are scored.
    training = {**first["training"], "save_model_every": 0, **spec["training"], "save_model": True}
    exp = {**first, "name": f"pretrain_{model['name']}", "strategies": [spec.get("strategy", SINGLE.name)], "training": training,
           "data": {"corpus": f"{model['name']}_union", "path": "-", "format": "-", "windows": first["data"]["windows"]},
           "strategy_options": {}, "evaluation": {}}
    return {"model": model, "experiment": exp, "corpora": corpora}


def check_pretrain(experiments: dict[str, dict]) -> None:
    """A pretrained model lists science experiments with split data, none of which trains on its own
    held-out rows; raises ConfigError naming the field."""
    for exp in experiments.values():
        model = exp["model"]
        if model["source"] != "pretrain":
            if model.get("tokenizer") == "auto":
                raise ConfigError(f"experiments.{exp['name']}.model.tokenizer", "'auto' is for source: pretrain only")
            continue
        field = f"experiments.{exp['name']}.model.pretrain"
        if "pretrain" not in model:
            raise ConfigError(field, "required when model.source is 'pretrain'")
        for i, name in enumerate(model["pretrain"]["experiments"]):
            if name not in experiments:
                raise ConfigError(f"{field}.experiments[{i}]", f"no experiment named {name!r}")
            data = experiments[name]["data"]
            if data["format"] not in SCIENCE_FORMATS or not data.get("split"):
                raise ConfigError(f"{field}.experiments[{i}]",
                                  f"{name!r} must have a science format and data.split (pretraining reads only its training part)")
        cap = model["pretrain"].get("max_documents")
        for name in cap if isinstance(cap, dict) else []:
            if name not in model["pretrain"]["experiments"]:
                raise ConfigError(f"{field}.max_documents.{name}", "not one of pretrain.experiments")
        if model["pretrain"]["training"].get("seq_len", 0) > model.get("max_position_embeddings", 2048):
            raise ConfigError(f"{field}.training.seq_len", "exceeds max_position_embeddings")


def load_study(config: dict, base_dir: Path | str = ".") -> Study:
    """Validate the whole config (schema defaults filled in place) and resolve its experiments."""
    schema = load_schema()
    validate_against_schema(config, schema)
    check_output_dirs(config, base_dir)
    check_report(config, base_dir)
    check_planning(config)
    searched, found = plan_search(config, schema)  # the plan-to-run loop's experiment, found by the planner
    config = {**config, "experiments": {**config["experiments"], **searched}}
    experiments = {name: resolve_experiment(config, name, schema) for name in config["experiments"]}
    for exp in experiments.values():
        exp["noise_floor_runs"] = noise_floor_runs(exp)  # the runs the parity rule needs beside the listed ones
        check_experiment(exp, base_dir)
    _check_unique_names(experiments)
    check_pretrain(experiments)
    check_sensitivity_config(config, experiments)
    check_resharding(config, experiments)
    return Study(experiments, shared_references(experiments), found)


def load_study_file(path: Path | str, base_dir: Path | str = ".") -> Study:
    return load_study(yaml.safe_load(Path(path).read_text()), base_dir)


def check_main(argv: list[str] | None = None) -> int:
    """`python -m shardlab check-config CONFIG`: validate a config file without running anything."""
    parser = cli.Parser(prog="shardlab check-config", description=check_main.__doc__)
    parser.add_argument("config", type=cli.existing_file)
    parser.add_argument("--base-dir", type=cli.existing_dir, default=Path("."), help="where data paths are relative to")
    args = parser.parse_args(argv)
    try:
        study = load_study_file(args.config, args.base_dir)
    except ConfigError as err:
        print(f"invalid: {err}", file=sys.stderr)
        return 2
    print(f"ok: {args.config} ({len(study.experiments)} experiments, {len(study.runs)} runs)")
    print("parity tolerances (shardlab.tables.parity):\n" + "\n".join(
        f"  {name}: {planned_tolerance(exp)}" for name, exp in study.experiments.items()))
    return 0
