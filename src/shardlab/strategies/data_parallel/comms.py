"""Gradient all-reduce used by the hand-written data-parallel strategies.

Gradients are flattened into one contiguous buffer per bucket so that each bucket is a single
collective (gloo and nccl both prefer few large messages), then averaged and copied back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from shardlab.costs.comm_volume import pack_buckets


class GradientBucket:
    """A group of parameters whose gradients travel in one all-reduce."""

    def __init__(self, name: str, params: list[torch.nn.Parameter]):
        self.name = name
        self.params = params
        self.buffer: torch.Tensor | None = None
        self.work = None

    def launch(self, async_op: bool):
        """Start summing this bucket's gradients over all ranks (SUM: gloo has no AVG)."""
        self.buffer = _flatten_dense_tensors([p.grad for p in self.params])
        self.work = dist.all_reduce(self.buffer, op=dist.ReduceOp.SUM, async_op=async_op)

    def finish(self, world_size: int) -> None:
        """Wait for the sum, then write the mean back into each `.grad`."""
        if self.work is not None:
            self.work.wait()
        self.buffer /= world_size
        for p, averaged in zip(self.params, _unflatten_dense_tensors(self.buffer, [p.grad for p in self.params])):
            p.grad.copy_(averaged)
        self.buffer, self.work = None, None


def layer_buckets(model: torch.nn.Module) -> list[GradientBucket]:
    """One bucket per transformer layer (name prefix up to the layer index), plus one per other top module.

    Returned in reverse definition order, which is roughly the order backward finishes them.
    """
    groups: dict[str, list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        parts = name.split(".")
        cut = next((i + 1 for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
        groups.setdefault(".".join(parts[:cut]), []).append(param)
    return [GradientBucket(name, params) for name, params in reversed(groups.items())]


def size_buckets(model: torch.nn.Module, bucket_mb: float | None) -> list[GradientBucket]:
    """Per-layer buckets (`bucket_mb` None: the study's choice), or consecutive layers merged, in the
    order backward finishes them, up to `bucket_mb` MiB of gradients each (`costs.comm_volume.pack_buckets`,
    which the cost model uses too): one collective per bucket, as DDP's `bucket_cap_mb`."""
    layers = layer_buckets(model)
    sizes = [sum(p.numel() * p.element_size() for p in layer.params) for layer in layers]
    packed = pack_buckets(sizes, None if bucket_mb is None else bucket_mb * 2**20)
    if len(packed) == len(layers):
        return layers
    return [GradientBucket("+".join(layers[i].name for i in b), [p for i in b for p in layers[i].params]) for b in packed]
