"""From plan to run: the plans a search ranked, turned into an experiment block whose composed runs execute
them, so that the ranking the planner predicted can be held against the one the runs measure.

The search covers everything this project's stack runs (costs/stacks.yaml, `shardlab`: plain replicas,
the distributed optimizer, DeepSpeed's rungs, FSDP2; TP (+SP), CP, PP with every schedule; recompute
none, selective or full). A searched Plan runs when the composed strategy can lay it out: replicas,
ZeRO-1 or FSDP2 over dp, with any degrees, schedule and recompute. What it cannot, `not_composable` says
and the search counts (`Found.left_out`): DeepSpeed's rungs and its offload (its engine owns the step:
they run as the zero* strategies, alone over dp), expert parallelism (ep runs as ep_moe only), and a plan
without pipeline stages that accumulates gradients (the experiment's micro-batch size is shared by its
runs, so such a plan takes its whole per-replica batch at once). Whether a plan runs is decided by the
composed strategy's own config checks. Torch-free: the study expands `plan_search` when it loads the
config.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field, replace

from shardlab import cli
from shardlab.config import resolve_experiment
from shardlab.costs.plan import Cluster, Plan, Workload
from shardlab.costs.planner import accelerator
from shardlab.costs.predict import evaluate
from shardlab.costs.search import SHARDINGS, Space, divisors, search
from shardlab.costs.shapes import ModelShape
from shardlab.errors import ConfigError
from shardlab.strategies.composed import variant
from shardlab.strategies.composed.runs import DP_SHARD, composed_options, run_name

SEARCHED = 1000  # ranked plans looked through for the top-k that run
STACK = "shardlab"  # this project's runner executes the plans
# The planner's shardings plus the composed distributed optimizer (plain PyTorch's stage 1), which only
# this stack runs (other stacks' distributed optimizers are Megatron's: `megatron`/`mcore` at stage 1).
SEARCHED_SHARDINGS = (*SHARDINGS, ("torch", 1, "none"))


def not_composable(plan: Plan, exp: dict) -> str | None:
    """Why a composed run cannot execute `plan` in `exp` (a reason the search counts), or None."""
    if plan.ep > 1:
        return "expert parallelism: the search exports dense plans (composed_moe runs a MoE model's by hand)"
    if plan.offload != "none":
        return "offload runs as DeepSpeed's zero*_offload strategies only, not composed"
    if (plan.framework, plan.zero) not in DP_SHARD:
        return f"{plan.framework} ZeRO-{plan.zero} runs as its own strategy only (its engine owns the step), not composed"
    if plan.pp == 1 and plan.micro_batch != exp["training"]["global_batch_size"] // plan.dp:
        return "gradient accumulation without pipeline stages (an experiment's runs share their micro-batch size)"
    name = run_name(plan)
    trial = copy.deepcopy(exp) | {"strategy_options": {name: composed_options(plan, exp["training"]["global_batch_size"])}}
    try:
        variant(name).check(trial, f"experiments.{exp['name']}")
    except ConfigError as err:
        return f"the composed strategy's check: {err}"
    return None


def runnable(plan: Plan, exp: dict) -> dict | None:
    """The composed options that run `plan` in `exp`, or None where the composed strategy cannot."""
    return None if not_composable(plan, exp) else composed_options(plan, exp["training"]["global_batch_size"])


def layout(plan: Plan) -> tuple:
    """Where a plan puts the ranks and the layers (its degrees and schedule), whatever dp's sharding."""
    return plan.dp, plan.tp, plan.sp, plan.cp, plan.pp, plan.schedule, plan.virtual_stages


@dataclass
class Found:
    """What a search for composed runs found: {run name: {label, tokens_per_s, options}} fastest first, the
    cluster searched, and the plans ranked ahead of the last one kept that no composed run executes, by
    reason (`not_composable`)."""

    plans: dict[str, dict]
    cluster: str
    left_out: Counter = field(default_factory=Counter)


def search_runnable(exp: dict, world: int, top: int, per_layout: bool = True, cluster: Cluster | None = None,
                    recompute: tuple[str, ...] = ()) -> Found:
    """The `top` fastest plans the search finds for `exp`'s model and batch on `world` ranks that a composed
    run can execute (with `per_layout`, the fastest of each layout only), then the fastest plan again under
    each mode of `recompute`, so that the ranking also prices what recomputation costs."""
    training = exp["training"]
    cluster = cluster or Cluster("CPU (calibrated)", 1, world)
    workload = Workload(training["global_batch_size"], training["seq_len"])
    space = Space(cp=tuple(c for c in (1, 2, 4, 8) if c <= world), micro_batch=tuple(divisors(training["global_batch_size"])),
                  virtual_stages=(2,), shardings=SEARCHED_SHARDINGS, dtype=training["dtype"])
    model = ModelShape.from_dict(exp["model"])
    ranked = search(model, cluster, workload, top=SEARCHED, space=space, stack=STACK).ranked
    found = Found({}, f"{cluster.accelerator} x {cluster.gpus} (catalog figures)")
    layouts, kept = set(), []
    for p in ranked:
        if len(found.plans) == top:
            break
        if per_layout and layout(p.plan) in layouts:
            continue
        why = not_composable(p.plan, exp)
        if why:
            found.left_out[why] += 1
        elif run_name(p.plan) not in found.plans:
            found.plans[run_name(p.plan)] = entry(p, exp)
            layouts.add(layout(p.plan))
            kept.append(p.plan)
    for mode in recompute if kept else ():
        p = evaluate(model, replace(kept[0], recompute=mode), cluster, workload, STACK)
        if not isinstance(p, str) and not not_composable(p.plan, exp):
            found.plans[run_name(p.plan)] = entry(p, exp)
    return found


