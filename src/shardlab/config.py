"""Load, default, validate and resolve the study configuration.

Structure validation uses the JSON schema in `workflow/schemas/` (the same file the Snakefile
hands to `snakemake.utils.validate`); the checks here are the ones a schema cannot express
(known strategy names, divisibility, files that must exist). Every error names its field.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """A configuration value is wrong; the message starts with the offending field."""

    def __init__(self, field: str, problem: str):
        self.field = field
        super().__init__(f"config field '{field}': {problem}")


def load_schema(path: Path = SCHEMA_PATH) -> dict:
    return yaml.safe_load(Path(path).read_text())


def _field_name(path) -> str:
    parts = []
    for p in path:
        parts.append(f"[{p}]" if isinstance(p, int) else ("." if parts else "") + str(p))
    return "".join(parts) or "<root>"


def _defaulting_validator(schema: dict):
    """A validator that fills in `default` values while it validates (jsonschema's documented recipe)."""
    base = jsonschema.Draft202012Validator
    validate_properties = base.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema_):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
        yield from validate_properties(validator, properties, instance, schema_)

    return jsonschema.validators.extend(base, {"properties": set_defaults})(schema)


def validate_against_schema(instance: dict, schema: dict, prefix: str = "") -> None:
    errors = sorted(_defaulting_validator(schema).iter_errors(instance), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        field = _field_name(err.absolute_path)
        if prefix:
            field = prefix if field == "<root>" else f"{prefix}.{field}"
        raise ConfigError(field, err.message)


def deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve_experiment(config: dict, experiment: str, schema: dict | None = None) -> dict:
    """The complete settings of one experiment: defaults, then its overrides, then schema defaults."""
    if experiment not in config["experiments"]:
        raise ConfigError("experiments", f"no experiment named '{experiment}'")
    schema = schema or load_schema()
    merged = deep_merge(config["defaults"], config["experiments"][experiment])
    merged["name"] = experiment
    exp_schema = dict(schema["$defs"]["experiment"], **{"$defs": schema["$defs"]})
    exp_schema = copy.deepcopy(exp_schema)
    exp_schema["properties"]["name"] = {"type": "string"}
    validate_against_schema(merged, exp_schema, prefix=f"experiments.{experiment}")
    return merged


def world_size_for(exp: dict, strategy: str) -> int | str:
    """Processes a run of `strategy` uses in this experiment (may be 'auto' until launch)."""
    from shardlab.strategies import get_spec

    spec = get_spec(strategy)
    if spec.single_process:
        return 1
    options = exp.get("strategy_options", {}).get(strategy, {})
    return options.get("world_size", exp["launch"]["world_size"])


def check_experiment(exp: dict, base_dir: Path | str = ".") -> None:
    """Semantic checks a JSON schema cannot express; raises ConfigError naming the field."""
    from shardlab.core.data import TEXT_FORMATS
    from shardlab.strategies import REGISTRY

    where = f"experiments.{exp['name']}"
    for i, name in enumerate(exp.get("strategies", [])):
        if name not in REGISTRY:
            known = ", ".join(sorted(REGISTRY))
            raise ConfigError(f"{where}.strategies[{i}]", f"unknown strategy '{name}' (known: {known})")
    for name in exp.get("strategy_options", {}):
        if name not in REGISTRY:
            raise ConfigError(f"{where}.strategy_options.{name}", "options given for an unknown strategy")

    model, data, training = exp["model"], exp["data"], exp["training"]
    if model["source"] == "hub" and "hub_id" not in model:
        raise ConfigError(f"{where}.model.hub_id", "required when model.source is 'hub'")
    if model["source"] == "local":
        for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size"):
            if key not in model:
                raise ConfigError(f"{where}.model.{key}", "required when model.source is 'local'")
        if model["hidden_size"] % model["num_heads"]:
            raise ConfigError(f"{where}.model.num_heads", f"must divide hidden_size={model['hidden_size']}")
        max_pos = model.get("max_position_embeddings", 2048)
        if training["seq_len"] > max_pos:
            raise ConfigError(f"{where}.training.seq_len", f"{training['seq_len']} exceeds max_position_embeddings={max_pos}")

    if not (Path(base_dir) / data["path"]).is_file():
        raise ConfigError(f"{where}.data.path", f"file not found: {data['path']}")
    extra_files = {f"{where}.data.split.test_path": (data.get("split") or {}).get("test_path"),
                   **{f"{where}.evaluation.extra_test_sets.{k}": v
                      for k, v in (exp.get("evaluation") or {}).get("extra_test_sets", {}).items()}}
    for field, path in extra_files.items():
        if path and not (Path(base_dir) / path).is_file():
            raise ConfigError(field, f"file not found: {path}")
    if data["format"] not in TEXT_FORMATS:
        raise ConfigError(f"{where}.data.format", f"unknown format '{data['format']}' (known: {', '.join(sorted(TEXT_FORMATS))})")
    if training["warmup_steps"] >= training["steps"]:
        raise ConfigError(f"{where}.training.warmup_steps", "must be smaller than training.steps, or no step is timed")

    for name in exp.get("strategies", []):
        check_batch_split(exp, name, where)
        REGISTRY[name].check_options(exp, f"{where}.strategy_options.{name}")


def check_batch_split(exp: dict, strategy: str, where: str) -> None:
    from shardlab.strategies import get_spec

    world = world_size_for(exp, strategy)
    if world == "auto":
        return  # checked again at launch, once the device count is known
    training = exp["training"]
    dp = get_spec(strategy).data_parallel_size(world, exp.get("strategy_options", {}).get(strategy, {}))
    gbs, mbs = training["global_batch_size"], training.get("micro_batch_size")
    if gbs % dp:
        raise ConfigError(f"{where}.training.global_batch_size", f"{gbs} is not divisible by the {dp} data-parallel ranks of '{strategy}'")
    if mbs and (gbs // dp) % mbs:
        raise ConfigError(f"{where}.training.micro_batch_size", f"{mbs} does not divide the per-rank batch {gbs // dp} of '{strategy}'")


def validate_config(config: dict, base_dir: Path | str = ".", schema: dict | None = None) -> dict:
    """Validate the whole study config in place (defaults filled) and return it."""
    schema = schema or load_schema()
    validate_against_schema(config, schema)
    for name in config["experiments"]:
        check_experiment(resolve_experiment(config, name, schema), base_dir)
    return config


def load_config(path: Path | str, base_dir: Path | str = ".") -> dict:
    return validate_config(yaml.safe_load(Path(path).read_text()), base_dir)


def shared_references(experiments: dict[str, dict]) -> dict[str, str]:
    """{experiment: earlier experiment} for each `single` run identical to an earlier one's.

    Same model, data, training and launch settings give the same deterministic single-device run,
    so the workflow runs it once and shares it.
    """
    first: dict[str, str] = {}
    shared: dict[str, str] = {}
    for name, exp in experiments.items():
        if "single" not in exp.get("strategies", []):
            continue
        settings = {k: exp[k] for k in ("model", "data", "training", "launch")}
        settings["options"] = exp.get("strategy_options", {}).get("single")
        key = json.dumps(settings, sort_keys=True)
        if key in first:
            shared[name] = first[key]
        else:
            first[key] = name
    return shared


def config_hash(exp: dict) -> str:
    return hashlib.sha256(json.dumps(exp, sort_keys=True).encode()).hexdigest()[:12]


def check_main(argv: list[str] | None = None) -> int:
    """`python -m shardlab check-config CONFIG`: validate a config file without running anything."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="shardlab check-config")
    parser.add_argument("config", type=Path)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as err:
        print(f"invalid: {err}", file=sys.stderr)
        return 2
    print(f"ok: {args.config} ({len(cfg['experiments'])} experiments)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab.config check CONFIG` | `write SETTINGS_JSON OUT` (the latter used by the workflow)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "write":
        Path(argv[2]).parent.mkdir(parents=True, exist_ok=True)
        Path(argv[2]).write_text(json.dumps(json.loads(argv[1]), indent=2, sort_keys=True))
        return 0
    if argv and argv[0] == "check":
        return check_main(argv[1:])
    print("usage: python -m shardlab.config check CONFIG | write SETTINGS_JSON OUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
