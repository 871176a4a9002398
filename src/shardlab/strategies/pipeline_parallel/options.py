"""Option names and types of the pipeline strategies (torch-free: the registry and the Snakefile import
it). Whether a run can run (stage cut, micro-batches per schedule) is its Plan's question
(`costs.plan.rejection`, asked by `StrategySpec.check`).

strategy_options:
  pp_gpipe | pp_1f1b | pp_interleaved: {n_microbatches: int}
  hybrid_dp_pp: {world_size: int, pp_size: int (default 2), n_microbatches: int}
"""

from __future__ import annotations

from shardlab.errors import ConfigError

DEFAULT_MICROBATCHES = 4
DEFAULT_HYBRID_PP = 2
KNOWN = {"n_microbatches", "pp_size", "world_size"}


def pipeline_size(world: int, options: dict, hybrid: bool) -> int:
    return int(options.get("pp_size", DEFAULT_HYBRID_PP)) if hybrid else world


def _count(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def checker(hybrid: bool = False):
    """check_options(spec, exp, where, world) for one pipeline strategy; raises ConfigError naming the field."""

    def check(spec, exp: dict, where: str, world: int | str) -> None:
        options = spec.options(exp)
        for key in options:
            if key not in KNOWN or (key == "pp_size" and not hybrid):
                raise ConfigError(spec.option_field(where, key), "unknown pipeline option")
        m = options.get("n_microbatches", DEFAULT_MICROBATCHES)
        if not _count(m, 1):
            raise ConfigError(spec.option_field(where, "n_microbatches"), f"must be a positive integer, got {m!r}")
        pp = options.get("pp_size", DEFAULT_HYBRID_PP)
        if hybrid and not _count(pp, 2):  # a hybrid of one stage would be plain data parallelism
            raise ConfigError(spec.option_field(where, "pp_size"), f"must be an integer of at least 2, got {pp!r}")
        if exp["training"].get("micro_batch_size"):
            raise ConfigError(f"{where}.training.micro_batch_size",
                              "pipeline strategies cut micro-batches themselves: set strategy_options.<pp strategy>.n_microbatches instead")

    return check
