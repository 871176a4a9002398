"""Settings checks for the pipeline strategies (torch-free: the registry and the Snakefile import it).

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


def checker(virtual_stages: int, needs_m_ge_stages: bool, interleaved: bool = False, hybrid: bool = False):
    """check_options(exp, where, world) for one pipeline strategy; raises ConfigError naming the field."""

    def check(spec, exp: dict, where: str, world: int | str) -> None:
        options = spec.options(exp)
        field = lambda key=None: spec.option_field(where, key)  # noqa: E731
        for key in options:
            if key not in KNOWN or (key == "pp_size" and not hybrid):
                raise ConfigError(field(key), "unknown pipeline option")
        m = options.get("n_microbatches", DEFAULT_MICROBATCHES)
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ConfigError(field("n_microbatches"), f"must be a positive integer, got {m!r}")
        if exp["training"].get("micro_batch_size"):
            raise ConfigError(f"{where}.training.micro_batch_size",
                              "pipeline strategies cut micro-batches themselves: set strategy_options.<pp strategy>.n_microbatches instead")
        if world == "auto":
            return  # checked again at launch
        pp = pipeline_size(world, options, hybrid)
        if hybrid and (pp < 2 or world % pp):
            raise ConfigError(field("pp_size"), f"{pp} must be >= 2 and divide the world size {world}")
        dp = world // pp if hybrid else 1
        local = exp["training"]["global_batch_size"] // dp
        if local % m:
            raise ConfigError(field("n_microbatches"), f"{m} does not divide the per-pipeline batch {local}")
        stages = pp * virtual_stages
        if needs_m_ge_stages and m < stages:
            raise ConfigError(field("n_microbatches"), f"1F1B needs at least as many micro-batches as stages ({stages}), got {m}")
        if interleaved and m % max(1, m // pp):
            raise ConfigError(field("n_microbatches"), f"interleaved 1F1B needs n_microbatches divisible by max(1, n_microbatches // {pp}), got {m}")
        layers = exp["model"].get("num_layers")
        if layers is not None and layers + 2 < stages:
            raise ConfigError(field(), f"{stages} pipeline stages cannot be cut from {layers} layers (+ embedding and head)")

    return check
