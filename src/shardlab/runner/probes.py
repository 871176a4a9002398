"""Memory measurement: activations saved for backward (by module) and the process peak.

Parameters, gradients and optimizer state are counted by the strategy (`Strategy.state_bytes`),
since only it knows which shard a rank holds.
"""

from __future__ import annotations

import resource
from collections import defaultdict

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from shardlab.runner.metrics import forked_by_rank_server


def _storage_key(t: torch.Tensor) -> int:
    # _cdata is the address of the storage object: unique only while that object exists, so every key
    # kept across time is pinned by a StorageWeakRef (below).
    return t.untyped_storage()._cdata


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (read as an attribute: no autograd op inside a pack hook), else `t`."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def parameter_forms(p: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor a parameter's bytes live in right now: its current `.data` (ZeRO-3's gathered full
    weight during forward, FSDP2's unsharded parameter), its DTensor local shard, its ZeRO-3 partition."""
    forms = [_local(p)]  # a plain tensor is its own local form; a DTensor has no storage of its own
    ds_tensor = getattr(p, "ds_tensor", None)
    if isinstance(ds_tensor, torch.Tensor):
        forms.append(ds_tensor)
    return forms


def parameter_storages(params) -> dict[int, StorageWeakRef]:
    """Key -> weak reference of every storage held by `params` now. The weak reference keeps the storage
    object (not its bytes) alive, so a freed parameter storage's key cannot be taken by an activation."""
    out = {}
    for p in params:
        for form in parameter_forms(p):
            if form.device.type != "meta":
                out.setdefault(_storage_key(form), StorageWeakRef(form.untyped_storage()))
    return out


class ActivationProbe:
    """Count the bytes autograd saves for backward during a forward, deduplicated by storage.

    Parameters and views of parameters are not activations and are left out, in every form a strategy
    gives them (see `parameter_forms`). Which storages are parameters is read at pack time, because
    ZeRO-3 and FSDP2 gather weights into fresh storages only for the module running: a set taken
    before the forward holds only shards and placeholders. Each saved storage is attributed to the
    innermost module running when it was first saved (e.g. `gpt_neox.layers.0.attention.query_key_value`),
    so callers can sum by component.
    """

    def __init__(self, module: nn.Module, exclude: list[torch.Tensor] = ()):
        self.module = module
        self.extra = list(exclude)  # held, so their storages stay theirs
        self.seen: dict[int, tuple[int, str, StorageWeakRef]] = {}
        self._params: dict[int, StorageWeakRef] | None = None  # cache, refreshed at each module boundary
        self._stack: list[str] = []
        self._handles = []
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _parameter_keys(self) -> dict[int, StorageWeakRef]:
        # ZeRO-3 and FSDP2 gather and free weights in their module hooks (registered before ours, so run
        # first): a cache dropped at every module boundary is current when a tensor is saved, and its
        # weak references keep any stale entry from matching a new activation's storage.
        if self._params is None:
            self._params = parameter_storages([*self.module.parameters(), *self.extra])
        return self._params

    def is_parameter(self, t: torch.Tensor, local: torch.Tensor) -> bool:
        """`t` is a parameter, or `local` (its storage-holding form) shares storage with one (a view)."""
        if isinstance(t, nn.Parameter) or hasattr(t, "ds_id"):
            return True
        return _storage_key(local) in self._parameter_keys()

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            local = _local(t)
            key = _storage_key(local)
            if key not in self.seen and not self.is_parameter(t, local):
                storage = local.untyped_storage()
                # The weak reference pins the key: a later activation cannot reuse it and look "seen".
                self.seen[key] = (storage.nbytes(), self._stack[-1] if self._stack else "", StorageWeakRef(storage))
        return t

    def _enter_module(self, name: str):
        def hook(module, args):
            self._params = None
            self._stack.append(name)

        return hook

    def _leave_module(self, module, args, output):
        self._params = None
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
        return sum(nbytes for nbytes, _, _ in self.seen.values())

    def bytes_by_module(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for nbytes, name, _ in self.seen.values():
            out[name] += nbytes
        return dict(out)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict:
    """Peak tensor memory from the CUDA allocator, or the process RSS peak on CPU (a process figure,
    dominated by library code, not a tensor peak; in a rank forked by the rank server it counts only
    the library pages the rank touched, ~50 MiB less for the tiny model: `forked_process_rss`)."""
    if device.type == "cuda":
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)), "peak_kind": "cuda_max_allocated",
                "reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_kind": "forked_process_rss" if forked_by_rank_server() else "process_rss"}
