"""The ZeRO ladder as data: each rung's DeepSpeed settings, their checks, and the generated JSON.

Importable without torch or DeepSpeed, so the registry can check a config before any launch.
"""

from __future__ import annotations

from shardlab.errors import ConfigError

# Settings a run may override in `strategy_options.<rung>` (besides the launcher's `world_size`).
OPTION_DEFAULTS = {
    "offload_optimizer": None,  # None: the rung's own setting
    "offload_param": None,
    "bucket_size": None,  # elements per reduce/all-gather bucket; None: min(5e8, parameter count)
    "param_persistence_threshold": 0,  # stage 3: 0 shards every tensor (DeepSpeed's default 1e5 keeps small ones whole)
    "overlap_comm": False,
}
OFFLOAD_DEVICES = ("none", "cpu")
# (offload_optimizer, offload_param) devices -> the Plan's `offload`: what the cost model can predict.
PLAN_OFFLOAD = {("none", "none"): "none", ("cpu", "none"): "optimizer", ("cpu", "cpu"): "optimizer+params"}
# Settings that change memory or time but have no Plan field: a run may leave them only at their default,
# or it would run another plan than the one predicted (why each changes the run, for the error message).
UNPLANNED = {
    "bucket_size": "the reduce and all-gather bucket sets the gradient buffer and the number of collectives",
    "param_persistence_threshold": "parameters kept whole at stage 3 change every rank's parameter memory",
}


def rung_settings(plan: dict, options: dict) -> dict:
    """The settings of a rung (its Plan fields: ZeRO stage, offload) with the run's overrides applied."""
    offload = plan.get("offload", "none")
    settings = {"stage": plan["zero"], "offload_optimizer": "none" if offload == "none" else "cpu",
                "offload_param": "cpu" if offload == "optimizer+params" else "none"}
    for key, default in OPTION_DEFAULTS.items():
        value = options.get(key, default)
        if value is not None or key not in settings:
            settings[key] = value
    return settings


def plan_offload(settings: dict) -> str:
    """The Plan's `offload` of a rung's settings ('optimizer:nvme'-like text, which the Plan rejects by
    name, for a pair it cannot hold)."""
    devices = settings["offload_optimizer"], settings["offload_param"]
    return PLAN_OFFLOAD.get(devices, "optimizer:{}+params:{}".format(*devices))


def check_zero_options(spec, exp: dict, where: str, world: int | str) -> None:
    """Names and values of the DeepSpeed options, before anything is launched; the stage and offload
    they give are the Plan's question (`costs.plan.rejection`, asked by `StrategySpec.check`)."""
    options = spec.options(exp)
    where = spec.option_field(where)
    for key in options:
        if key not in OPTION_DEFAULTS and key != "world_size":
            raise ConfigError(f"{where}.{key}", f"unknown DeepSpeed option (known: {', '.join(sorted(OPTION_DEFAULTS))}, world_size)")
    for key in ("offload_optimizer", "offload_param"):
        if options.get(key) not in (None, *OFFLOAD_DEVICES):
            raise ConfigError(f"{where}.{key}", f"'{options[key]}' is not an offload device (use one of {OFFLOAD_DEVICES})")
    if not isinstance(options.get("overlap_comm", False), bool):  # the Plan's grad_sync_overlap
        raise ConfigError(f"{where}.overlap_comm", f"must be true or false, got {options['overlap_comm']!r}")
    for key, why in UNPLANNED.items():
        if options.get(key, OPTION_DEFAULTS[key]) != OPTION_DEFAULTS[key]:
            raise ConfigError(f"{where}.{key}", f"{options[key]!r}: the Plan has no field for it ({why}), so only "
                                                f"the default ({OPTION_DEFAULTS[key]}) can be predicted")
    s = rung_settings(spec.plan_fields(1, {}), options)
    if s["offload_param"] != "none" and s["offload_optimizer"] == "none":
        raise ConfigError(f"{where}.offload_param", "parameter offload needs ZeRO stage 3 and offload_optimizer: cpu "
                                                    "too (the Plan offloads the optimizer, or the optimizer and the "
                                                    "parameters)")


def deepspeed_config(plan: dict, training: dict, options: dict, dp_size: int, n_params: int) -> dict:
    """The DeepSpeed JSON for one run (its rung's Plan fields `plan`), generated from our experiment
    config (saved beside the run)."""
    s = rung_settings(plan, options)
    local = training["global_batch_size"] // dp_size
    micro = training.get("micro_batch_size") or local
    # DeepSpeed asserts even bucket sizes (2-byte elements packed 4-byte aligned): round an odd count up.
    bucket = int(s["bucket_size"] or min(500_000_000, n_params))
    bucket += bucket % 2
    zero = {"stage": s["stage"], "contiguous_gradients": True, "overlap_comm": s["overlap_comm"],
            "reduce_scatter": True, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if s["offload_optimizer"] != "none":
        zero["offload_optimizer"] = {"device": s["offload_optimizer"], "pin_memory": False}
    if s["offload_param"] != "none":
        zero["offload_param"] = {"device": s["offload_param"], "pin_memory": False}
    if s["stage"] == 3:
        zero.update(stage3_param_persistence_threshold=s["param_persistence_threshold"],
                    stage3_prefetch_bucket_size=bucket, stage3_gather_16bit_weights_on_model_save=True)
    return {
        "train_batch_size": training["global_batch_size"],
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": local // micro,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": training["dtype"] == "bf16"},
        "zero_optimization": zero,
        # Our optimizer (torch SGD/AdamW from build_optimizer) is passed in, so DeepSpeed must accept it,
        # also under offload where it would otherwise insist on its CPU Adam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
