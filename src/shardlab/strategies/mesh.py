"""Gradient reductions over one dimension of a named device mesh: what every strategy that composes
data-parallel replicas with another technique (the dp x pp hybrid, composed plans) shares."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.strategies.base import local_tensor


def all_reduce_gradients(params, group, divide_by: int = 1) -> None:
    """Sum `.grad` (local shards of DTensors included) over `group` in one collective, then divide (gloo
    has no AVG)."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if divide_by > 1:
        flat /= divide_by
    for grad, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(reduced.view_as(grad))


def average_gradients(params, mesh, comm) -> None:
    """The gradients of `params` averaged over the ranks of a 1-D `mesh` (the replicas of a parameter),
    timed as communication by `comm`; nothing with one rank."""
    if mesh.size() == 1:
        return
    with comm.blocked():
        all_reduce_gradients(params, mesh.get_group(), divide_by=mesh.size())
