"""Accelerators' peak dense bf16 throughput, for model FLOPs utilisation (MFU). Values are the
vendors' datasheet figures *without* structured sparsity (datasheets print the sparse figure, 2x,
first). Matched against `torch.cuda.get_device_name()` by substring, most specific first.

Sources: NVIDIA H200 Tensor Core GPU datasheet (H200 SXM: 989 TFLOPS bf16 dense); NVIDIA H100
datasheet (SXM 989, PCIe 756); NVIDIA A100 datasheet (312, SXM and PCIe); NVIDIA L40S datasheet (362).
"""

from __future__ import annotations

PEAK_BF16_FLOPS = {  # device-name substring -> FLOP/s
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
}


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of a device by its name; None when the catalog does not know it."""
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return flops
    return None


def training_flops_per_token(parameters: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 per parameter (2 forward, 4 backward) plus attention's
    score and value products, 12 * layers * hidden * seq_len (Narayanan et al. 2021, eq. 3 without
    the vocabulary term, which the parameters already count)."""
    return 6 * parameters + 12 * num_layers * hidden_size * seq_len
