"""Expert parallelism: a mixture-of-experts MLP whose experts are sharded across ranks.

`moe` is the model change (router, experts, capacity, load-balancing loss) used by both the
unsharded reference (`moe_single`) and the sharded run (`ep_moe`); `ep_comms` is the token
dispatch/return all-to-all; `strategy` plugs both into the shared training loop.
"""
