"""Option checks for `moe_single` and `ep_moe` (torch-free: the Snakefile validates configs early): names,
types and the MoE settings both runs share. Whether the experts split over the ranks is the Plan's question
(`costs.plan.rejection` of the MoE model, asked by `StrategySpec.check`)."""

from __future__ import annotations

from shardlab.errors import ConfigError

MOE_DEFAULTS = {"num_experts": 4, "top_k": 2, "capacity_factor": 1.25, "aux_loss_coef": 0.01,
                "expert_intermediate_size": None, "seed": None}  # must match moe.MoEConfig (tested)
MOE_STRATEGIES = ("moe_single", "ep_moe")  # and composed_moe_<plan> runs (strategies.composed)


def moe_settings(options: dict) -> dict:
    """The MoE settings of a strategy's options, defaults filled in."""
    return {key: options.get(key, default) for key, default in MOE_DEFAULTS.items()}


def check_moe_options(spec, exp: dict, where: str, ranks: int | str) -> None:
    options = spec.options(exp)
    unknown = set(options) - set(MOE_DEFAULTS) - {"world_size"}
    if unknown:
        raise ConfigError(spec.option_field(where, sorted(unknown)[0]),
                          f"unknown option (known: {', '.join(MOE_DEFAULTS)}, world_size)")
    check_moe_settings(spec, exp, where, ranks)


def check_moe_settings(spec, exp: dict, where: str, ranks: int | str) -> None:
    """The MoE settings' types, and the same settings as the experiment's other MoE runs (its reference)."""
    field = lambda key=None: spec.option_field(where, key)  # noqa: E731
    s = moe_settings(spec.options(exp))
    if not isinstance(s["num_experts"], int) or isinstance(s["num_experts"], bool) or s["num_experts"] < 1:
        raise ConfigError(field("num_experts"), "must be a positive integer")
    if not isinstance(s["top_k"], int) or not 1 <= s["top_k"] <= s["num_experts"]:
        raise ConfigError(field("top_k"), f"must be an integer between 1 and num_experts={s['num_experts']}")
    if not s["capacity_factor"] > 0:
        raise ConfigError(field("capacity_factor"), "must be positive")
    # The reference must be the same model: both MoE strategies of an experiment share their settings.
    others = [o for o in MOE_STRATEGIES if o != spec.name and o in exp.get("strategies", [])]  # moe_single, ep_moe
    for other in others:
        if moe_settings(exp.get("strategy_options", {}).get(other, {})) != s:
            raise ConfigError(field(), f"MoE settings differ from strategy_options.{other}; the unsharded "
                                       f"reference must be the same model")
