"""Expert parallelism: a mixture-of-experts MLP whose experts are sharded across ranks.

`moe` is the model change (router, experts, capacity, load-balancing loss) used by both the
unsharded reference (`moe_single`) and the sharded run (`ep_moe`); `ep_comms` is the token
dispatch/return all-to-all; `strategy` plugs both into the shared training loop.
"""

from __future__ import annotations

from shardlab.costs.comm_volume import expert_parallel
from shardlab.costs.memory import unsharded
from shardlab.costs.shapes import moe_parameters
from shardlab.strategies.expert_parallel.options import check_moe_options, moe_settings
from shardlab.strategies.spec import StrategySpec, one

TOPIC = "context_expert"


def _states(model, world, options, dtype, optimizer):
    moe = moe_settings(options)
    local = moe_parameters(model, moe["num_experts"], moe["top_k"], moe["expert_intermediate_size"], ep=world)
    return [unsharded(local, dtype, optimizer)] * world


def _plan(model, step, world, options):
    return expert_parallel(model, step, world, moe_settings(options)["top_k"]) if world > 1 else []


SPECS = [
    StrategySpec("moe_single", "shardlab.strategies.expert_parallel.strategy:MoESingle", "expert parallel", TOPIC,
                 "The mixture-of-experts model in one process: the reference for ep_moe.", _plan, _states,
                 reference="moe_single", single_process=True, data_parallel_size=one,
                 check_options=check_moe_options),
    StrategySpec("ep_moe", "shardlab.strategies.expert_parallel.strategy:ExpertParallelMoE", "expert parallel", TOPIC,
                 "Mixture of experts with experts sharded over ranks; tokens dispatched by uneven all-to-all.",
                 _plan, _states, reference="moe_single", check_options=check_moe_options,
                 layout=lambda world, options: {"dp": world, "ep": world}),
]
