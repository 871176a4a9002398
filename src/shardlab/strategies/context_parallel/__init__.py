"""Context parallelism: the sequence is sharded across ranks and attention runs as a ring.

`ring_comms` moves K/V blocks between neighbours, `ring_attention` holds the blockwise
attention with its log-sum-exp merge and hand-written backward, `zigzag` the load-balanced
sequence sharding, and `strategy` plugs it into GPT-NeoX and the shared training loop.
"""
