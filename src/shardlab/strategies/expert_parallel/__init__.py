"""Expert parallelism: a mixture-of-experts MLP whose experts are sharded across ranks.

`moe` is the model change (router, experts, capacity, load-balancing loss) used by both the
unsharded reference (`moe_single`) and the sharded run (`ep_moe`); `comms` is the token
dispatch/return all-to-all; `strategy` plugs both into the shared training loop.
"""

from __future__ import annotations

from dataclasses import replace

from shardlab.costs.shapes import ModelShape
from shardlab.strategies.expert_parallel.options import check_moe_options, moe_settings
from shardlab.strategies.spec import Family, StrategySpec

TOPIC = "context_expert"


def moe_model(model: ModelShape, options: dict) -> ModelShape:
    """The experiment's model with every MLP a top-k mixture of GPT-NeoX MLPs (`moe`; width
    `expert_intermediate_size`, default intermediate / top_k) behind a bias-free router."""
    moe = moe_settings(options)
    width = moe["expert_intermediate_size"] or model.intermediate_size // moe["top_k"]
    return replace(model, num_experts=moe["num_experts"], top_k=moe["top_k"], expert_intermediate=width)


SPECS = [
    StrategySpec("moe_single", "shardlab.strategies.expert_parallel.strategy:MoESingle", Family.EXPERT_PARALLEL,
                 TOPIC, "The mixture-of-experts model in one process: the reference for ep_moe.", model=moe_model,
                 reference="moe_single", single_process=True, check_options=check_moe_options),
    StrategySpec("ep_moe", "shardlab.strategies.expert_parallel.strategy:ExpertParallelMoE", Family.EXPERT_PARALLEL,
                 TOPIC, "Mixture of experts with experts sharded over ranks; tokens dispatched by uneven all-to-all.",
                 plan=lambda world, options: {"dp": world, "ep": world}, model=moe_model, reference="moe_single",
                 check_options=check_moe_options, plan_options=(("ep", "num_experts"),)),
]
