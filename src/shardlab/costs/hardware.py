"""Hardware as data (`hardware.yaml`, every figure with its source): accelerators (peak dense
throughput per dtype, HBM size and bandwidth, the node they come in), the links between them with
the bus bandwidth NCCL reaches on each, and NCCL's own latency model. Physical figures only: what a
software stack achieves on them is `costs.stacks`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

CATALOG = Path(__file__).with_name("hardware.yaml")


@lru_cache(maxsize=1)
def catalog() -> dict:
    return yaml.safe_load(CATALOG.read_text())


def accelerators() -> tuple[dict, ...]:
    return tuple(catalog()["accelerators"])


def links() -> dict[str, dict]:
    """The catalog's links by name."""
    return {link["name"]: link for link in catalog()["links"]}


def nccl() -> dict:
    """NCCL's tuning model: per algorithm and protocol, base and per-step latency (us) and bandwidth share."""
    return catalog()["nccl"]


def accelerator(device_name: str) -> dict | None:
    """The catalog entry whose `match` substring the device's name contains (first match), else None."""
    return next((a for a in accelerators() if any(m in device_name for m in a["match"])), None)


def peak_flops(device: dict, dtype: str) -> float:
    """Peak dense FLOP/s of a device's entry (or figures) for a training dtype. fp32 is true FP32: the
    parity rule's float32 bound assumes its rounding, so the runs leave TF32 matmuls off (torch's default)."""
    return device["fp32_tflops" if dtype == "fp32" else "bf16_tflops"] * 1e12


def device_peak_flops(device_name: str, dtype: str) -> float | None:
    """Peak dense FLOP/s of a device by its name for a training dtype; None when the catalog does not know it."""
    entry = accelerator(device_name)
    return peak_flops(entry, dtype) if entry else None


def training_flops_per_token(parameters: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 per parameter multiplied by (2 forward, 4 backward;
    `ModelShape.matmul_parameters`: no input embedding, a lookup) plus attention's score and value
    products, 12 * layers * hidden * seq_len (Narayanan et al. 2021, eq. 3, whose vocabulary term is
    the LM head's parameters)."""
    return 6 * parameters + 12 * num_layers * hidden_size * seq_len


def recomputed_flops_per_token(parameters: int, num_layers: int, hidden_size: int, seq_len: int,
                               recompute: str, op_share: float = 0.5) -> float:
    """Forward FLOPs per token that activation recompute runs again, which hardware FLOPs utilisation
    (HFU) and Megatron's TFLOP/s per GPU count and MFU does not: 'full' the whole forward (2 per
    parameter, so 8 instead of 6), 'selective' only attention's score and value products
    (4 x layers x hidden x seq_len; Korthikanti et al. 2022), 'op' (per-op selective checkpointing)
    the share `op_share` of the forward matrix products it does not save."""
    attention_core = 4 * num_layers * hidden_size * seq_len
    if recompute == "full":
        return 2 * parameters + attention_core
    if recompute == "op":
        return 2 * parameters * op_share
    return attention_core if recompute == "selective" else 0.0


def memory_bytes(device: dict) -> float:
    """A device's memory in bytes: vendors' "GB" of HBM are binary (an "80GB" H100 shows 81,559 MiB)."""
    return device["hbm_gb"] * 2**30


def by_name(name: str) -> dict:
    """The figures of the catalog entry called `name`, its links' flattened in: `intra_node_gbps` and
    `network_gbps` (nominal per direction, per GPU and per NIC), the share of them NCCL reaches
    (`*_busbw_share`), NVLink SHARP's gain on all-reduce (`nvls_gain`, 0 without it) and the kind of
    link an intra-node ring step crosses. A clear error naming the known entries otherwise."""
    entry = next((a for a in accelerators() if a["name"] == name), None)
    if entry is None:
        raise KeyError(f"unknown accelerator {name!r} (catalog {CATALOG.name}: "
                       f"{', '.join(a['name'] for a in accelerators())})")
    intra, network = links()[entry["intra_node_link"]], links()[entry["network_link"]]
    return {**entry,
            "intra_node_gbps": intra["nominal_gbps"], "intra_node_busbw_share": intra["busbw_gbps"] / intra["nominal_gbps"],
            "intra_node_hop": intra["kind"],
            "nvls_gain": intra.get("nvls_busbw_gbps", 0) / intra["busbw_gbps"],
            "network_gbps": network["nominal_gbps"], "network_busbw_share": network["busbw_gbps"] / network["nominal_gbps"],
            "nics_per_gpu": entry["nics_per_node"] / entry["gpus_per_node"]}
