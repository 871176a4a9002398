"""The hardware catalog (costs/hardware.yaml): every entry sourced, names matched most specific first,
and the FLOPs per token that MFU divides by."""

import pytest

from shardlab.costs.hardware import accelerator, accelerators, peak_bf16_flops, training_flops_per_token


def test_every_entry_has_a_source_and_positive_figures():
    planner = ("bf16_tflops", "fp32_tflops", "hbm_gb", "hbm_tbps", "nvlink_gbps", "gpus_per_node", "network_gbps",
               "host_link_gbps")
    for entry in accelerators():
        assert entry["source"] and (entry["match"] or entry.get("calibrated")), entry["name"]
        assert all(entry[k] > 0 for k in planner), entry["name"]


@pytest.mark.parametrize("device, name", [
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H100 80GB HBM3", "H100-80GB SXM"), ("NVIDIA H100 PCIe", "H100-80GB PCIe"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB SXM")])
def test_device_names_match_the_most_specific_entry(device, name):
    assert accelerator(device)["name"] == name


def test_an_unknown_device_has_no_peak():
    assert peak_bf16_flops("AMD EPYC") is None
    assert peak_bf16_flops("NVIDIA H200") == 989e12


def test_flops_per_token_is_6n_plus_attention():
    # GPT-3 175B at sequence 2048 (Narayanan et al. 2021): attention adds 12 * 96 * 12288 * 2048 per token.
    assert training_flops_per_token(175_000_000_000, 96, 12288, 2048) == 6 * 175e9 + 12 * 96 * 12288 * 2048
