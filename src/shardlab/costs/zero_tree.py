"""The ZeRO decision tree: pick a rung from model size, device memory and device count.

A view of the planner's memory model (`costs.rank_memory.model_states` of a pure data-parallel
plan, which is `costs.sharded_states`'s accounting): walk the ladder from the cheapest communication to the most
(ZeRO-0/1/2 move 2Ψ per step like plain data parallelism, ZeRO-3 1.5x that, offload adds host
transfers and a CPU optimizer step) and take the first rung whose model states at their peak fit in
the device memory left after a margin for activations, communication buckets and allocator
fragmentation (`headroom`, default 25 % of the device). Offloaded state must also fit in host memory.

The rungs are the registry's (`shardlab.strategies.zero.RUNGS`, passed in as Plan fields); the
command line is `shardlab.strategies.zero.tree`:

    python -m shardlab plan-zero --params 6.9e9 --gpus 2 --gpu-mem 80GB
"""

from __future__ import annotations

import re

from shardlab.costs.plan import Plan
from shardlab.costs.rank_memory import model_states

DEFAULT_HEADROOM = 0.25
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> float:
    """'80GB' -> 8e10, '24GiB' -> 24*2**30, '1e9' -> 1e9."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read a memory size from '{text}' (e.g. 80GB, 24GiB, 1e9)")
    return float(m.group(1)) * _UNITS[m.group(2).upper()]


def feasibility(rungs: dict[str, dict], n_params: float, gpus: int, gpu_mem: float, dtype: str = "bf16",
                optimizer: str = "adamw", headroom: float = DEFAULT_HEADROOM, host_mem: float | None = None) -> list[dict]:
    """One row per rung (`rungs`: name -> Plan fields, in ladder order): predicted peak device bytes
    per rank, the budget, and whether it fits."""
    budget = gpu_mem * (1 - headroom)
    rows = []
    for rung, fields in rungs.items():
        states = model_states(data_parallel_plan(fields, gpus, dtype, optimizer), n_params, 0)
        host_needed = states.offloaded_bytes * gpus  # every rank's offloaded share lives on the same host
        fits_device = states.device_peak_bytes <= budget
        fits_host = host_mem is None or host_needed <= host_mem
        rows.append({"rung": rung, "device_peak_bytes": states.device_peak_bytes, "budget_bytes": budget,
                     "host_bytes": host_needed, "fits": fits_device and fits_host,
                     "why": ("fits" if fits_device and fits_host else
                             "model states exceed the device budget" if not fits_device else
                             "offloaded state exceeds host memory")})
    return rows


def data_parallel_plan(fields: dict, gpus: int, dtype: str, optimizer: str) -> Plan:
    """The planner's plan for a rung of the ladder (its Plan fields): every device a data-parallel rank."""
    return Plan(**{**fields, "dp": gpus, "dtype": dtype, "optimizer": optimizer})


def choose(rows: list[dict]) -> str | None:
    """The first rung on the ladder that fits (least communication), or None: shard further (TP/PP)."""
    return next((r["rung"] for r in rows if r["fits"]), None)
