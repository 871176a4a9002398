"""`python -m shardlab plan evaluate|search`: the cost model from the command line.

    python -m shardlab plan evaluate --model pythia-6.9b --hardware "H100-80GB SXM" --nodes 1 \\
        --global-batch 256 --seq-len 2048 --stack fsdp --plan dp=8,framework=fsdp2,zero=3,micro_batch=2
    python -m shardlab plan evaluate ... --plans plans.csv       # one line per plan of the file
    python -m shardlab plan search --model llama3-405b --hardware "H100-80GB SXM" --nodes 2048 \\
        --global-batch 2048 --seq-len 8192 --top 5 --fix tp=8,pp=16 --no cp [--json]

Every prediction is for a software stack (--stack; stacks.yaml's default otherwise): what it can run
(sharding accounting, recompute granularities, TP overlap), how it overlaps its communication, and
its efficiencies on the hardware's generation, calibrated on its own published runs or borrowed from
another stack. The output states the stack's error band on held-out published runs and flags an MFU
above any published for that hardware generation and stack.

evaluate prints a plan's memory by category and its step by component, with tokens/s, MFU, HFU
(recomputed forward work counted) and TFLOP/s per GPU; it exits 1 with the reason (the field at
fault first) when the plan cannot run or does not fit. A malformed field, or a flag of the other
mode, exits 2 with one line naming it. search ranks the plans that fit and says why the others do
not; it exits 1 when none fits. --what-if scales catalog figures, e.g. `--what-if network_gbps=2 hbm_gb=1.5`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace

from shardlab import cli
from shardlab.costs import comparison, hardware, published, stacks
from shardlab.costs.plan import Cluster, Plan, Workload
from shardlab.costs.plan_fields import (TYPES, PlanFieldError, fields_help, parse_fields, parse_plan, parse_value,
                                        read_plans)
from shardlab.costs.predict import Prediction, evaluate
from shardlab.costs.rank_memory import MEMORY_CATEGORIES
from shardlab.costs.search import FIXABLE, TECHNIQUES, SearchResult, Space, search
from shardlab.costs.shapes import ModelShape, known_models, model_shape  # noqa: F401 (the CLI's names)
from shardlab.errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class Scenario:
    """One entry of the config's `planning.scenarios`: a model on a cluster at a batch."""

    name: str
    model: ModelShape
    cluster: Cluster
    workload: Workload
    space: Space
    description: str = ""
    stack: str = ""
    published: str = ""  # a row of costs/published.yaml to set beside the best plan ("" none)


def scenario(entry: dict, where: str) -> Scenario:
    """A config entry as a Scenario; a ConfigError naming the field for an unknown model or accelerator."""
    if entry["model"] not in known_models():
        raise ConfigError(f"{where}.model", f"unknown model {entry['model']!r} (known: {', '.join(known_models())})")
    for field, check in (("hardware", hardware.by_name), ("stack", stacks.get)):
        try:
            check(entry.get(field))
        except KeyError as err:
            raise ConfigError(f"{where}.{field}", err.args[0]) from None
    if entry.get("published") and entry["published"] not in {row.key for row in published.rows()}:
        raise ConfigError(f"{where}.published", f"no published row {entry['published']!r} in costs/published.yaml")
    cluster = Cluster(entry["hardware"], entry["nodes"], entry.get("gpus_per_node", 8), entry.get("host_memory_gb"))
    space = Space(**{k: tuple(v) for k, v in entry.get("space", {}).items()})
    return Scenario(entry["name"], model_shape(entry["model"]), cluster,
                    Workload(entry["global_batch"], entry["seq_len"], entry.get("dropout", 0.0)), space,
                    entry.get("description", ""), stacks.get(entry.get("stack")).name, entry.get("published", ""))


def scenarios(planning: dict) -> list[Scenario]:
    return [scenario(entry, f"planning.scenarios[{i}]") for i, entry in enumerate(planning.get("scenarios", []))]


def stack_name(name: str) -> str:
    try:
        return stacks.get(name).name
    except KeyError as err:
        raise ValueError(err.args[0]) from None


def accelerator(name: str) -> str:
    try:
        hardware.by_name(name)
    except KeyError as err:
        raise argparse.ArgumentTypeError(err.args[0]) from None
    return name


