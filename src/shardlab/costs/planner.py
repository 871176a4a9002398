"""`python -m shardlab plan evaluate|search`: the cost model from the command line.

    python -m shardlab plan evaluate --model pythia-6.9b --hardware "H100-80GB SXM" --nodes 1 \\
        --global-batch 256 --seq-len 2048 --plan dp=8,zero=3,micro_batch=2
    python -m shardlab plan search --model llama3-405b --hardware "H100-80GB SXM" --nodes 2048 \\
        --global-batch 2048 --seq-len 8192 --top 5 --json

--model: a name from costs/models.yaml, or a Hugging Face config.json / YAML file of a shape.
--hardware: an accelerator of costs/hardware.yaml. --what-if scales catalog figures, e.g.
`--what-if network_gbps=2 hbm_gb=1.5`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from shardlab.costs import hardware
from shardlab.costs.plan import Cluster, Plan, Workload
from shardlab.costs.predict import Prediction, evaluate
from shardlab.costs.rank_memory import MEMORY_CATEGORIES
from shardlab.costs.search import SearchResult, Space, search
from shardlab.costs.shapes import ModelShape
from shardlab.errors import ConfigError

MODELS = Path(__file__).with_name("models.yaml")
GB = 1e9


@lru_cache(maxsize=1)
def known_models() -> dict:
    return yaml.safe_load(MODELS.read_text())


def model_shape(name_or_path: str) -> ModelShape:
    """A named shape (models.yaml) or a config file (HF config.json, YAML)."""
    if name_or_path in known_models():
        return ModelShape.from_dict(known_models()[name_or_path])
    path = Path(name_or_path)
    if not path.exists():
        raise SystemExit(f"--model: {name_or_path!r} is neither a known model ({', '.join(known_models())}) nor a file")
    return ModelShape.from_dict(yaml.safe_load(path.read_text()))


@dataclass(frozen=True)
class Scenario:
    """One entry of the config's `planning.scenarios`: a model on a cluster at a batch."""

    name: str
    model: ModelShape
    cluster: Cluster
    workload: Workload
    space: Space
    description: str = ""


def scenario(entry: dict, where: str) -> Scenario:
    """A config entry as a Scenario; a ConfigError naming the field for an unknown model or accelerator."""
    if entry["model"] not in known_models():
        raise ConfigError(f"{where}.model", f"unknown model {entry['model']!r} (known: {', '.join(known_models())})")
    try:
        hardware.by_name(entry["hardware"])
    except KeyError as err:
        raise ConfigError(f"{where}.hardware", err.args[0]) from None
    cluster = Cluster(entry["hardware"], entry["nodes"], entry.get("gpus_per_node", 8), entry.get("host_memory_gb"))
    space = Space(**{k: tuple(v) for k, v in entry.get("space", {}).items()})
    return Scenario(entry["name"], model_shape(entry["model"]), cluster,
                    Workload(entry["global_batch"], entry["seq_len"]), space, entry.get("description", ""))


def scenarios(planning: dict) -> list[Scenario]:
    return [scenario(entry, f"planning.scenarios[{i}]") for i, entry in enumerate(planning.get("scenarios", []))]


def parse_plan(text: str) -> Plan:
    """'dp=8,tp=2,sp=true,zero=3' -> Plan; a clear error naming an unknown or malformed field."""
    fields = Plan.__dataclass_fields__
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--plan: cannot read {item!r} (fields: {', '.join(fields)})")
        kind = type(fields[key].default)
        values[key] = raw.lower() in ("1", "true", "yes") if kind is bool else kind(raw)
    return Plan(**values)


def parse_what_if(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, factor = item.partition("=")
        out[key] = float(factor)
    return out


def render_prediction(p: Prediction) -> str:
    lines = [f"plan: {p.plan.label()}",
             f"memory per device (fullest rank): {p.device_bytes / GB:.1f} GB of {p.capacity_bytes / GB:.1f} GB usable"
             f" -> {p.why}"]
    lines += [f"  {k:14s} {p.memory[k] / GB:9.2f} GB" for k in MEMORY_CATEGORIES]
    lines.append(f"  {'host (offload)':14s} {p.memory['host_bytes'] / GB:9.2f} GB")
    if p.time:
        lines.append(f"step {p.step_s:.3f} s, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, bottleneck: {p.bottleneck}")
        lines += [f"  {k:14s} {v:9.4f} s" for k, v in p.time.items() if v]
    return "\n".join(lines)


def render_search(r: SearchResult) -> str:
    lines = [f"{r.candidates:,} candidate plans in {r.seconds:.1f} s: {r.fitting:,} fit, "
             f"{r.candidates - r.fitting:,} rejected"]
    for i, p in enumerate(r.ranked, 1):
        lines.append(f"{i:3d}. {p.tokens_per_s:12,.0f} tok/s  MFU {p.mfu:5.1%}  {p.device_bytes / GB:6.1f} GB  "
                     f"{p.bottleneck:12s}  {p.plan.label()}")
    lines.append("rejected:")
    lines += [f"  {n:9,d} {kind:14s} e.g. {r.examples[kind]}" for kind, n in r.rejected.most_common()]
    return "\n".join(lines)


def search_json(r: SearchResult) -> dict:
    return {"candidates": r.candidates, "fitting": r.fitting, "seconds": r.seconds,
            "ranked": [p.as_dict() for p in r.ranked],
            "rejected": [{"reason": k, "plans": n, "example": r.examples[k]} for k, n in r.rejected.most_common()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardlab plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["evaluate", "search"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--hardware", required=True, help="accelerator name in costs/hardware.yaml")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--host-memory-gb", type=float, default=None, help="per node (default: unlimited)")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--plan", default="", help="evaluate: fields of the plan, e.g. dp=8,tp=2,sp=true,zero=1")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--what-if", nargs="*", default=[], help="catalog figure=factor, e.g. network_gbps=2")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cluster = Cluster(args.hardware, args.nodes, args.gpus_per_node, args.host_memory_gb)
    try:
        cluster.device  # noqa: B018  (an unknown accelerator fails here, naming the catalog)
    except KeyError as e:
        raise SystemExit(f"--hardware: {e.args[0]}") from None
    cluster = cluster.scaled(**parse_what_if(args.what_if))
    model, workload = model_shape(args.model), Workload(args.global_batch, args.seq_len)
    if args.mode == "evaluate":
        result = evaluate(model, parse_plan(args.plan), cluster, workload)
        if isinstance(result, str):
            print(json.dumps({"rejected": result}) if args.json else f"rejected: {result}")
            return 1
        print(json.dumps(result.as_dict(), indent=1) if args.json else render_prediction(result))
        return 0
    result = search(model, cluster, workload, top=args.top)
    print(json.dumps(search_json(result), indent=1) if args.json else render_search(result))
    return 0
