"""PyTorch's production tensor/sequence parallelism (DTensor `parallelize_module`): the comparators
`tp_dtensor` and `tp_sp_dtensor` for the hand-written `tp` and `tp_sp`, with the same sharding.

The plans are data (module path -> parallel style). For SP the embedding stays replicated and the
input of `layers[0]` is re-laid out from Replicate to Shard(1) (sequence), because the HF model
builds its causal mask and RoPE from the embedding output's full length.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module)

from shardlab.strategies.tensor_parallel.tensor_parallel import TensorParallelStrategy


def tp_plan(n_layers: int) -> dict:
    plan = {
        "gpt_neox.embed_in": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(n_layers):
        layer = f"gpt_neox.layers.{i}"
        plan.update({
            f"{layer}.attention.query_key_value": ColwiseParallel(),
            f"{layer}.attention.dense": RowwiseParallel(),
            f"{layer}.mlp.dense_h_to_4h": ColwiseParallel(),
            f"{layer}.mlp.dense_4h_to_h": RowwiseParallel(),
        })
    return plan


def tp_sp_plan(n_layers: int) -> dict:
    seq_shard, whole = (Shard(1),), (Replicate(),)
    plan = {
        "gpt_neox.embed_in": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "gpt_neox.layers.0": PrepareModuleInput(input_layouts=whole, desired_input_layouts=seq_shard,
                                                use_local_output=True),
        "gpt_neox.final_layer_norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(n_layers):
        layer = f"gpt_neox.layers.{i}"
        plan.update({
            f"{layer}.input_layernorm": SequenceParallel(),
            f"{layer}.post_attention_layernorm": SequenceParallel(),
            f"{layer}.attention": PrepareModuleInput(input_layouts=seq_shard, desired_input_layouts=whole,
                                                     use_local_output=True),
            f"{layer}.attention.query_key_value": ColwiseParallel(),
            f"{layer}.attention.dense": RowwiseParallel(output_layouts=Shard(1)),
            f"{layer}.mlp": PrepareModuleInput(input_layouts=seq_shard, desired_input_layouts=whole,
                                               use_local_output=True),
            f"{layer}.mlp.dense_h_to_4h": ColwiseParallel(),
            f"{layer}.mlp.dense_4h_to_h": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


class DTensorTensorParallel(TensorParallelStrategy):
    sequence_parallel = False

    def wrap(self, model):
        mesh = self.topo.mesh(tp=self.topo.world_size)
        n_layers = len(model.gpt_neox.layers)
        plan = tp_sp_plan(n_layers) if self.sequence_parallel else tp_plan(n_layers)
        return parallelize_module(model, mesh, plan)


class DTensorSequenceParallel(DTensorTensorParallel):
    sequence_parallel = True
