"""Composed plans: one run laid out by a Plan's degrees on one named device mesh (pp, dp, cp, tp),
tensor parallelism innermost as in Megatron, reusing the hand-written techniques: TP (+SP) inside each
`tp` group, ring attention over `cp`, pipeline stages and schedules over `pp`, and the data-parallel
replicas over `dp` (or FSDP2 shards over `dp` x `cp`, the ranks that hold the same parameters).

strategy_options.composed (every degree defaults to 1; dp is what the others leave of the world size):
  world_size: int
  tp: int, sp: bool                       tensor parallelism, with or without sequence parallelism
  cp: int                                 context parallelism (zig-zag shards, ring attention)
  pp: int, schedule: gpipe|1f1b|interleaved, virtual_stages: int, n_microbatches: int
  dp_shard: replicas|zero1|fsdp2_full|fsdp2_grad_op   how dp (x cp) ranks hold the model: whole, with the
                                          optimizer state sharded (a distributed optimizer), or FSDP2 shards
  recompute: none|selective|full          this run's activation recomputation (default: training.recompute)

`composed_moe` (and `composed_moe_<plan>`) runs the experiment's model with mixture-of-experts MLPs
(`expert_parallel.moe`, the settings of `moe_single`, its reference) under the same options, plus
  ep: int                                 experts sharded over ep ranks carved from dp (dp = edp x ep), their
                                          matrices split over tp (Megatron's expert tensor parallelism);
                                          dp as replicas, no cp (not composed with experts yet)
"""

from __future__ import annotations

import functools
from dataclasses import replace

from shardlab.errors import ConfigError
from shardlab.strategies.expert_parallel import moe_model
from shardlab.strategies.expert_parallel.options import MOE_DEFAULTS, check_moe_settings
from shardlab.strategies.pipeline_parallel.options import DEFAULT_MICROBATCHES
from shardlab.strategies.spec import Family, StrategySpec, all_of, only_options

DEGREES = ("tp", "cp", "pp")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
# dp_shard -> the Plan's ZeRO fields (the hand-written distributed optimizer as plain PyTorch's stage 1;
# FSDP2's two resharding choices, as the ZeRO ladder's fsdp2 rungs)
DP_SHARDING = {"replicas": {}, "zero1": {"framework": "torch", "zero": 1},
               "fsdp2_full": {"framework": "fsdp2", "zero": 3}, "fsdp2_grad_op": {"framework": "fsdp2", "zero": 2}}
# The option behind each Plan field a rejection may name (the world size: `StrategySpec.config_field`).
PLAN_OPTIONS = (("tp", "tp"), ("sp", "sp"), ("cp", "cp"), ("pp", "pp"), ("schedule", "schedule"),
                ("virtual_stages", "virtual_stages"), ("micro_batch", "n_microbatches"), ("zero", "dp_shard"),
                ("framework", "dp_shard"), ("recompute", "recompute"))


def degrees(options: dict) -> dict[str, int]:
    return {dim: options.get(dim, 1) for dim in DEGREES}


def virtual_stages(options: dict) -> int:
    default = 2 if options.get("schedule") == "interleaved" else 1
    return options.get("virtual_stages", default)


