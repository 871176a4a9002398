"""The parity tolerance (shardlab.tables.parity) and what it must cover: the reference is reproducible on one
machine, and another CPU's kernels or another thread count stay inside the tolerance, while the
can-fail tests (no gradient averaging) stay far outside it."""

from __future__ import annotations

import math

import pytest

from conftest import TEST_TOKENS_PER_STEP, assert_losses_match, launch_test_run
from shardlab.tables.parity import UNIT_ROUNDOFF, loss_tolerance, max_deviation, tolerance


def test_tolerance_grows_with_magnitude_steps_and_reduction_length():
    base = tolerance(5.0, 256, steps=6)
    assert base == pytest.approx(4 * 6 * 16 * 2.0**-24 * 5.0)
    assert tolerance(10.0, 256, steps=6) == pytest.approx(2 * base)
    assert tolerance(5.0, 256, steps=12) == pytest.approx(2 * base)
    assert tolerance(5.0, 1024, steps=6) == pytest.approx(2 * base)
    assert tolerance(5.0, 256, steps=6, dtype="bf16") == pytest.approx(base * UNIT_ROUNDOFF["bf16"] / UNIT_ROUNDOFF["fp32"])


def test_loss_tolerance_uses_the_largest_loss_and_every_step():
    assert loss_tolerance([4.0, -6.0, 5.0], 100) == pytest.approx(tolerance(6.0, 100, steps=3))


def test_unknown_dtype_and_mismatched_lengths_are_errors():
    with pytest.raises(ValueError, match="fp16"):
        tolerance(1.0, 10, dtype="fp16")
    with pytest.raises(ValueError, match="2 values against 3"):
        max_deviation([1.0, 2.0], [1.0, 2.0, 3.0])


def test_tolerance_is_far_below_a_missing_gradient_average():
    """Not vacuous by construction: at the test's size the tolerance is ~1e-4 on losses near 6, while
    a strategy that steps on half-batch gradients moves the loss by ~1e-2 (test_data_parallel)."""
    tol = loss_tolerance([6.0] * 6, TEST_TOKENS_PER_STEP)
    assert 1e-5 < tol < 2e-4
    assert math.isclose(tol, 4 * 6 * math.sqrt(TEST_TOKENS_PER_STEP) * 2.0**-24 * 6.0)


@pytest.mark.torchrun
@pytest.mark.parity
def test_reference_is_reproducible_and_other_kernels_stay_within_tolerance(tiny_assets, tmp_path, monkeypatch,
                                                                           reference_losses):
    """The single-device reference twice with the same settings gives the same bits (deterministic
    kernels, pinned threads); with torch's portable kernels (ATEN_CPU_CAPABILITY=default, what a CPU
    without AVX2/AVX-512 would run) and 2 threads it differs by rounding only, inside the tolerance.
    This stands in for CI's other CPU."""
    _, again = launch_test_run(tiny_assets, tmp_path / "again", "single")
    assert [s["loss"] for s in again] == reference_losses

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    summary, other = launch_test_run(tiny_assets, tmp_path / "other", "single", {"launch": {"threads_per_rank": 2}})
    assert summary["status"] == "ok", summary["reason"]
    assert_losses_match([s["loss"] for s in other], reference_losses)