def what_if_overrides(name: str, what_if: list[tuple[str, float]], parser: cli.Parser) -> dict:
    """--what-if's scaled catalog figures of accelerator `name` (Cluster.overrides); exit 2 naming a figure
    the catalog does not have."""
    device = hardware.by_name(name)
    figures = [k for k, v in device.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    unknown = [k for k, _ in what_if if k not in figures]
    if unknown:
        parser.error(f"--what-if: {', '.join(unknown)}: not a catalog figure of {name} ({', '.join(figures)})")
    return {k: device[k] * factor for k, factor in what_if}


def values_of(name: str):
    """An argparse type reading comma-separated values of plan field `name`: '1,2' -> (1, 2)."""
    return cli.argument(lambda text: tuple(parse_value(name, v) for v in text.split(",")))


def stack_line(stack: str, cluster: Cluster) -> str:
    """The stack a prediction is for, where its efficiencies come from, and its error band."""
    generation = cluster.device["generation"]
    _, lender = stacks.efficiencies(stack, generation)
    band, basis = comparison.error_band(stack, generation)
    source = ("calibrated on its published runs" if lender == stack else
              f"efficiencies borrowed from {lender}" if lender else "the generation's prior efficiencies")
    return f"stack: {stack} on {generation} ({source}); expect within +/-{band:.0f} %: {basis}"


def render_prediction(p: Prediction) -> str:
    lines = [f"plan: {p.plan.label()}",
             f"memory per device (fullest rank): {p.device_bytes / GB:.1f} GB of {p.capacity_bytes / GB:.1f} GB usable"
             f" -> {p.why}"]
    lines += [f"  {k:14s} {p.memory[k] / GB:9.2f} GB" for k in MEMORY_CATEGORIES]
    lines.append(f"  {'host (offload)':14s} {p.memory['host_bytes'] / GB:9.2f} GB")
    if p.time:
        lines.append(f"step {p.step_s:.3f} s, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, HFU {p.hfu:.1%}, "
                     f"{p.tflops_per_gpu:.0f} TFLOP/s per GPU, bottleneck: {p.bottleneck}")
        lines += [f"  {k:14s} {v:9.4f} s" for k, v in p.time.items() if v]
    if p.flag:
        lines.append(f"implausible: {p.flag}")
    return "\n".join(lines)


def render_rates(p: Prediction) -> str:
    return (f"{p.tokens_per_s:12,.0f} tok/s  MFU {p.mfu:5.1%}  HFU {p.hfu:5.1%}  {p.tflops_per_gpu:5.0f} TFLOP/s  "
            f"{p.device_bytes / GB:6.1f} GB")


def render_search(r: SearchResult) -> str:
    lines = [f"{r.candidates:,} candidate plans in {r.seconds:.1f} s: {r.fitting:,} fit, "
             f"{r.candidates - r.fitting:,} rejected"]
    lines += [f"{i:3d}. {render_rates(p)}  {p.bottleneck:12s}  {p.plan.label()}{'  [implausible]' if p.flag else ''}"
              for i, p in enumerate(r.ranked, 1)]
    lines += [f"implausible: {p.flag}" for p in r.ranked[:1] if p.flag]
    lines.append("rejected:")
    lines += [f"  {n:9,d} {kind:14s} e.g. {r.examples[kind]}" for kind, n in r.rejected.most_common()]
    return "\n".join(lines)


def render_outcomes(outcomes: list[Prediction | str], plans: list[Plan]) -> str:
    """One line per plan of a --plans file: its rates and memory, or why it cannot run or fit."""
    lines = []
    for row, (plan, p) in enumerate(zip(plans, outcomes), 1):
        if isinstance(p, str):
            lines.append(f"{row:3d}. rejected: {p}  [{plan.label()}]")
        else:
            lines.append(f"{row:3d}. {render_rates(p)}  {'fits' if p.fits else 'does not fit'}  {p.plan.label()}")
    return "\n".join(lines)


def outcome_json(plan: Plan, p: Prediction | str) -> dict:
    return p.as_dict() if isinstance(p, Prediction) else {"plan": plan.as_dict(), "label": plan.label(), "rejected": p}


def search_json(r: SearchResult) -> dict:
    return {"candidates": r.candidates, "fitting": r.fitting, "seconds": r.seconds,
            "ranked": [p.as_dict() for p in r.ranked],
            "rejected": [{"reason": k, "plans": n, "example": r.examples[k]} for k, n in r.rejected.most_common()]}


SEARCH_FLAGS = ["--top", "--fix", "--no", "--cp", "--micro-batch", "--recompute", "--virtual-stages"]
EVALUATE_FLAGS = ["--plan", "--plans"]


def command_line() -> cli.Parser:
    out = cli.Parser(prog="shardlab plan", description=__doc__, epilog=fields_help())
    out.add_argument("mode", choices=["evaluate", "search"],
                     help="evaluate one plan (--plan) or a file of plans (--plans); search the plans of the cluster")
    out.add_argument("--model", required=True, type=cli.argument(model_shape),
                     help="a name of costs/models.yaml, or a Hugging Face config.json / YAML file of a shape")
    out.add_argument("--hardware", required=True, type=accelerator, help="accelerator name in costs/hardware.yaml")
    out.add_argument("--nodes", type=cli.count, required=True)
    out.add_argument("--gpus-per-node", type=cli.count, default=8)
    out.add_argument("--host-memory-gb", type=float, default=None, help="per node (default: unlimited)")
    out.add_argument("--global-batch", type=cli.count, required=True, help="sequences per optimizer step")
    out.add_argument("--seq-len", type=cli.count, required=True)
    out.add_argument("--dropout", type=float, default=0.0,
                     help="hidden dropout probability; above 0 every dropout keeps a mask (e.g. 0.1 as GPT-3 trained)")
    out.add_argument("--stack", type=cli.argument(stack_name), default=stacks.default(),
                     help=f"the software stack that runs the plan (default {stacks.default()}): "
                          + "; ".join(f"{s.name}: {s.description}" for s in stacks.stacks().values()))
    out.add_argument("--what-if", nargs="*", default=[], type=cli.what_if_item,
                     help="catalog figure=factor, e.g. network_gbps=2 hbm_gb=1.5")
    out.add_argument("--json", action="store_true")
    one = out.add_argument_group("evaluate only").add_mutually_exclusive_group()
    one.add_argument("--plan", default=None, type=cli.argument(parse_plan),
                     help="one plan's fields, e.g. dp=8,tp=2,sp=true,framework=mcore,zero=1 (the others at their defaults); "
                          "exit 1 if it cannot run or does not fit")
    one.add_argument("--plans", type=cli.existing_file,
                     help="a CSV (a header of field names) or YAML (a list of mappings) file of plans: one line each, "
                          "its prediction or why it cannot run; exit 0 once every row is evaluated")
    narrow = out.add_argument_group("search only")
    narrow.add_argument("--top", type=cli.count, default=10)
    narrow.add_argument("--fix", default={}, type=cli.argument(parse_fields),
                        help="plan fields every candidate keeps, e.g. tp=8,pp=16 or attention=eager (any field "
                             f"but the facts of a run: {', '.join(sorted(set(TYPES) - FIXABLE))})")
    narrow.add_argument("--no", action="append", default=[], choices=TECHNIQUES, metavar="TECHNIQUE",
                        help="leave a technique out (repeatable): "
                             + "; ".join(f"{k}: {v}" for k, v in TECHNIQUES.items()))
    for name in ("cp", "micro_batch", "recompute", "virtual_stages"):
        narrow.add_argument(f"--{name.replace('_', '-')}", type=values_of(name), metavar="V1,V2",
                            help=f"{name} values to try (default {','.join(map(str, getattr(Space(), name)))})")
    return out


def search_space(args) -> Space:
    """The default space with the command line's value lists, then its fixed fields, then the techniques
    left out."""
    lists = {name: getattr(args, name) for name in ("cp", "micro_batch", "recompute", "virtual_stages")}
    space = replace(Space(), **{k: v for k, v in lists.items() if v is not None}).fixing(args.fix)
    for technique in args.no:
        space = space.without(technique)
    return space


def run_search(args, model: ModelShape, cluster: Cluster, workload: Workload, parser: cli.Parser) -> int:
    try:
        space = search_space(args)
    except ValueError as err:
        parser.error(f"--fix: {err}")
    result = search(model, cluster, workload, top=args.top, space=space, stack=args.stack)
    if not result.candidates:
        print(f"no candidate plan satisfies the constraints on {cluster.gpus} GPUs: the degrees must multiply to "
              f"dp x tp x pp x cp = {cluster.gpus}, and --fix and --no must not contradict each other")
        return 1
    print(json.dumps(search_json(result), indent=1) if args.json else
          f"{stack_line(args.stack, cluster)}\n{render_search(result)}")
    return 0 if result.ranked else 1


def run_evaluate(args, model: ModelShape, cluster: Cluster, workload: Workload, parser: cli.Parser) -> int:
    if args.plans is None:
        return evaluate_one(args.plan or Plan(), model, cluster, workload, args.stack, args.json)
    try:
        plans = read_plans(args.plans)
    except PlanFieldError as err:
        parser.error(f"--plans {err}")
    outcomes = [evaluate(model, plan, cluster, workload, args.stack) for plan in plans]
    print(json.dumps([outcome_json(*pair) for pair in zip(plans, outcomes)], indent=1) if args.json
          else render_outcomes(outcomes, plans))
    return 0


def evaluate_one(plan: Plan, model: ModelShape, cluster: Cluster, workload: Workload, stack: str, as_json: bool) -> int:
    """Print the plan's prediction; 1 (and why) if it cannot run or does not fit, else 0."""
    result = evaluate(model, plan, cluster, workload, stack)
    if isinstance(result, str):
        print(json.dumps(outcome_json(plan, result)) if as_json else f"rejected: {result}")
        return 1
    print(json.dumps(result.as_dict(), indent=1) if as_json else
          f"{stack_line(stack, cluster)}\n{render_prediction(result)}")
    if not result.fits:
        print(f"does not fit: {result.why}", file=sys.stderr if as_json else sys.stdout)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = command_line()
    args = parser.parse_args(argv)
    parser.refuse(args, SEARCH_FLAGS if args.mode == "evaluate" else EVALUATE_FLAGS, f"plan {args.mode}")
    cluster = Cluster(args.hardware, args.nodes, args.gpus_per_node, args.host_memory_gb,
                      what_if_overrides(args.hardware, args.what_if, parser))
    run = run_evaluate if args.mode == "evaluate" else run_search
    return run(args, args.model, cluster, Workload(args.global_batch, args.seq_len, args.dropout), parser)
