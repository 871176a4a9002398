"""From plan to run: the plans a search ranked, turned into an experiment block whose composed runs execute
them, so that the ranking the planner predicted can be held against the one the runs measure.

A searched Plan runs here when the composed strategy can lay it out: replicas or FSDP2 over dp, TP
(+SP), CP, PP with any schedule, no offload, no recompute, dense models (no ep); a plan without
pipeline stages takes its whole per-replica batch in one micro-batch (the experiment's micro-batch
size is shared by its runs). Whether it runs is decided by the composed strategy's own config checks.
Torch-free: the study expands `plan_search` when it loads the config.
"""

from __future__ import annotations

import copy

from shardlab import cli
from shardlab.config import resolve_experiment
from shardlab.costs.plan import Cluster, Plan, Workload
from shardlab.costs.planner import accelerator
from shardlab.costs.search import Space, divisors, search
from shardlab.costs.shapes import ModelShape
from shardlab.errors import ConfigError
from shardlab.strategies.composed import VARIANT_PREFIX, variant

RUNNABLE_SHARDINGS = (("torch", 0, "none"), ("fsdp2", 3, "none"), ("fsdp2", 2, "none"))
FSDP2_SHARD = {3: "fsdp2_full", 2: "fsdp2_grad_op"}
SEARCHED = 1000  # ranked plans looked through for the top-k that run


