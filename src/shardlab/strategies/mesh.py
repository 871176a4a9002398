"""Data parallelism along one dimension of a named device mesh: what every strategy that composes
replicas with another technique (the dp x pp hybrid, composed plans) shares. The strategy builds
`self.mesh` with a "dp" dimension; this gives its data-parallel rank, size and group and averages the
gradients over exactly that dimension."""

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


class MeshDataParallel:
    """Mixin for a Strategy with `self.mesh` holding a "dp" dimension."""

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def dp_group(self):
        return self.mesh["dp"].get_group()

    def average_replica_gradients(self) -> None:
        """The replicas' gradients averaged over dp, timed as communication."""
        if self.dp_size == 1:
            return
        with self.comm.blocked():
            all_reduce_gradients(self.model.parameters(), self.dp_group, divide_by=self.dp_size)
