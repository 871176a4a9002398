"""The plan-independent training state: every parameter and its optimizer state (AdamW's moments and
step count) under the model's own names, whole, whatever plan held it. A strategy says what each rank
holds (`Strategy.held_parameters`: one `Held` per parameter, with how to make it whole and how to cut
this rank's piece from the whole); `gather` and `Strategy.restore` do the rest, so that a checkpoint
written by one plan loads into any other: the cut is the reshard.

Whole tensors on the main rank are the simple layout for the models this study trains on one host;
at scale a checkpoint would keep DCP shards with global offsets instead (torchtitan, Megatron-Core).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

SEPARATOR = "::"  # optimizer-state keys on disk: "<parameter name>::<state key>"


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class Held:
    """One parameter as this rank holds it: `name` in the whole model, the local tensor `param` (a shard, a
    DTensor or the whole), the whole `shape`, `whole` (collective over the ranks that split it: this rank's
    piece of the parameter, or of a tensor shaped like it, to the whole) and `cut` (the whole to this rank's
    piece). A replicated parameter is its own whole."""

    name: str
    param: torch.Tensor
    shape: torch.Size
    whole: Callable[[torch.Tensor], torch.Tensor] = field(default=_as_is)
    cut: Callable[[torch.Tensor], torch.Tensor] = field(default=_as_is)


def as_held(name: str, param: torch.Tensor) -> Held:
    """A parameter held whole, or as a DTensor (FSDP2, DTensor TP), whose mesh and placements say the cut."""
    if not hasattr(param, "device_mesh"):
        return Held(name, param, param.shape, cut=lambda w: w.to(param.device))
    from torch.distributed.tensor import distribute_tensor

    mesh, placements = param.device_mesh, param.placements
    return Held(name, param, param.shape, whole=lambda t: t.full_tensor(),
                cut=lambda w: distribute_tensor(w.to(param.device), mesh, placements, src_data_rank=None))


def chunked(name: str, param: torch.Tensor, dim: int, group) -> Held:
    """A parameter cut by hand into equal chunks along `dim` over `group` (Megatron-style TP)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = list(param.shape)
    shape[dim] *= size

    def whole(t: torch.Tensor) -> torch.Tensor:
        chunks = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(chunks, t.contiguous(), group=group)
        return torch.cat(chunks, dim=dim)

    return Held(name, param, torch.Size(shape), whole=whole,
                cut=lambda w: w.chunk(size, dim=dim)[rank].to(param.device).contiguous())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (DTensor) or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t).detach().to("cpu", copy=True).contiguous()


@dataclass
class State:
    """The whole training state on the main rank: parameters and optimizer states by name."""

    parameters: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, torch.Tensor]]

    def flat_optimizer(self) -> dict[str, torch.Tensor]:
        return {f"{name}{SEPARATOR}{key}": t for name, states in self.optimizer.items() for key, t in states.items()}


def gather(strategy, with_optimizer: bool = True) -> State | None:
    """The whole state on the main rank (None elsewhere); collective: every rank calls it."""
    held = strategy.held_parameters()
    wholes = strategy.whole_state(held, with_optimizer)
    keeps = strategy.topo.is_main or not strategy.holds_every_parameter
    mine = {h.name: (_to_cpu(p), {k: _to_cpu(v) for k, v in states.items()})
            for h, (p, states) in zip(held, wholes)} if keeps else {}
    if not strategy.holds_every_parameter:  # pipeline stages, experts: the main rank collects the others'
        everyone = [None] * dist.get_world_size() if strategy.topo.is_main else None
        dist.gather_object(mine, everyone, dst=0)
        mine = {name: value for part in everyone for name, value in part.items()} if strategy.topo.is_main else {}
    if not strategy.topo.is_main:
        return None
    return State({name: p for name, (p, _) in mine.items()}, {name: s for name, (_, s) in mine.items() if s})


def whole_state(held: list[Held], local_states: list[dict]) -> list[tuple[torch.Tensor, dict]]:
    """Each held parameter and its optimizer states made whole (a state shaped like the parameter is split as
    it is; a scalar such as AdamW's step is the same everywhere)."""
    return [(h.whole(h.param.detach()),
             {k: h.whole(v) if v.shape == h.param.shape else v for k, v in states.items()})
            for h, states in zip(held, local_states)]


def cut_states(h: Held, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's piece of a parameter's whole optimizer states."""
    return {k: h.cut(v) if v.shape == h.shape else v.clone() for k, v in states.items()}


def check_names(strategy, held: list[Held], shapes: dict[str, tuple]) -> None:
    """The target (`held`: what this rank of `strategy` holds) must hold exactly the checkpoint's parameters
    (`shapes`: name -> whole shape) with their shapes: a clear error naming the differences otherwise (before
    anything is loaded). Collective where ranks hold different parameters."""
    held = {h.name: tuple(h.shape) for h in held}
    if not strategy.holds_every_parameter:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, held)
        held = {name: shape for part in everyone for name, shape in part.items()}
    missing, extra = sorted(set(held) - set(shapes)), sorted(set(shapes) - set(held))
    reshaped = sorted(n for n in set(held) & set(shapes) if held[n] != tuple(shapes[n]))
    problems = []
    if missing:
        problems.append(f"the checkpoint lacks {len(missing)} parameter(s) the target holds ({', '.join(missing[:3])})")
    if extra:
        problems.append(f"the target has no place for {len(extra)} of the checkpoint's parameter(s) ({', '.join(extra[:3])})")
    if reshaped:
        problems.append("shapes differ: " + ", ".join(f"{n} {tuple(shapes[n])} in the checkpoint, {held[n]} in the target"
                                                      for n in reshaped[:3]))
    if problems:
        raise IncompatibleCheckpoint(f"{strategy.name}: " + "; ".join(problems))


class IncompatibleCheckpoint(ValueError):
    """A checkpoint the run cannot continue from (another model, optimizer, or a state the plan cannot hold)."""
