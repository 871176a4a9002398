"""Token dispatch and return for expert parallelism: `all_to_all_single` with uneven splits.

Rank r sends `send_splits[d]` rows to rank d and receives `recv_splits[s]` rows from rank s. The
backward of a dispatch is the return trip with the splits swapped (and vice versa).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, timer):
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.timer = send_splits, recv_splits, group, timer
        return _exchange(rows, send_splits, recv_splits, group, timer)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group, ctx.timer), None, None, None, None


def _exchange(rows, send_splits, recv_splits, group, timer):
    out = torch.empty((sum(recv_splits), *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    with timer.blocked() if timer else contextlib.nullcontext():
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)
    return out


def all_to_all(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None, timer=None):
    """Differentiable uneven all-to-all of the rows of a [N, ...] tensor."""
    return AllToAll.apply(rows, send_splits, recv_splits, group, timer)


def gather_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's `counts` stacked as [ranks, ...] (the routing plan every rank computes identically)."""
    if group is None and not dist.is_initialized():
        return counts.unsqueeze(0)
    pieces = [torch.empty_like(counts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, counts.contiguous(), group=group)
    return torch.stack(pieces)
