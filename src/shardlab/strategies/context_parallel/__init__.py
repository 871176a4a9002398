"""Context parallelism: the sequence is sharded across ranks and attention runs as a ring.

`comms` moves K/V blocks between neighbours, `ring_attention` holds the blockwise
attention with its log-sum-exp merge and hand-written backward, `zigzag` the load-balanced
sequence sharding, and `strategy` plugs it into GPT-NeoX and the shared training loop.
"""

from __future__ import annotations

from shardlab.strategies.context_parallel.options import check_cp_options
from shardlab.strategies.spec import Family, StrategySpec

TOPIC = "context_expert"

SPECS = [
    StrategySpec("cp_ring", "shardlab.strategies.context_parallel.strategy:ContextParallelRing",
                 Family.CONTEXT_PARALLEL, TOPIC, "Sequence sharded zig-zag over ranks; hand-written ring attention "
                                                 "(K/V blocks rotate by send/recv).",
                 plan=lambda world, options: {"cp": world, "attention": "ring"}, check_options=check_cp_options),
]
