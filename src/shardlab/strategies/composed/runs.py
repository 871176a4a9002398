"""A Plan as a composed run: the `strategy_options` and the strategy name that execute it (the plan search
and the rehearsals both write runs so). Torch-free."""

from __future__ import annotations

from shardlab.costs.plan import Plan
from shardlab.strategies.composed import VARIANT_PREFIX

# (framework, zero) -> the composed run's dp_shard: every sharding of dp that a composition runs
DP_SHARD = {("torch", 0): "replicas", ("torch", 1): "zero1", ("fsdp2", 3): "fsdp2_full", ("fsdp2", 2): "fsdp2_grad_op"}


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
    if (plan.framework, plan.zero) != ("torch", 0):
        options["dp_shard"] = DP_SHARD[plan.framework, plan.zero]
    if plan.recompute != "none":
        options["recompute"] = plan.recompute
    return options


def run_name(plan: Plan) -> str:
    """A strategy name for the run of `plan`, e.g. composed_dp2_tp2sp or composed_pp2_1f1b_m4_cp2."""
    parts = [f"dp{plan.dp}"] if plan.dp > 1 else []
    parts += [f"tp{plan.tp}{'sp' if plan.sp else ''}"] if plan.tp > 1 else []
    parts += [f"cp{plan.cp}"] if plan.cp > 1 else []
    if plan.pp > 1:
        v = f"v{plan.virtual_stages}" if plan.schedule == "interleaved" else ""
        parts.append(f"pp{plan.pp}_{plan.schedule}{v}_mb{plan.micro_batch}")
    if (plan.framework, plan.zero) != ("torch", 0):
        parts.append(DP_SHARD[plan.framework, plan.zero])
    if plan.recompute != "none":
        parts.append(f"recompute_{plan.recompute}")
    return VARIANT_PREFIX + "_".join(parts or ["dp1"])
