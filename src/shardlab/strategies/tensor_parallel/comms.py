"""Autograd functions for hand-written tensor and sequence parallelism (Megatron-LM's f/g pairs).

Each function is a collective in forward and its conjugate in backward:

    copy_to_tp            f: identity        | all-reduce        (input of a column-parallel layer)
    reduce_from_tp        g: all-reduce      | identity          (output of a row-parallel layer)
    sequence_gathered_linear all-gather (seq) | reduce-scatter    (SP: the input of a column-parallel layer)
    reduce_scatter_sequence reduce-scatter    | all-gather (seq)  (SP: after a row-parallel layer)
    split_sequence          keep own chunk    | all-gather (seq)  (SP: enter the sequence-sharded region)
    gather_sequence         all-gather (seq)  | keep own chunk    (SP: leave it for a region whose gradients are
                                                                   whole on every rank, e.g. tp-split experts)
    gather_last_dim         all-gather (last) | keep own chunk    (gather vocabulary-sharded logits)

`sequence_gathered_linear` fuses SP's all-gather with the column-parallel matmul so that only the
sequence shard is saved for backward, which re-gathers it (Megatron-LM's choice: the saved input of
a column layer then costs sbh/t, as the TP+SP activation formula assumes, instead of sbh).

Every buffer handed to gloo is made contiguous first: gloo silently returns wrong data for
non-contiguous outputs (a known gloo limitation), which is why torch.distributed.nn's all_gather is not used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQ_DIM = 1  # activations are [batch, sequence, hidden]


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    x = x.contiguous()
    chunks = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(chunks, x, group=group)
    return torch.cat(chunks, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    # Move `dim` first so each rank's chunk is one contiguous block of the flat buffer.
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _own_chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(world, dim=dim)[rank].contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return _all_reduce(x.clone(), group)
        # x is a matmul output nothing else reads (linear saves its input, not its output): reduce in place.
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, SEQ_DIM, ctx.group), None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_chunk(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, -1, ctx.group), None


class _SequenceGatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x_shard, weight)
        return F.linear(_all_gather(x_shard, SEQ_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        x = _all_gather(x_shard, SEQ_DIM, ctx.group)  # recomputed instead of stored
        # Under autocast the forward ran in the gradient's dtype; backward runs outside autocast, so cast
        # the saved fp32 tensors to it (autograd casts the returned gradients back to their inputs' dtypes).
        grad_input = _reduce_scatter(grad @ weight.to(grad.dtype), SEQ_DIM, ctx.group)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


def sequence_gathered_linear(x_shard, weight, bias, group):
    return _SequenceGatheredLinear.apply(x_shard, weight, bias, group)


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def reduce_scatter_sequence(x, group):
    return _ReduceScatterSequence.apply(x, group)


def gather_sequence(x, group):
    return _GatherSequence.apply(x, group)


def split_sequence(x, group):
    return _SplitSequence.apply(x, group)


def gather_last_dim(x, group):
    return _GatherLastDim.apply(x, group)
