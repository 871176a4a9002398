"""Data parallelism along one dimension of a named device mesh: what every strategy that composes
replicas with another technique (the dp x pp hybrid, composed plans) shares. The strategy builds
`self.mesh` with a "dp" dimension; this gives its data-parallel rank, size and group and averages the
gradients over exactly that dimension."""

from __future__ import annotations

import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def all_reduce_mean_gradients(params, group, group_size: int) -> None:
    """Average `.grad` over `group` in one collective (SUM then divide: gloo has no AVG)."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= group_size
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)


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
            all_reduce_mean_gradients(self.model.parameters(), self.dp_group, self.dp_size)
