"""The hardware catalog (costs/hardware.yaml): every entry and link sourced, names matched most specific
first, the FLOPs per token that MFU divides by, and no link figure anywhere else."""

import ast
from pathlib import Path

import pytest

from shardlab.costs.hardware import accelerator, accelerators, by_name, catalog, links, device_peak_flops, training_flops_per_token

SRC = Path(__file__).parents[1] / "src" / "shardlab"


def test_every_entry_has_a_source_and_positive_figures():
    figures = ("bf16_tflops", "fp32_tflops", "hbm_gb", "hbm_tbps", "gpus_per_node", "nics_per_node", "host_link_gbps")
    for entry in accelerators():
        assert entry["source"] and (entry["match"] or entry.get("calibrated")), entry["name"]
        assert all(entry[k] > 0 for k in figures), entry["name"]
        flat = by_name(entry["name"])  # its links resolve
        assert 0 < flat["intra_node_busbw_share"] <= 1 and 0 < flat["network_busbw_share"] <= 1, entry["name"]
    for link in links().values():
        assert link["source"] and 0 < link["busbw_gbps"] <= link["nominal_gbps"], link["name"]


@pytest.mark.parametrize("device, name", [
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H100 80GB HBM3", "H100-80GB SXM"), ("NVIDIA H100 PCIe", "H100-80GB PCIe"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB SXM")])
def test_device_names_match_the_most_specific_entry(device, name):
    assert accelerator(device)["name"] == name


def test_an_unknown_device_has_no_peak():
    assert device_peak_flops("AMD EPYC", "bf16") is None
    assert device_peak_flops("NVIDIA H200", "bf16") == 989e12
    assert device_peak_flops("NVIDIA H200", "fp32") == 67e12  # FP32 proper: the runs leave TF32 off


def test_flops_per_token_is_6n_plus_attention():
    # GPT-3 175B at sequence 2048 (Narayanan et al. 2021): attention adds 12 * 96 * 12288 * 2048 per token.
    assert training_flops_per_token(175_000_000_000, 96, 12288, 2048) == 6 * 175e9 + 12 * 96 * 12288 * 2048


LINK_WORDS = ("gbps", "bandwidth", "latency", "busbw")


def _link_constants(path: Path, root: Path = SRC) -> list[str]:
    """Names bound to a number (assignments, keyword arguments, dict keys) that speak of bandwidth or latency."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        pairs = []
        if isinstance(node, ast.Assign):
            pairs = [(getattr(target, "id", ""), node.value) for target in node.targets]
        elif isinstance(node, ast.keyword):
            pairs = [(node.arg or "", node.value)]
        elif isinstance(node, ast.Dict):
            pairs = [(getattr(k, "value", ""), v) for k, v in zip(node.keys, node.values)]
        for name, value in pairs:
            number = isinstance(value, ast.Constant) and isinstance(value.value, (int, float)) and value.value
            if number and isinstance(name, str) and any(w in name.lower() for w in LINK_WORDS):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {name} = {value.value}")
    return found


def test_no_link_figures_outside_the_catalog():
    """Bandwidths and latencies of links live in hardware.yaml only: no module of the package binds one
    to a number (the one check `_link_constants` makes; it finds the figure planted in the test)."""
    offenders = [found for path in sorted(SRC.rglob("*.py")) for found in _link_constants(path)]
    assert not offenders, offenders
    assert {"nccl", "links", "accelerators"} <= set(catalog())


def test_the_link_check_finds_a_planted_figure(tmp_path):
    planted = tmp_path / "links.py"
    planted.write_text("NVLINK_LATENCY_US = 3\nLink(name='x', bandwidth_GBps=450.0)\n")
    assert len(_link_constants(planted, tmp_path)) == 2
