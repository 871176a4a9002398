"""Context parallelism: the sequence is sharded across ranks and attention runs as a ring.

`ring_comms` moves K/V blocks between neighbours, `ring_attention` holds the blockwise
attention with its log-sum-exp merge and hand-written backward, `zigzag` the load-balanced
sequence sharding, and `strategy` plugs it into GPT-NeoX and the shared training loop.
"""

from __future__ import annotations

from shardlab.costs.comm_volume import context_parallel
from shardlab.costs.memory import unsharded
from shardlab.strategies.context_parallel.options import check_cp_options
from shardlab.strategies.spec import StrategySpec, one

TOPIC = "context_expert"

SPECS = [
    StrategySpec("cp_ring", "shardlab.strategies.context_parallel.strategy:ContextParallelRing", "context parallel",
                 TOPIC, "Sequence sharded zig-zag over ranks; hand-written ring attention (K/V blocks rotate by "
                        "send/recv).",
                 lambda model, step, world, options: context_parallel(model, step, world),
                 lambda model, world, options, dtype, optimizer: [unsharded(model.parameters(), dtype, optimizer)] * world,
                 data_parallel_size=one, check_options=check_cp_options,
                 layout=lambda world, options: {"dp": 1, "cp": world}),
]
