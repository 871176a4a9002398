"""The ZeRO ladder: DeepSpeed stages 0-3 and offload (`deepspeed`, its JSON from `settings`), and
PyTorch FSDP2 (`fsdp2`) beside it. `RUNGS` is the ladder's one definition: each rung's class and its
Plan fields (ZeRO stage, offload, framework), from which the cost model predicts it and `settings`
writes its DeepSpeed JSON."""

from __future__ import annotations

from shardlab.strategies.spec import Family, StrategySpec, only_options
from shardlab.strategies.zero.settings import check_zero_options, plan_offload, rung_settings

TOPIC = "zero"

# name: (module:class, Plan fields, summary), in the decision tree's order: least communication first.
RUNGS = {
    "zero0": ("deepspeed:DeepSpeedZero", {"zero": 0},
              "DeepSpeed ZeRO stage 0: plain data parallelism inside the DeepSpeed engine."),
    "zero1": ("deepspeed:DeepSpeedZero", {"zero": 1},
              "DeepSpeed ZeRO-1: optimizer state (with fp32 master weights) sharded."),
    "zero2": ("deepspeed:DeepSpeedZero", {"zero": 2}, "DeepSpeed ZeRO-2: optimizer state and gradients sharded."),
    "zero3": ("deepspeed:DeepSpeedZero", {"zero": 3},
              "DeepSpeed ZeRO-3: optimizer state, gradients and parameters sharded."),
    "zero2_offload": ("deepspeed:DeepSpeedZero", {"zero": 2, "offload": "optimizer"},
                      "DeepSpeed ZeRO-2 with the optimizer state and step on the CPU."),
    "zero3_offload": ("deepspeed:DeepSpeedZero", {"zero": 3, "offload": "optimizer+params"},
                      "DeepSpeed ZeRO-3 with parameters and optimizer state on the CPU."),
    "fsdp2_full": ("fsdp2:FSDP2Full", {"zero": 3, "framework": "fsdp2"},
                   "torch FSDP2 fully_shard, reshard after forward (ZeRO-3's schedule)."),
    "fsdp2_grad_op": ("fsdp2:FSDP2GradOp", {"zero": 2, "framework": "fsdp2"},
                      "torch FSDP2 fully_shard, weights kept gathered from forward to backward (ZeRO-2-like)."),
}

# In bf16 DeepSpeed and FSDP2 keep the module's weights in bf16 (FSDP2: param_dtype), where `single` runs
# autocast over fp32 weights: another rounding of the same training, whose distance from `single` is
# measured by the library's own recipe on one process (DeepSpeed at ZeRO-1: stage 0's bf16 path starts
# AdamW one step ahead, see deepspeed.py) and allowed for by the parity rule (tables.parity).
BF16_TWINS = {"deepspeed": ("deepspeed_single", "zero1"), "fsdp2": ("fsdp2_single", "fsdp2_full")}


# The options behind the Plan's offload: parameter offload where the run asks for it, else the optimizer's.
OFFLOAD_OPTIONS = (("offload", "offload_param"), ("offload", "offload_optimizer"))


def deepspeed_ladder() -> dict[str, dict]:
    """DeepSpeed's rungs and their Plan fields, in ladder order (the ZeRO decision tree's choices)."""
    return {name: {"framework": "deepspeed", **fields} for name, (target, fields, _) in RUNGS.items()
            if target.startswith("deepspeed:")}


def rung_plan(fields: dict):
    """The Plan fields of a rung's run: its own, with DeepSpeed's offload options applied."""
    full = {"framework": "deepspeed", **fields}

    def plan(world: int, options: dict) -> dict:
        if full["framework"] != "deepspeed":
            return {"dp": world, **full, "grad_sync_overlap": True}  # FSDP2 reduce-scatters as the backward goes
        settings = rung_settings(full, options)
        return {"dp": world, **full, "offload": plan_offload(settings), "grad_sync_overlap": settings["overlap_comm"]}

    return plan


def _twin(framework: str) -> StrategySpec:
    name, rung = BF16_TWINS[framework]
    target, fields, _ = RUNGS[rung]
    return StrategySpec(name, f"shardlab.strategies.zero.{target}", Family.BASELINE, "runs",
                        f"{framework} on one process: its own bf16 recipe, compared with `single` to measure that "
                        f"recipe's rounding noise (tables.parity).", plan=rung_plan(fields), single_process=True)


def _spec(name: str) -> StrategySpec:
    target, fields, summary = RUNGS[name]
    framework = fields.get("framework", "deepspeed")
    return StrategySpec(name, f"shardlab.strategies.zero.{target}", Family.ZERO, TOPIC, summary, plan=rung_plan(fields),
                        bf16_twin=BF16_TWINS[framework][0], plan_options=OFFLOAD_OPTIONS,
                        check_options=check_zero_options if framework == "deepspeed" else only_options())


SPECS = [*map(_spec, RUNGS), *map(_twin, BF16_TWINS)]
