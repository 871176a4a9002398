"""Load, default, validate and resolve the study configuration (no strategy knowledge here).

Structure validation uses the JSON schema in `workflow/schemas/` (the same file the Snakefile
hands to `snakemake.utils.validate`); `check_settings` adds what a schema cannot express about
the model, data and training settings (files that must exist, sizes that must agree). The checks
that need the strategy registry or the text formats live in `shardlab.study`, the one check path
of the Snakefile and `shardlab check-config`. Every error names its field.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import jsonschema
import yaml

from shardlab.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


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
    resolve_launch(merged["launch"], f"experiments.{experiment}.launch")
    return merged


def block_experiment(config: dict, key: str, experiments: dict[str, dict]) -> tuple[dict, dict] | None:
    """A config block that names one of the study's experiments (`<key>.experiment`): (the block, that
    experiment resolved), or None without the block; a name the study does not have is a ConfigError."""
    block = config.get(key)
    if not block:
        return None
    name = block["experiment"]
    if name not in experiments:
        raise ConfigError(f"{key}.experiment", f"no experiment named {name!r} (experiments: {sorted(experiments)})")
    return block, experiments[name]


def resolve_launch(launch: dict, where: str) -> None:
    """Fill in world_size and gpus_per_node from each other and launch.nodes (world = nodes x gpus_per_node),
    in place; raises ConfigError naming the field when they disagree. 'auto' (count the GPUs at launch)
    only describes one machine."""
    nodes, world, per_node = launch.setdefault("nodes", 1), launch.get("world_size"), launch.get("gpus_per_node")
    if "auto" in (world, per_node) and nodes > 1:
        field = "gpus_per_node" if per_node == "auto" else "world_size"
        raise ConfigError(f"{where}.{field}", f"'auto' counts the GPUs of one machine; with nodes: {nodes} give "
                                              "gpus_per_node as a number")
    if per_node is None:
        if world != "auto" and world % nodes:
            raise ConfigError(f"{where}.nodes", f"world_size {world} does not split evenly over {nodes} nodes")
        per_node = "auto" if world == "auto" else world // nodes
    product = "auto" if per_node == "auto" else nodes * per_node
    if world is not None and world != product:
        raise ConfigError(f"{where}.world_size", f"{world} is not nodes x gpus_per_node = {nodes} x {per_node}")
    launch.update(world_size=product, gpus_per_node=per_node)


def run_layout(launch: dict, world: int | str, field: str) -> tuple[int, int | str]:
    """(nodes, processes per node) of a run of `world` processes under a resolved `launch`.

    The topology rule: ranks fill a node before the next one (torchrun numbers node by node), so
    the innermost, most talkative group of a mesh (tensor parallel) sits inside a node, and the
    outer ones (pipeline stages, data-parallel replicas) span nodes. A run smaller than the
    allocation takes as few nodes as it fits on (`single`: one process on one node); a run that
    does not fill whole nodes evenly is rejected, naming `field`. On one node a strategy may ask for
    more processes than launch.world_size (strategy_options.<s>.world_size), as before."""
    cap = launch.get("gpus_per_node", "auto")
    if world == "auto" or launch.get("nodes", 1) == 1 or cap in (None, "auto"):
        return 1, world  # one machine (as many processes as the strategy asks); 'auto' is counted at launch
    per_node = min(int(world), cap)
    nodes = -(-int(world) // per_node)
    if int(world) % per_node or nodes > launch.get("nodes", 1):
        raise ConfigError(field, f"{world} processes do not fill whole nodes of {launch['gpus_per_node']} "
                                 f"(launch.nodes: {launch.get('nodes', 1)})")
    return nodes, per_node


def check_settings(exp: dict, base_dir: Path | str = ".") -> None:
    """Model, data and training checks a JSON schema cannot express; raises ConfigError naming the field."""
    where = f"experiments.{exp['name']}"
    model, data, training = exp["model"], exp["data"], exp["training"]
    if model["source"] == "hub" and "hub_id" not in model:
        raise ConfigError(f"{where}.model.hub_id", "required when model.source is 'hub'")
    if model["source"] in ("local", "pretrain"):
        sizes = ["hidden_size", "num_layers", "num_heads", "intermediate_size"]
        # A pretrained char model's vocabulary is the characters of its corpus; a local model is built first.
        sizes += ["vocab_size"] if model["source"] == "local" or model.get("tokenizer", "bpe") == "bpe" else []
        for key in sizes:
            if key not in model:
                raise ConfigError(f"{where}.model.{key}", f"required when model.source is '{model['source']}'")
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
    if training["warmup_steps"] >= training["steps"]:
        raise ConfigError(f"{where}.training.warmup_steps", "must be smaller than training.steps, or no step is timed")



def config_hash(exp: dict) -> str:
    return hashlib.sha256(json.dumps(exp, sort_keys=True).encode()).hexdigest()[:12]
