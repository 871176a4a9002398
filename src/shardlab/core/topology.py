"""The one place that reads the launcher's environment and builds process groups and meshes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(preference: str = "auto") -> str:
    if preference == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("launch.device is 'cuda' but torch sees no CUDA device")
    return preference


def pick_backend(device_type: str, preference: str = "auto") -> str:
    if preference == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    return preference


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: timedelta = timedelta(seconds=300)  # launch.collective_timeout_s, for every group
    _meshes: dict = field(default_factory=dict, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mesh(self, **dims: int):
        """A device mesh with named dimensions, e.g. `topo.mesh(dp=2, tp=2)`; built once per shape."""
        from torch.distributed.device_mesh import init_device_mesh

        key = tuple(dims.items())
        if key not in self._meshes:
            shape = tuple(dims.values())
            if int(torch.tensor(shape).prod()) != self.world_size:
                raise ValueError(f"mesh {dims} needs {int(torch.tensor(shape).prod())} ranks, world size is {self.world_size}")
            options = {name: self._group_options() for name in dims}
            self._meshes[key] = init_device_mesh(self.device.type, shape, mesh_dim_names=tuple(dims),
                                                 backend_override=options)
        return self._meshes[key]

    def flattened(self, mesh, *dims: str):
        """Dimensions `dims` of `mesh` as one 1-D mesh (e.g. the dp x cp ranks that hold the same replica
        of a parameter), built once."""
        if len(dims) == 1:
            return mesh[dims[0]]
        key = (mesh.mesh_dim_names, tuple(mesh.shape), dims)
        if key not in self._meshes:
            self._meshes[key] = mesh[dims]._flatten("_".join(dims), backend_override=self._group_options())
        return self._meshes[key]

    def _group_options(self):
        """Backend options that carry the collective timeout: a mesh's sub-groups otherwise wait the
        backend's default (30 min for gloo), and a rank hung in one would outlive collective_timeout_s."""
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return options
        from torch._C._distributed_c10d import Backend  # the generic options class (gloo takes it)

        return Backend.Options(self.backend, self.timeout)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()


def init_topology(launch: dict) -> Topology:
    """Join the process group torchrun set up (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device_type = pick_device(launch.get("device", "auto"))
    backend = pick_backend(device_type, launch.get("backend", "auto"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(launch.get("threads_per_rank", 1))
    timeout = timedelta(seconds=launch.get("collective_timeout_s", 300))  # a hung peer fails the run
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device_type == "cuda" else None)
    return Topology(rank, world_size, local_rank, device, backend, timeout)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