def entry(p, exp: dict) -> dict:
    return {"label": p.plan.label(), "tokens_per_s": p.tokens_per_s,
            "options": composed_options(p.plan, exp["training"]["global_batch_size"])}


def experiment_block(found: dict, description: str) -> dict:
    """An experiment (as the config writes one) that runs the found plans beside the single-device reference."""
    return {"description": description, "strategies": ["single", *found],
            "strategy_options": {name: f["options"] for name, f in found.items()}}


def plan_search(config: dict, schema: dict) -> tuple[dict, dict]:
    """The plan-to-run loop of a config (`plan_search`): its experiment (name -> the block the config would
    write: the searched plans the composed strategy can run, for the defaults' model and batch), and what the
    search found ({experiment, plans: {run name: {search_rank, label, tokens_per_s}}, cluster_label}, for the
    tables).
    Nothing without the block."""
    block = config.get("plan_search")
    if not block:
        return {}, {}
    name = block["experiment"]
    if name in config["experiments"]:
        raise ConfigError("plan_search.experiment", f"{name!r} is already an experiment: the search adds its own")
    base = resolve_experiment({**config, "experiments": {name: {"strategies": ["single"]}}}, name, schema)
    found = search_runnable(base, block["world_size"], block["top"], block["per_layout"],
                            recompute=tuple(block["recompute"]))
    if not found.plans:
        raise ConfigError("plan_search.world_size", f"no plan on {block['world_size']} ranks that a composed run executes")
    experiment = experiment_block(found.plans, f"From plan to run: the {len(found.plans)} fastest plans the planner "
                                               f"found on {found.cluster}, run as composed plans.")
    return {name: experiment}, {"experiment": name, "cluster_label": found.cluster,
                                "plans": {n: {"search_rank": i, "label": f["label"], "tokens_per_s": f["tokens_per_s"]}
                                          for i, (n, f) in enumerate(found.plans.items(), start=1)}}


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab plan-export`: the plan-to-run loop by hand, for any experiment of a config and
    any catalog cluster; or, with --rehearse, the best plan of a planning scenario scaled down to a toy
    rehearsal of at most 16 ranks (`rehearsal`). Writes the experiment block (YAML) to paste under the
    config's `experiments:`."""
    import sys

    import yaml

    from shardlab.config import load_schema, validate_against_schema

    parser = cli.Parser(prog="shardlab plan-export", description=main.__doc__)
    parser.add_argument("--config", required=True, type=cli.existing_file, help="a study config (its experiment gives model and batch)")
    parser.add_argument("--rehearse", metavar="SCENARIO",
                        help="a planning scenario (name, or its model's): rehearse its best plan instead of searching")
    parser.add_argument("--experiment", help="the experiment whose model and training to plan for")
    parser.add_argument("--world-size", type=cli.count)
    parser.add_argument("--top", type=cli.count, default=4)
    parser.add_argument("--all-layouts", action="store_true", help="keep several plans of one layout")
    parser.add_argument("--recompute", nargs="*", default=[], choices=("selective", "full"),
                        help="also run the fastest plan under these recompute modes")
    parser.add_argument("--hardware", default="CPU (calibrated)", type=accelerator, help="accelerator name in costs/hardware.yaml")
    parser.add_argument("--gpus-per-node", type=cli.count, default=None, help="default: the world size (one node)")
    parser.add_argument("--name", default=None, help="name of the experiment written (plan_search, rehearsal)")
    parser.add_argument("--out", default="-", help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    config, schema = yaml.safe_load(args.config.read_text()), load_schema()
    write = lambda name, block: write_block({args.name or name: block}, args.out)  # noqa: E731
    if args.rehearse:
        return rehearse_scenario(config, args.rehearse, write)
    if not (args.experiment and args.world_size):
        parser.error("--experiment and --world-size are required unless --rehearse is given")
    per_node = args.gpus_per_node or args.world_size
    if args.world_size % per_node:
        parser.error(f"--world-size: {args.world_size} devices are not whole nodes of --gpus-per-node {per_node}")
    try:
        validate_against_schema(config, schema)
        exp = resolve_experiment(config, args.experiment, schema)
        cluster = Cluster(args.hardware, args.world_size // per_node, per_node)
        found = search_runnable(exp, args.world_size, args.top, not args.all_layouts, cluster, tuple(args.recompute))
    except ConfigError as err:
        print(f"invalid: {err}", file=sys.stderr)
        return 2
    for why, count in found.left_out.most_common():
        print(f"left out {count} faster plan(s): {why}", file=sys.stderr)
    block = experiment_block(found.plans, f"The {len(found.plans)} fastest plans the planner found on {found.cluster}, "
                                          f"as composed runs.")
    block["model"], block["training"] = exp["model"], exp["training"]
    write("plan_search", block)
    return 0


def rehearse_scenario(config: dict, name: str, write) -> int:
    """The rehearsal block of planning scenario `name`'s best plan, written by `write(name, block)`; a plan no
    composed run rehearses (or an unknown scenario) is reported with its reason (exit 2)."""
    import sys

    from shardlab.strategies.composed.rehearsal import rehearse, scenario_plan

    try:
        plan, source = scenario_plan(config, name)
        write("rehearsal", rehearse(plan, source, config))
    except (ValueError, ConfigError) as err:  # NotRehearsable is a ValueError
        print(f"cannot rehearse: {err}", file=sys.stderr)
        return 2
    return 0


def write_block(experiments: dict, out: str) -> None:
    import yaml

    text = yaml.safe_dump(experiments, sort_keys=False)
    print(text, end="") if out == "-" else open(out, "w").write(text)
