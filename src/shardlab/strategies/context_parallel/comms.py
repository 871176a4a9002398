"""Point-to-point ring exchange for ring attention: send to the next rank, receive from the previous.

Every rank posts its sends and receives in one `batch_isend_irecv`, so the exchange runs while the
caller computes on the block it already holds; `wait()` returns the received tensors.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class Ring:
    """Neighbours of this rank in a ring over `group` (None: the whole world)."""

    def __init__(self, group=None, timer=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size) if group else (self.rank + 1) % self.size
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size) if group else (self.rank - 1) % self.size
        self.timer = timer  # a CommTimer: time blocked waiting for blocks counts as communication

    def start_shift(self, tensors: list[torch.Tensor]) -> "PendingShift":
        """Send `tensors` to the next rank and receive the previous rank's (same shapes) asynchronously."""
        # irecv needs a fresh contiguous buffer (empty_like of a non-contiguous view fails on gloo).
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next_peer, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, buf, self.prev_peer, self.group) for buf in received]
        return PendingShift(dist.batch_isend_irecv(ops), received, self.timer)


class PendingShift:
    def __init__(self, requests, received, timer):
        self.requests, self.received, self.timer = requests, received, timer

    def wait(self) -> list[torch.Tensor]:
        with self.timer.blocked() if self.timer else contextlib.nullcontext():
            for request in self.requests:
                request.wait()
        return self.received
