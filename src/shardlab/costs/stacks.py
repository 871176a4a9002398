"""Software stacks as data (`stacks.yaml`): what each can express, how it schedules its
communication, and the efficiencies its kernels and collectives reach per hardware generation.

A prediction is always for a stack (`--stack` on the command line, `stacks.yaml`'s `default`
otherwise): `figures` merges the accelerator's physical figures (`costs.hardware`), the stack's
schedule facts and its efficiencies for the accelerator's generation, and a cluster's what-ifs.
`rejection` says what a plan asks that the stack cannot run, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from shardlab.costs import hardware

CATALOG = Path(__file__).with_name("stacks.yaml")
KERNEL_FACTORS = ("gemm", "gemm_half_width", "gemm_half_tokens", "flash_attention", "flash_attention_half_keys",
                  "hbm", "elementwise_passes")


@dataclass(frozen=True)
class Stack:
    name: str
    description: str
    source: str
    frameworks: tuple[str, ...]
    recompute: tuple[str, ...]
    tp_overlap: bool
    grad_sync_overlap: bool
    param_gather_overlap: bool
    p2p_overlap: bool
    gathers_per_layer: int | str  # calls per layer a ZeRO-3 gather takes: a count, "modules" or "tensors"
    regather_for_recompute: bool = False
    cp_overlap: bool = True  # context parallelism's K/V exchange behind the attention blocks
    kernels_from: str | None = None
    fit: dict = field(default_factory=dict)  # generation -> factors calibration fits
    efficiencies: dict = field(default_factory=dict)  # generation -> factors, or {"borrow": stack}


@lru_cache(maxsize=1)
def catalog() -> dict:
    return yaml.safe_load(CATALOG.read_text())


@lru_cache(maxsize=1)
def stacks() -> dict[str, Stack]:
    out = {}
    for name, entry in catalog()["stacks"].items():
        out[name] = Stack(name=name, **{**entry, "frameworks": tuple(entry["frameworks"]),
                                        "recompute": tuple(entry["recompute"])})
    return out


def default() -> str:
    return catalog()["default"]


def get(name: str | None) -> Stack:
    """The stack called `name` (None: the default); a KeyError naming the known ones otherwise."""
    name = name or default()
    if name not in stacks():
        raise KeyError(f"unknown stack {name!r} (stacks.yaml: {', '.join(stacks())})")
    return stacks()[name]


def efficiencies(name: str, generation: str) -> tuple[dict, str]:
    """(the factors `name` runs at on `generation`, the stack whose calibration they come from:
    `name` itself, or the stack it borrows from; "" where only the generation's prior applies)."""
    factors, source = _efficiencies(name, generation)
    return dict(factors), source


@lru_cache(maxsize=64)
def _efficiencies(name: str, generation: str) -> tuple[dict, str]:
    stack, prior = get(name), catalog()["prior"][generation]
    entry = stack.efficiencies.get(generation)
    if entry is None:
        return dict(prior), ""
    if "borrow" in entry:
        return _efficiencies(entry["borrow"], generation)
    own = {**prior, **entry}
    if stack.kernels_from:  # the kernel factors the stack does not set itself
        kernels, _ = efficiencies(stack.kernels_from, generation)
        own.update({k: kernels[k] for k in KERNEL_FACTORS if k not in entry})
    return own, name if generation in stack.fit else ""


def calibrated(name: str, generation: str) -> bool:
    """Whether the stack's own published rows calibrate its efficiencies on `generation`."""
    return efficiencies(name, generation)[1] == name


def figures(accelerator: str, stack: str | None = None, overrides: dict | None = None) -> dict:
    """Everything a prediction reads of the hardware and the software: the accelerator's figures, the
    stack's schedule facts and efficiencies on the accelerator's generation, then `overrides` (what-ifs,
    or a machine the DAG calibrated)."""
    device = hardware.by_name(accelerator)
    s = get(stack)
    factors, _ = efficiencies(s.name, device["generation"])
    facts = {"stack": s.name, "tp_overlap_possible": s.tp_overlap, "grad_sync_overlap": s.grad_sync_overlap,
             "param_gather_overlap": s.param_gather_overlap, "p2p_overlap": s.p2p_overlap,
             "gathers_per_layer": s.gathers_per_layer, "regather_for_recompute": s.regather_for_recompute,
             "cp_overlap": s.cp_overlap,
             "reserved_memory_share": catalog()["reserved_memory_share"]}
    return {**device, **factors, **facts, **(overrides or {})}


def rejection(plan, stack: str | None) -> str | None:
    """Why `stack` cannot run `plan` (its sharding accounting, recompute or TP overlap), naming the field."""
    s = get(stack)
    if plan.framework not in s.frameworks:
        return f"framework: {s.name} does not run {plan.framework} sharding (it runs {', '.join(s.frameworks)})"
    if plan.recompute not in s.recompute:
        return f"recompute: {s.name} has no {plan.recompute!r} recompute (it has {', '.join(s.recompute)})"
    if plan.tp_overlap and not s.tp_overlap:
        return f"tp_overlap: {s.name} cannot overlap tensor-parallel collectives with compute"
    return None
