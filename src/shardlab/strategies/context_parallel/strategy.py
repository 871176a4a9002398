"""Context parallelism (`cp_ring`): every rank sees the same batch rows and holds one zig-zag shard of
the sequence; attention is ring attention; parameters are replicated.

The embedding, MLPs, norms and head act on local tokens only; attention is the one place tokens
meet across ranks, and it is swapped in through transformers' `AttentionInterface`, with explicit
global position ids so RoPE sees each token's true position. Each rank's loss is the mean over its
own tokens (all ranks hold equally many), so the global-token mean is the mean of the rank losses and
its gradient is the mean of the ranks' gradients: one all-reduce over the context-parallel group.
"""

from __future__ import annotations

import torch.distributed as dist
from transformers import AttentionInterface

from shardlab.strategies.base import Strategy
from shardlab.strategies.context_parallel import zigzag
from shardlab.strategies.context_parallel.ring_attention import ring_attention
from shardlab.strategies.context_parallel.comms import Ring
from shardlab.strategies.data_parallel.comms import GradientBucket

ATTENTION_NAME = "shardlab_ring"


def make_ring_attention_forward(ring: Ring):
    """An attention function with transformers' signature that runs ring attention on the local shard."""

    def ring_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if dropout:
            raise ValueError("ring attention does not implement attention dropout")
        # The model's own mask is built for local positions and is wrong here; causality comes from the
        # chunks' global order instead (GPT-NeoX attention is always causal).
        out = ring_attention(query, key, value, ring, causal=module.is_causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None  # [B, S/c, H, D], as transformers expects

    return ring_attention_forward


class ContextParallelRing(Strategy):
    measures_comm = True

    def wrap(self, model):
        group = self.topo.mesh(cp=self.topo.world_size).get_group("cp")
        self.ring = Ring(group, timer=self.comm)
        self.cp_group = group
        AttentionInterface.register(ATTENTION_NAME, make_ring_attention_forward(self.ring))
        model.set_attn_implementation(ATTENTION_NAME)
        self.positions = zigzag.positions(self.training["seq_len"], self.ring.rank, self.ring.size).to(self.topo.device)
        self._bucket = GradientBucket("all", [p for p in model.parameters() if p.requires_grad])
        return model

    # Every context-parallel rank sees the whole global batch (no data parallelism)...
    dp_rank, dp_size = 0, 1

    # ...and keeps its zig-zag shard of each sequence.
    def local_batch(self, inputs, labels):
        return (zigzag.shard(inputs, self.ring.rank, self.ring.size),
                zigzag.shard(labels, self.ring.rank, self.ring.size))

    def position_ids(self, inputs):
        return self.positions.expand(inputs.shape[0], -1)  # RoPE sees each token's true position

    def sync_gradients(self):
        with self.comm.blocked():
            self._bucket.launch(async_op=False)  # the CP group spans the world (bucket all-reduces over it)
            self._bucket.finish(self.ring.size)

    def reduce_losses(self, losses):
        losses = losses.detach().float().clone()
        dist.all_reduce(losses, group=self.cp_group)
        return losses / self.ring.size

    def extra_metrics(self) -> dict:
        return {"cp_size": self.ring.size, "seq_len": self.training["seq_len"],
                "local_seq_len": int(self.positions.numel()),
                "zigzag_chunks": list(zigzag.chunk_ids(self.ring.rank, self.ring.size))}
