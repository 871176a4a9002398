"""A first hybrid: data parallel x pipeline parallel on a 2-D device mesh (dp, pp).

The composition is explicit. The mesh's `pp` dimension gives each data-parallel replica its own
pipeline (1F1B over `pp` ranks, from `pipeline.py`); the `dp` dimension links the ranks that hold
the same stage in different replicas. Each replica trains on its own rows of the global batch;
after the schedule, each stage's gradients are averaged over its `dp` group (one blocking
all-reduce of a flat buffer, as naive DP does) before every rank steps its optimizer.
"""

from __future__ import annotations

import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardlab.strategies.pipeline_parallel.options import DEFAULT_HYBRID_PP
from shardlab.strategies.pipeline_parallel.pipeline import OneForwardOneBackward


def all_reduce_mean_gradients(params, group, group_size: int) -> None:
    """Average `.grad` over `group` in one collective (SUM then divide: gloo has no AVG)."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= group_size
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)


class HybridDataPipeline(OneForwardOneBackward):
    measures_comm = True  # the data-parallel all-reduce; pipeline sends happen inside the schedule

    def pipeline_group(self):
        pp = int(self.options.get("pp_size", DEFAULT_HYBRID_PP))
        self.mesh = self.topo.mesh(pp=pp, dp=self.topo.world_size // pp)  # Megatron order: dp inside pp
        return self.mesh["pp"].get_group(), self.mesh["pp"].get_local_rank(), pp

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    @property
    def dp_group(self):
        return self.mesh["dp"].get_group()

    def sync_gradients(self) -> None:
        if self.training["fault_injection"] == "skip_grad_average":
            return
        with self.comm.blocked():
            all_reduce_mean_gradients(self.model.parameters(), self.dp_group, self.dp_size)

    def extra_metrics(self) -> dict:
        return dict(super().extra_metrics(), dp_rank=self.dp_rank, dp_size=self.dp_size, pp_rank=self.pp_rank)
