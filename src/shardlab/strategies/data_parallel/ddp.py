"""PyTorch DistributedDataParallel: the production data-parallel comparator.

DDP buckets gradients (25 MB by default) and overlaps their all-reduce with backward; its
communication is hidden inside `backward()` and cannot be timed separately from outside.
"""

from torch.nn.parallel import DistributedDataParallel

from shardlab.strategies.base import Strategy


class TorchDDP(Strategy):

    def wrap(self, model):
        device_ids = [self.topo.device.index] if self.topo.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def accumulating(self, last: bool):
        return self.model.no_sync() if not last else super().accumulating(last)

    @property
    def probe_module(self):
        return self.model.module