def composed_plan(world: int, options: dict) -> dict:
    """The Plan fields of a composed run: its degrees (dp from the world size), schedule, attention and
    data-parallel sharding. TP gathers the logits for a plain cross-entropy."""
    tp, cp, pp = degrees(options).values()
    fields = {"dp": max(1, world // (tp * cp * pp)), "tp": tp, "sp": bool(options.get("sp", False)), "cp": cp,
              "pp": pp, "vocab_parallel_loss": False, **DP_SHARDING[options.get("dp_shard", "replicas")]}
    # FSDP2 reduce-scatters as the backward goes; replicas are averaged after it (ComposedStrategy.sync_gradients).
    fields["grad_sync_overlap"] = fields.get("framework") == "fsdp2"
    if "recompute" in options:
        fields["recompute"] = options["recompute"]  # one run of an experiment recomputing (plans compared)
    if cp > 1:
        fields["attention"] = "ring"
    if pp > 1:
        fields.update(schedule=options.get("schedule", "1f1b"), virtual_stages=virtual_stages(options),
                      micro_batches=options.get("n_microbatches", DEFAULT_MICROBATCHES))
    return fields


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_choices(spec: StrategySpec, exp: dict, where: str, world: int | str) -> None:
    """Each option's type and value, named by its field; pipeline settings need a pipeline (else the
    Plan would drop them). What the degrees must split is the Plan's question (`costs.plan.rejection`)."""
    options = spec.options(exp)
    field = lambda key: spec.option_field(where, key)  # noqa: E731
    for key in (*DEGREES, "virtual_stages", "n_microbatches"):
        if not _positive(options.get(key, 1)):
            raise ConfigError(field(key), f"must be a positive integer, got {options[key]!r}")
    if not isinstance(options.get("sp", False), bool):
        raise ConfigError(field("sp"), f"must be true or false, got {options['sp']!r}")
    if options.get("schedule", "1f1b") not in SCHEDULES:
        raise ConfigError(field("schedule"), f"must be one of {', '.join(SCHEDULES)}, got {options['schedule']!r}")
    if options.get("dp_shard", "replicas") not in DP_SHARDING:
        raise ConfigError(field("dp_shard"), f"must be one of {', '.join(DP_SHARDING)}, got {options['dp_shard']!r}")
    if options.get("pp", 1) == 1:
        for key in ("schedule", "virtual_stages", "n_microbatches"):
            if key in options:
                raise ConfigError(field(key), "is a pipeline setting: it needs pp > 1")
    elif exp["training"].get("micro_batch_size"):
        raise ConfigError(f"{where}.training.micro_batch_size",
                          "a pipeline cuts micro-batches itself: set strategy_options.composed.n_microbatches instead")


def composed_moe_plan(world: int, options: dict) -> dict:
    """A composed plan whose experts are sharded over `ep` ranks carved from dp."""
    return {**composed_plan(world, options), "ep": options.get("ep", 1)}


def check_expert_composition(spec: StrategySpec, exp: dict, where: str, world: int | str) -> None:
    """What experts do not compose with yet, named by its field, and ep's type."""
    options = spec.options(exp)
    if not _positive(options.get("ep", 1)):
        raise ConfigError(spec.option_field(where, "ep"), f"must be a positive integer, got {options['ep']!r}")
    if options.get("cp", 1) > 1:
        raise ConfigError(spec.option_field(where, "cp"), "context parallelism is not composed with experts yet")
    if options.get("dp_shard", "replicas") != "replicas":
        raise ConfigError(spec.option_field(where, "dp_shard"),
                          "experts are replicated over edp = dp / ep ranks, dense weights over dp: only replicas")


OPTIONS = ("tp", "sp", "cp", "pp", "schedule", "virtual_stages", "n_microbatches", "dp_shard", "recompute")
COMPOSED = StrategySpec(
    "composed", "shardlab.strategies.composed.strategy:composed_strategy", Family.HYBRID, "composed",
    "A Plan's degrees on one (pp, dp, cp, tp) mesh: hand-written TP (+SP), ring attention, pipeline schedules and "
    "data-parallel replicas, a distributed optimizer (ZeRO-1) or FSDP2 shards, composed.",
    plan=composed_plan, plan_options=PLAN_OPTIONS, check_options=all_of(only_options(*OPTIONS), check_choices))
COMPOSED_MOE = replace(
    COMPOSED, name="composed_moe",
    summary="A composed plan of the mixture-of-experts model: experts over ep ranks carved from dp (their matrices "
            "over tp), composed with TP (+SP), pipeline stages and data-parallel replicas.",
    plan=composed_moe_plan, model=moe_model, reference="moe_single", plan_options=(*PLAN_OPTIONS, ("ep", "ep")),
    check_options=all_of(only_options(*OPTIONS, "ep", *MOE_DEFAULTS), check_choices, check_expert_composition,
                         check_moe_settings))
SPECS = [COMPOSED, COMPOSED_MOE]
# More composed plans in one experiment: `composed_<plan>` names the same strategy with its own options,
# `composed_moe_<plan>` the mixture-of-experts one.
VARIANT_PREFIX = "composed_"
MOE_VARIANT_PREFIX = "composed_moe_"


@functools.cache
def variant(name: str) -> StrategySpec:
    return replace(COMPOSED_MOE if name.startswith(MOE_VARIANT_PREFIX) else COMPOSED, name=name)
