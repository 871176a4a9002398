"""Hand-written Megatron-style tensor parallelism (`tp`) and sequence parallelism (`tp_sp`) for GPT-NeoX.

Modules are swapped in place, so module names (and the activation probe's tags) stay those of the
Hugging Face model:

- attention `query_key_value`, MLP `dense_h_to_4h`: column-parallel (output features split). The fused
  QKV weight is laid out head by head, so a contiguous row chunk is a whole set of heads per rank.
- attention `dense`, MLP `dense_4h_to_h`: row-parallel (input features split), one all-reduce after.
- `embed_in`: vocabulary-parallel embedding; `lm_head`: column-parallel over the vocabulary. Its
  logits are gathered for the plain loss, or, with the option `parallel_cross_entropy: true`, kept
  split and fed to the vocabulary-parallel cross-entropy (`cross_entropy.py`).

Sequence parallelism additionally keeps LayerNorms, dropout and residual adds on a sequence shard:
the embedding stays replicated (the HF model builds the causal mask and RoPE from its full-length
output), `layers[0]` keeps its own chunk of the sequence, the all-reduce after a row-parallel layer
becomes a reduce-scatter, and each column-parallel layer all-gathers its sequence-sharded input
inside its matmul (saving only the shard for backward). Gradients of
parameters applied to a sequence shard (LayerNorms, row-parallel biases) are partial sums and are
all-reduced in `sync_gradients`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlab.strategies.base import Strategy, causal_lm_loss
from shardlab.strategies.portable import as_held, chunked
from shardlab.strategies.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardlab.strategies.tensor_parallel.comms import (
    copy_to_tp, gather_last_dim, reduce_from_tp, reduce_scatter_sequence, sequence_gathered_linear, split_sequence)


def _shard(param: torch.Tensor, dim: int, group) -> nn.Parameter:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if param.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {param.shape[dim]} is not divisible by the TP degree {world}")
    shard = nn.Parameter(param.detach().chunk(world, dim=dim)[rank].clone())
    shard.tp_shard_dim = dim  # lets full_gradients() reassemble the tensor
    return shard


def _mark_sequence_parallel(module: nn.Module) -> None:
    for p in module.parameters():
        p.sequence_parallel = True


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks. `input_mode`: 'copy' (TP's f), 'gather_sequence' (SP: the
    input is a sequence shard, gathered inside the matmul), or 'stashed_sequence_shard' (SP for the
    attention's QKV: the shard was stashed by `_attention_sees_whole_sequence`)."""

    def __init__(self, linear: nn.Linear, group, input_mode: str = "copy", gather_output: bool = False):
        super().__init__()
        self.group, self.input_mode, self.gather_output = group, input_mode, gather_output
        self.weight = _shard(linear.weight, 0, group)
        self.bias = _shard(linear.bias, 0, group) if linear.bias is not None else None

        self.sequence_shard = None

    def forward(self, x):
        if self.input_mode == "copy":
            y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        else:
            if self.input_mode == "stashed_sequence_shard":
                x, self.sequence_shard = self.sequence_shard, None
            y = sequence_gathered_linear(x, self.weight, self.bias, self.group)
        return gather_last_dim(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs summed (all-reduce, or reduce-scatter for SP)."""

    def __init__(self, linear: nn.Linear, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard(linear.weight, 1, group)
        # The bias is added once, after the reduction, so it stays whole on every rank.
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        if sequence_parallel and self.bias is not None:
            self.bias.sequence_parallel = True

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = reduce_scatter_sequence(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous range of vocabulary rows; out-of-range ids contribute zeros, summed."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        self.group = group
        self.weight = _shard(embedding.weight, 0, group)
        self.vocab_start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


def _attention_sees_whole_sequence(attention: nn.Module, group):
    """SP pre-hook for HF attention, which takes (batch, seq) from its input's shape: stash the
    sequence shard for query_key_value (the only consumer of the input's values) and hand the module a
    zero-copy view with the whole sequence's shape."""
    world = dist.get_world_size(group)

    def hook(module, args):
        shard = args[0]
        attention.query_key_value.sequence_shard = shard
        b, s_local, h = shard.shape
        return (shard[:, :1].expand(b, s_local * world, h), *args[1:])

    return hook


def parallelize_neox(model: nn.Module, group, sequence_parallel: bool, gather_logits: bool = True) -> nn.Module:
    """Swap GPT-NeoX's linear layers and embeddings for their tensor-parallel versions, in place."""
    neox = model.gpt_neox
    neox.embed_in = VocabParallelEmbedding(neox.embed_in, group)
    column_input = "gather_sequence" if sequence_parallel else "copy"
    for layer in neox.layers:
        attention, mlp = layer.attention, layer.mlp
        attention.query_key_value = ColumnParallelLinear(
            attention.query_key_value, group, input_mode="stashed_sequence_shard" if sequence_parallel else "copy")
        attention.dense = RowParallelLinear(attention.dense, group, sequence_parallel)
        if hasattr(mlp, "dense_h_to_4h"):  # a mixture of experts splits its experts itself (composed.parallelize)
            mlp.dense_h_to_4h = ColumnParallelLinear(mlp.dense_h_to_4h, group, input_mode=column_input)
            mlp.dense_4h_to_h = RowParallelLinear(mlp.dense_4h_to_h, group, sequence_parallel)
        if sequence_parallel:
            attention.register_forward_pre_hook(_attention_sees_whole_sequence(attention, group))
            _mark_sequence_parallel(layer.input_layernorm)
            _mark_sequence_parallel(layer.post_attention_layernorm)
    if sequence_parallel:
        neox.layers[0].register_forward_pre_hook(lambda m, args: (split_sequence(args[0], group), *args[1:]))
        _mark_sequence_parallel(neox.final_layer_norm)
    model.lm_head = ColumnParallelLinear(model.lm_head, group, input_mode=column_input, gather_output=gather_logits)
    return model


class TensorParallelStrategy(Strategy):
    """Shared by every TP strategy: all ranks form one TP group and see the same (whole) batch."""

    def tp_group(self):
        return self.topo.mesh(tp=self.topo.world_size).get_group("tp")

    dp_rank, dp_size = 0, 1  # every TP rank sees the whole global batch

    def held_parameters(self):
        """Hand-cut shards keep the whole model's module names; DTensor shards say their own cut."""
        return [chunked(name, p, p.tp_shard_dim, self.tp_group()) if hasattr(p, "tp_shard_dim") else as_held(name, p)
                for name, p in self.model.named_parameters()]

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient (collective; call after sync_gradients), for parity checks."""
        return {h.name: h.whole(h.param.grad).detach().clone() for h in self.held_parameters()}


class HandTensorParallel(TensorParallelStrategy):
    sequence_parallel = False

    def wrap(self, model):
        self._group = self.tp_group()
        self.parallel_cross_entropy = bool(self.options.get("parallel_cross_entropy", False))
        model = parallelize_neox(model, self._group, self.sequence_parallel,
                                 gather_logits=not self.parallel_cross_entropy)
        self._vocab_start = dist.get_rank(self._group) * model.lm_head.weight.shape[0]
        return model

    def _loss(self, inputs, labels):
        logits = self.model(input_ids=inputs).logits
        if not self.parallel_cross_entropy:
            return causal_lm_loss(logits, labels)
        return vocab_parallel_cross_entropy(logits.flatten(0, -2), labels.flatten(), self._vocab_start, self._group)

    def forward_backward(self, inputs, labels, scale):
        with self.autocast():
            loss = self._loss(inputs, labels)
        (loss * scale).backward()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, inputs, labels):
        with self.autocast():
            return self._loss(inputs, labels)

    def sync_gradients(self) -> None:
        # Only SP has partial-sum gradients: parameters that saw one sequence shard per rank.
        for p in self.model.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=self._group)


class HandSequenceParallel(HandTensorParallel):
    sequence_parallel = True
