"""Composed plans: one run laid out by a Plan's degrees on one named device mesh (pp, dp, cp, tp),
tensor parallelism innermost as in Megatron, reusing the hand-written techniques: TP (+SP) inside each
`tp` group, ring attention over `cp`, pipeline stages and schedules over `pp`, and the data-parallel
replicas over `dp` (or FSDP2 shards over `dp` x `cp`, the ranks that hold the same parameters).

strategy_options.composed (every degree defaults to 1; dp is what the others leave of the world size):
  world_size: int
  tp: int, sp: bool                       tensor parallelism, with or without sequence parallelism
  cp: int                                 context parallelism (zig-zag shards, ring attention)
  pp: int, schedule: gpipe|1f1b|interleaved, virtual_stages: int, n_microbatches: int
  dp_shard: replicas|fsdp2_full|fsdp2_grad_op   how dp (x cp) ranks hold the model (FSDP2: not with pp > 1)
"""

from __future__ import annotations

import functools
from dataclasses import replace

from shardlab.errors import ConfigError
from shardlab.strategies.context_parallel.options import check_cp_sequence
from shardlab.strategies.pipeline_parallel.options import DEFAULT_MICROBATCHES
from shardlab.strategies.spec import Family, StrategySpec, all_of, only_options
from shardlab.strategies.tensor_parallel.options import check_tp_options

DEGREES = ("tp", "cp", "pp")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
# dp_shard -> the Plan's ZeRO fields (FSDP2's two resharding choices, as the ZeRO ladder's fsdp2 rungs)
DP_SHARDING = {"replicas": {}, "fsdp2_full": {"framework": "fsdp2", "zero": 3},
               "fsdp2_grad_op": {"framework": "fsdp2", "zero": 2}}


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
    if cp > 1:
        fields["attention"] = "ring"
    if pp > 1:
        fields.update(schedule=options.get("schedule", "1f1b"), virtual_stages=virtual_stages(options),
                      micro_batches=options.get("n_microbatches", DEFAULT_MICROBATCHES))
    return fields


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_choices(spec: StrategySpec, exp: dict, where: str, world: int | str) -> None:
    """Each option's type and value, named by its field."""
    options = spec.options(exp)
    field = lambda key: spec.option_field(where, key)  # noqa: E731
    for key in (*DEGREES, "virtual_stages", "n_microbatches"):
        if not _positive(options.get(key, 1)):
            raise ConfigError(field(key), f"must be a positive integer, got {options[key]!r}")
    if not isinstance(options.get("sp", False), bool):
        raise ConfigError(field("sp"), f"must be true or false, got {options['sp']!r}")
    if options.get("sp") and options.get("tp", 1) == 1:
        raise ConfigError(field("sp"), "sequence parallelism needs tp > 1")
    if options.get("schedule", "1f1b") not in SCHEDULES:
        raise ConfigError(field("schedule"), f"must be one of {', '.join(SCHEDULES)}, got {options['schedule']!r}")
    if options.get("dp_shard", "replicas") not in DP_SHARDING:
        raise ConfigError(field("dp_shard"), f"must be one of {', '.join(DP_SHARDING)}, got {options['dp_shard']!r}")
    if options.get("dp_shard", "replicas") != "replicas" and options.get("pp", 1) > 1:
        raise ConfigError(field("dp_shard"), "FSDP2 sharding is not composed with pipeline stages yet (use replicas)")
    if options.get("pp", 1) == 1:
        for key in ("schedule", "virtual_stages", "n_microbatches"):
            if key in options:
                raise ConfigError(field(key), "is a pipeline setting: it needs pp > 1")
    elif exp["training"].get("micro_batch_size"):
        raise ConfigError(f"{where}.training.micro_batch_size",
                          "a pipeline cuts micro-batches itself: set strategy_options.composed.n_microbatches instead")


def check_degrees(spec: StrategySpec, exp: dict, where: str, world: int | str) -> None:
    """The degrees multiply to the world size and each splits what it splits: TP the heads, MLP and
    vocabulary (SP also the sequence), CP the sequence in 2·cp zig-zag chunks, PP x v the layers (and the
    per-replica batch into micro-batches)."""
    options = spec.options(exp)
    field = lambda key: spec.option_field(where, key)  # noqa: E731
    tp, cp, pp = degrees(options).values()
    if world != "auto":
        product = 1
        for dim, size in degrees(options).items():
            product *= size
            if int(world) % product:
                raise ConfigError(field(dim), f"tp x cp x pp = {tp * cp * pp} does not divide the world size {world}: "
                                              f"dp x tp x cp x pp must be the world size")
        check_tp_options(spec, exp, where, tp)
    seq_len = exp["training"]["seq_len"]
    if cp > 1:
        check_cp_sequence(seq_len, cp, f"{where}.training.seq_len")
    if options.get("sp") and (seq_len // cp) % tp:
        raise ConfigError(f"{where}.training.seq_len", f"each context-parallel shard ({seq_len // cp} tokens) must "
                                                       f"split over the sequence-parallel degree {tp}")
    if pp > 1:
        _check_pipeline(spec, exp, where, world)


def _check_pipeline(spec: StrategySpec, exp: dict, where: str, world: int | str) -> None:
    options = spec.options(exp)
    field = lambda key: spec.option_field(where, key)  # noqa: E731
    pp, v, m = options["pp"], virtual_stages(options), options.get("n_microbatches", DEFAULT_MICROBATCHES)
    layers = exp["model"].get("num_layers")
    if layers is not None and layers % (pp * v):
        raise ConfigError(field("virtual_stages" if v > 1 else "pp"),
                          f"pp x v = {pp * v} stages do not divide the {layers} layers evenly")
    if options.get("schedule", "1f1b") != "gpipe" and m < pp * v:
        raise ConfigError(field("n_microbatches"), f"1F1B needs at least as many micro-batches as stages "
                                                   f"({pp * v}), got {m}")
    if options.get("schedule") == "interleaved" and m % pp:
        raise ConfigError(field("n_microbatches"), f"interleaved 1F1B needs n_microbatches divisible by pp = {pp}")
    if world != "auto":
        local = exp["training"]["global_batch_size"] // max(1, int(world) // (pp * options.get("tp", 1)
                                                                              * options.get("cp", 1)))
        if local % m:
            raise ConfigError(field("n_microbatches"), f"{m} does not divide the per-replica batch {local}")


COMPOSED = StrategySpec(
    "composed", "shardlab.strategies.composed.strategy:composed_strategy", Family.HYBRID, "composed",
    "A Plan's degrees on one (pp, dp, cp, tp) mesh: hand-written TP (+SP), ring attention, pipeline schedules and "
    "data-parallel replicas or FSDP2 shards, composed.",
    plan=composed_plan, check_options=all_of(only_options("tp", "sp", "cp", "pp", "schedule", "virtual_stages",
                                                          "n_microbatches", "dp_shard"), check_choices, check_degrees))
SPECS = [COMPOSED]
# More composed plans in one experiment: `composed_<plan>` names the same strategy with its own options.
VARIANT_PREFIX = "composed_"


@functools.cache
def variant(name: str) -> StrategySpec:
    return replace(COMPOSED, name=name)
