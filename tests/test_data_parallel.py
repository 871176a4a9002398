"""Data-parallel strategies reproduce the single-device reference under real torchrun (2 ranks, gloo)."""

import pytest

from conftest import assert_losses_match

pytestmark = pytest.mark.torchrun

DP_STRATEGIES = ["dp_naive", "dp_interleaved", "ddp"]


@pytest.mark.parity
@pytest.mark.parametrize("strategy", DP_STRATEGIES)
def test_dp_losses_match_single_device(strategy, run_strategy, reference_losses):
    summary, steps = run_strategy(strategy)
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == 2
    assert_losses_match([s["loss"] for s in steps], reference_losses)
    # Every rank holds a full replica: parameters, gradients and optimizer state are not sharded.
    ranks = summary["ranks"]
    assert ranks[0]["param_bytes"] == ranks[1]["param_bytes"] == ranks[0]["grad_bytes"]


@pytest.mark.parity
def test_dp_with_gradient_accumulation_matches(run_strategy, reference_losses):
    """Two micro-batches per rank: sync only after the last one, same global-batch gradient."""
    summary, steps = run_strategy("dp_interleaved", {"training": {"micro_batch_size": 2}})
    assert summary["status"] == "ok", summary["reason"]
    assert_losses_match([s["loss"] for s in steps], reference_losses)


@pytest.mark.parity
def test_parity_check_fails_without_gradient_averaging(run_strategy, reference_losses):
    """The comparison can fail: if ranks step on their local gradients, losses leave the reference."""
    summary, steps = run_strategy("dp_naive", {"training": {"fault_injection": "skip_grad_average"}})
    assert summary["status"] == "ok", summary["reason"]
    with pytest.raises(AssertionError, match="max \\|loss - reference\\|"):
        assert_losses_match([s["loss"] for s in steps], reference_losses)


def test_hand_written_dp_records_communication_time(run_strategy):
    summary, steps = run_strategy("dp_naive")
    assert summary["comm_time_median_s"] > 0
    assert all(s["comm_time_s"] is not None for s in steps)
