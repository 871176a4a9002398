"""Accelerators' figures for the cost models, read from `hardware.yaml` (each value with its
source): peak dense throughput per dtype, HBM size and bandwidth, NVLink bandwidth. Used today for
model FLOPs utilisation (MFU) in the GPU check.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

CATALOG = Path(__file__).with_name("hardware.yaml")


@lru_cache(maxsize=1)
def accelerators() -> tuple[dict, ...]:
    return tuple(yaml.safe_load(CATALOG.read_text())["accelerators"])


def accelerator(device_name: str) -> dict | None:
    """The catalog entry whose `match` substring the device's name contains (first match), else None."""
    return next((a for a in accelerators() if any(m in device_name for m in a["match"])), None)


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device by its name; None when the catalog does not know it."""
    entry = accelerator(device_name)
    return entry["bf16_tflops"] * 1e12 if entry else None


def training_flops_per_token(parameters: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 per parameter (2 forward, 4 backward) plus attention's
    score and value products, 12 * layers * hidden * seq_len (Narayanan et al. 2021, eq. 3 without
    the vocabulary term, which the parameters already count)."""
    return 6 * parameters + 12 * num_layers * hidden_size * seq_len


def recomputed_flops_per_token(parameters: int, num_layers: int, hidden_size: int, seq_len: int,
                               recompute: str) -> float:
    """Forward FLOPs per token that activation recompute ('none', 'selective', 'full') runs again,
    which hardware FLOPs utilisation (HFU) and Megatron's TFLOP/s per GPU count and MFU does not:
    full recompute the whole forward (2 per parameter, so 8 instead of 6), selective only attention's
    score and value products (4 x layers x hidden x seq_len; Korthikanti et al. 2022)."""
    attention_core = 4 * num_layers * hidden_size * seq_len
    if recompute == "full":
        return 2 * parameters + attention_core
    return attention_core if recompute == "selective" else 0.0


def memory_bytes(device: dict) -> float:
    """A device's memory in bytes: vendors' "GB" of HBM are binary (an "80GB" H100 shows 81,559 MiB)."""
    return device["hbm_gb"] * 2**30


def by_name(name: str) -> dict:
    """The catalog entry called `name`, with the efficiencies merged in (the shared ones, then the
    entry's own calibrated ones); a clear error naming the known entries otherwise."""
    entry = next((a for a in accelerators() if a["name"] == name), None)
    if entry is None:
        raise KeyError(f"unknown accelerator {name!r} (catalog {CATALOG.name}: "
                       f"{', '.join(a['name'] for a in accelerators())})")
    own = {k: v for k, v in entry.items() if k != "efficiencies"}
    return {**efficiencies(), **entry.get("efficiencies", {}), **own}


@lru_cache(maxsize=1)
def efficiencies() -> dict:
    return dict(yaml.safe_load(CATALOG.read_text())["efficiencies"])