def composed_options(plan: Plan, global_batch: int) -> dict:
    """The `strategy_options` of a composed run that executes `plan`."""
    options: dict = {"world_size": plan.world}
    if plan.tp > 1:
        options.update(tp=plan.tp, **({"sp": True} if plan.sp else {}))
    if plan.cp > 1:
        options["cp"] = plan.cp
    if plan.pp > 1:
        options.update(pp=plan.pp, schedule=plan.schedule, n_microbatches=global_batch // plan.dp // plan.micro_batch)
        if plan.schedule == "interleaved":
            options["virtual_stages"] = plan.virtual_stages
    if plan.framework == "fsdp2":
        options["dp_shard"] = FSDP2_SHARD[plan.zero]
    return options


def run_name(plan: Plan) -> str:
    """A strategy name for the run of `plan`, e.g. composed_dp2_tp2sp or composed_pp2_1f1b_m4_cp2."""
    parts = [f"dp{plan.dp}"] if plan.dp > 1 else []
    parts += [f"tp{plan.tp}{'sp' if plan.sp else ''}"] if plan.tp > 1 else []
    parts += [f"cp{plan.cp}"] if plan.cp > 1 else []
    if plan.pp > 1:
        v = f"v{plan.virtual_stages}" if plan.schedule == "interleaved" else ""
        parts.append(f"pp{plan.pp}_{plan.schedule}{v}_mb{plan.micro_batch}")
    if plan.framework == "fsdp2":
        parts.append(FSDP2_SHARD[plan.zero])
    return VARIANT_PREFIX + "_".join(parts or ["dp1"])


def runnable(plan: Plan, exp: dict) -> dict | None:
    """The composed options that run `plan` in `exp`, or None where the composed strategy cannot."""
    training = exp["training"]
    if plan.ep > 1 or plan.offload != "none" or plan.recompute != "none" or plan.framework not in ("torch", "fsdp2"):
        return None
    if plan.pp == 1 and plan.micro_batch != training["global_batch_size"] // plan.dp:
        return None
    options = composed_options(plan, training["global_batch_size"])
    name = run_name(plan)
    trial = copy.deepcopy(exp) | {"strategy_options": {name: options}}
    try:
        variant(name).check(trial, f"experiments.{exp['name']}")
    except ConfigError:
        return None
    return options


def layout(plan: Plan) -> tuple:
    """Where a plan puts the ranks and the layers (its degrees and schedule), whatever dp's sharding."""
    return plan.dp, plan.tp, plan.sp, plan.cp, plan.pp, plan.schedule, plan.virtual_stages


def search_runnable(exp: dict, world: int, top: int, per_layout: bool = True,
                    cluster: Cluster | None = None) -> tuple[dict, str]:
    """The `top` fastest plans the search finds for `exp`'s model and batch on `world` ranks that a composed
    run can execute (with `per_layout`, the fastest of each layout only): {run name: {plan label, predicted
    tokens/s, options}}, and the cluster searched."""
    training = exp["training"]
    cluster = cluster or Cluster("CPU (calibrated)", 1, world)
    space = Space(cp=tuple(c for c in (1, 2, 4, 8) if c <= world), micro_batch=tuple(divisors(training["global_batch_size"])),
                  recompute=("none",), virtual_stages=(2,), shardings=RUNNABLE_SHARDINGS, dtype=training["dtype"])
    model = ModelShape.from_dict(exp["model"])
    ranked = search(model, cluster, Workload(training["global_batch_size"], training["seq_len"]), top=SEARCHED,
                    space=space, stack="shardlab").ranked  # this project's runner executes them
    found: dict[str, dict] = {}
    layouts = set()
    for p in ranked:
        if per_layout and layout(p.plan) in layouts:
            continue
        options = runnable(p.plan, exp)
        if options is not None and run_name(p.plan) not in found:
            found[run_name(p.plan)] = {"label": p.plan.label(), "tokens_per_s": p.tokens_per_s, "options": options}
            layouts.add(layout(p.plan))
        if len(found) == top:
            break
    return found, f"{cluster.accelerator} x {cluster.gpus} (catalog figures)"


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
    found, cluster = search_runnable(base, block["world_size"], block["top"], block["per_layout"])
    if not found:
        raise ConfigError("plan_search.world_size", f"no plan on {block['world_size']} ranks that a composed run executes")
    experiment = experiment_block(
        found, f"From plan to run: the {len(found)} fastest plans the planner found on {cluster}, run as composed plans.")
    return {name: experiment}, {"experiment": name, "cluster_label": cluster,
                                "plans": {n: {"search_rank": i, "label": f["label"], "tokens_per_s": f["tokens_per_s"]}
                                          for i, (n, f) in enumerate(found.items(), start=1)}}


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab plan-export`: the plan-to-run loop by hand, for any experiment of a config and
    any catalog cluster; writes the experiment block (YAML) to paste under the config's `experiments:`."""
    import sys

    import yaml

    from shardlab.config import load_schema, validate_against_schema

    parser = cli.Parser(prog="shardlab plan-export", description=main.__doc__)
    parser.add_argument("--config", required=True, type=cli.existing_file, help="a study config (its experiment gives model and batch)")
    parser.add_argument("--experiment", required=True, help="the experiment whose model and training to plan for")
    parser.add_argument("--world-size", type=cli.count, required=True)
    parser.add_argument("--top", type=cli.count, default=4)
    parser.add_argument("--all-layouts", action="store_true", help="keep several plans of one layout")
    parser.add_argument("--hardware", default="CPU (calibrated)", type=accelerator, help="accelerator name in costs/hardware.yaml")
    parser.add_argument("--gpus-per-node", type=cli.count, default=None, help="default: the world size (one node)")
    parser.add_argument("--name", default="plan_search", help="name of the experiment written")
    parser.add_argument("--out", default="-", help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    config, schema = yaml.safe_load(args.config.read_text()), load_schema()
    per_node = args.gpus_per_node or args.world_size
    if args.world_size % per_node:
        parser.error(f"--world-size: {args.world_size} devices are not whole nodes of --gpus-per-node {per_node}")
    try:
        validate_against_schema(config, schema)
        exp = resolve_experiment(config, args.experiment, schema)
        cluster = Cluster(args.hardware, args.world_size // per_node, per_node)
        found, where = search_runnable(exp, args.world_size, args.top, not args.all_layouts, cluster)
    except ConfigError as err:
        print(f"invalid: {err}", file=sys.stderr)
        return 2
    block = experiment_block(found, f"The {len(found)} fastest plans the planner found on {where}, as composed runs.")
    block["model"], block["training"] = exp["model"], exp["training"]
    text = yaml.safe_dump({args.name: block}, sort_keys=False)
    print(text, end="") if args.out == "-" else open(args.out, "w").write(text)
    return 0
