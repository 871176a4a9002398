"""PyTorch FSDP2 (`fully_shard`): the production comparator for the ZeRO ladder.

Parameters become DTensors sharded across the data-parallel ranks (dim 0), gradients are
reduce-scattered into the same shards and the optimizer only sees local shards, so at rest every
rank holds 1/N of parameters, gradients and optimizer state (ZeRO-3's model states). The two
variants differ only in what happens between forward and backward:

- `fsdp2_full`    (reshard_after_forward=True):  free the gathered weights after each block's
  forward and all-gather them again in backward (ZeRO-3's schedule: 3 collectives per block);
- `fsdp2_grad_op` (reshard_after_forward=False): keep them gathered until backward is done
  (ZeRO-2's memory during the step, one all-gather fewer; FSDP1 called it SHARD_GRAD_OP).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardlab.strategies.base import Strategy


def transformer_blocks(model) -> list:
    """The repeated blocks, each its own FSDP unit (one all-gather per block)."""
    return list(model.gpt_neox.layers)


class FSDP2(Strategy):
    reshard_after_forward = True

    def wrap(self, model):
        mesh = self.topo.mesh(dp=self.topo.world_size)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.training["dtype"] == "bf16" else MixedPrecisionPolicy()
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp)
        return model

    def autocast(self):
        import contextlib

        return contextlib.nullcontext()  # FSDP2's MixedPrecisionPolicy casts the gathered weights itself

    def accumulating(self, last: bool):
        # Accumulate unreduced local gradients; reduce-scatter only after the last micro-batch.
        self.model.set_requires_gradient_sync(last)
        return super().accumulating(last)

    def state_bytes(self) -> dict:
        from shardlab.strategies.zero.deepspeed import device_memory_bytes

        return dict(super().state_bytes(), device_memory_bytes=device_memory_bytes(self.topo.device))  # local shards


class FSDP2Full(FSDP2):
    reshard_after_forward = True


class FSDP2GradOp(FSDP2):
    reshard_after_forward = False
