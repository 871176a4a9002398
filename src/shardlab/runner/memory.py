"""Memory measurement: activations saved for backward (by module) and the process peak.

Parameters, gradients and optimizer state are counted by the strategy (`Strategy.state_bytes`),
since only it knows which shard a rank holds.
"""

from __future__ import annotations

import resource
from collections import defaultdict

import torch
from torch import nn


def _storage_key(t: torch.Tensor) -> int:
    # _cdata identifies the storage object itself; data_ptr is reused after frees.
    return t.untyped_storage()._cdata


class ActivationProbe:
    """Count the bytes autograd saves for backward during a forward, deduplicated by storage.

    Parameters and views of parameters are not activations and are left out. Each saved storage is
    attributed to the innermost module running when it was first saved (e.g.
    `gpt_neox.layers.0.attention.query_key_value`), so callers can sum by component.
    """

    def __init__(self, module: nn.Module, exclude: list[torch.Tensor] = ()):
        self.module = module
        self.exclude = {_storage_key(_local(p)) for p in [*module.parameters(), *exclude]}
        self.seen: dict[int, tuple[int, str]] = {}
        self._stack: list[str] = []
        self._handles = []
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            local = _local(t)
            key = _storage_key(local)
            if key not in self.exclude and key not in self.seen:
                self.seen[key] = (local.untyped_storage().nbytes(), self._stack[-1] if self._stack else "")
        return t

    def _enter_module(self, name: str):
        def hook(module, args):
            self._stack.append(name)

        return hook

    def _leave_module(self, module, args, output):
        self._stack.pop()  # returns None, so the module's output is left untouched

    def __enter__(self):
        for name, sub in self.module.named_modules():
            self._handles.append(sub.register_forward_pre_hook(self._enter_module(name)))
            self._handles.append(sub.register_forward_hook(self._leave_module))
        self._saved_hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._saved_hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.seen.values())

    def bytes_by_module(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for nbytes, name in self.seen.values():
            out[name] += nbytes
        return dict(out)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """Peak tensor memory from the CUDA allocator, or the process RSS peak on CPU (a process figure,
    dominated by library code, not a tensor peak)."""
    if device.type == "cuda":
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)), "peak_kind": "cuda_max_allocated",
                "reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_kind": "process_rss"}
