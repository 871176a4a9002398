"""The parity rule (shardlab.tables.parity) and what it must do: a float32 bound where that is tight, a
tolerance from a measured noise floor everywhere else (bf16, large float32 batches), undecided rather
than passed where it cannot tell a bug from rounding; the reference reproducible on one machine; and,
under real torchrun, every injected error caught in fp32 and bf16 while correct strategies pass."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from helpers import TEST_EXPERIMENT, TEST_TOKENS_PER_STEP, assert_losses_match, launch_test_run
from shardlab.config import deep_merge
from shardlab.tables.parity import (CEILING, NOISE_MULTIPLE, UNIT_ROUNDOFF, floor_runs, loss_tolerance, max_deviation,
                                    needs_noise_floor, parity_rows, planned_tolerance, sensitivity_rows, tolerance)


def test_tolerance_grows_with_magnitude_steps_and_reduction_length():
    base = tolerance(5.0, 256, steps=6)
    assert base == pytest.approx(4 * 6 * 16 * 2.0**-24 * 5.0)
    assert tolerance(10.0, 256, steps=6) == pytest.approx(2 * base)
    assert tolerance(5.0, 256, steps=12) == pytest.approx(2 * base)
    assert tolerance(5.0, 1024, steps=6) == pytest.approx(2 * base)
    assert tolerance(5.0, 256, steps=6, dtype="bf16") == pytest.approx(base * UNIT_ROUNDOFF["bf16"] / UNIT_ROUNDOFF["fp32"])


def test_small_float32_runs_use_the_bound_and_everything_else_a_measured_floor():
    small = {"dtype": "fp32", "steps": 6, "global_batch_size": 8, "seq_len": 32}
    assert not needs_noise_floor(small)
    assert needs_noise_floor(dict(small, dtype="bf16"))
    assert needs_noise_floor(dict(small, steps=100, global_batch_size=2048, seq_len=512))  # 1M tokens: bound 2.4 %
    allowed = loss_tolerance([4.0, -6.0, 5.0], 100)
    assert allowed.value == pytest.approx(tolerance(6.0, 100, steps=3)) and allowed.basis == "float32 rounding bound"
    assert allowed.fraction == pytest.approx(allowed.value / 6.0)


def test_a_measured_floor_sets_the_tolerance_with_a_float32_floor_of_its_own():
    losses = [5.0] * 8
    allowed = loss_tolerance(losses, 1024, "bf16", noise_floor=1e-3)
    assert allowed.value == pytest.approx(NOISE_MULTIPLE * 1e-3) and allowed.undecided is None
    exact = loss_tolerance(losses, 1024, "bf16", noise_floor=0.0)  # a floor measured as exactly zero
    assert exact.value == pytest.approx(tolerance(5.0, 1, steps=8)) and exact.value > 0


def test_the_rule_is_undecided_without_a_floor_or_beyond_the_ceiling():
    assert "no noise floor" in loss_tolerance([6.0] * 6, 256, "bf16").undecided
    assert "no noise floor" in loss_tolerance([6.0] * 100, 2**20, "fp32").undecided
    too_noisy = loss_tolerance([6.0] * 6, 256, "bf16", noise_floor=CEILING * 6.0)
    assert too_noisy.undecided and "ceiling" in too_noisy.undecided


def test_the_tolerance_catches_small_errors_where_the_rule_says():
    """Not vacuous by construction: at the test's size the bound is ~1e-4 on losses near 6 (2.4e-5 of the
    loss), and a bf16 tolerance from a floor of 1e-3 is 5e-3 (0.08 %), far below a missing gradient average's
    ~1 and the 5 % ceiling."""
    tol = loss_tolerance([6.0] * 6, TEST_TOKENS_PER_STEP).value
    assert 1e-5 < tol < 2e-4
    assert math.isclose(tol, 4 * 6 * math.sqrt(TEST_TOKENS_PER_STEP) * 2.0**-24 * 6.0)
    assert loss_tolerance([6.0] * 6, TEST_TOKENS_PER_STEP, "bf16", noise_floor=1e-3).fraction < 1e-3


def test_unknown_dtype_and_mismatched_lengths_are_errors():
    with pytest.raises(ValueError, match="fp16"):
        tolerance(1.0, 10, dtype="fp16")
    with pytest.raises(ValueError, match="2 values against 3"):
        max_deviation([1.0, 2.0], [1.0, 2.0, 3.0])


def test_planned_tolerance_says_which_estimate_before_anything_runs():
    small = {"dtype": "fp32", "steps": 6, "global_batch_size": 8, "seq_len": 32}
    assert planned_tolerance({"training": small}).endswith("float32 bound, 0.0023% of the loss")
    bf16 = planned_tolerance({"training": dict(small, dtype="bf16")})
    assert "noise floor" in bf16 and "at most 5%" in bf16


def _summary(experiment, strategy, losses, status="ok"):
    return {"experiment": experiment, "strategy": strategy, "status": status,
            "step_log": [{"step": i, "loss": x} for i, x in enumerate(losses)]}


def test_parity_rows_rest_on_the_floor_runs_and_say_when_they_cannot_decide():
    training = {"dtype": "bf16", "steps": 4, "global_batch_size": 8, "seq_len": 32}
    experiments = {"e": {"training": training}}
    ref = [5.0, 4.0, 3.0, 2.5]
    shift = lambda d: [x + d for x in ref]  # noqa: E731
    summaries = [_summary("e", "single", ref), _summary("e", "single_reordered", shift(1e-3)),
                 _summary("e", "deepspeed_single", shift(5e-3)), _summary("e", "ddp", shift(3e-3)),
                 _summary("e", "tp", shift(6e-3)), _summary("e", "zero3", shift(1.5e-2))]
    rows = parity_rows(summaries, experiments).set_index("strategy")
    assert set(rows.index) == {"ddp", "tp", "zero3"}  # the noise-floor runs are no comparisons of their own
    assert rows.loc["ddp", "within_tolerance"] and rows.loc["ddp", "tolerance"] == pytest.approx(NOISE_MULTIPLE * 1e-3)
    assert not rows.loc["tp", "within_tolerance"]  # 6e-3 against 5 x 1e-3: a deviation of 6 floors is caught
    # ZeRO-3 in bf16 also allows for DeepSpeed's own recipe, measured by its one-process twin
    assert floor_runs("zero3", "bf16") == ["single_reordered", "deepspeed_single"] and floor_runs("zero3", "fp32") == [
        "single_reordered"]
    assert rows.loc["zero3", "noise_floor"] == pytest.approx(5e-3) and rows.loc["zero3", "within_tolerance"]
    without_twin = parity_rows([s for s in summaries if s["strategy"] != "deepspeed_single"], experiments)
    zero3 = without_twin.set_index("strategy").loc["zero3"]
    assert pd.isna(zero3["within_tolerance"]) and "no noise floor" in zero3["undecided"]


def test_sensitivity_rows_judge_each_injected_error_by_the_rule():
    ref = [5.0, 4.0, 3.0]
    cases = [("reference", "single", "none", "pass", 0.0), ("noise floor", "single_reordered", "none", "pass", 1e-3),
             ("correct", "ddp", "none", "pass", 2e-3), ("x 1.01", "ddp", "grad_scaled_rank1", "fail", 2e-2),
             ("x 1.001", "ddp", "grad_scaled_rank1", "either", 1e-3), ("missed", "tp", "tp_allreduce_skipped", "fail", 1e-3)]
    rows = [{"experiment": "e", "dtype": "bf16", "case": c, "strategy": s, "injected": i, "gradient_error": None,
             "expected": x, "status": "ok", "reason": None, "step": k, "loss": v + d}
            for c, s, i, x, d in cases for k, v in enumerate(ref)]
    table = sensitivity_rows(pd.DataFrame(rows), {"e": {"training": {"dtype": "fp32", "steps": 3, "global_batch_size": 8,
                                                                     "seq_len": 32}}}).set_index("case")
    assert table.loc["correct", "outcome"] == "pass" and table.loc["x 1.01", "outcome"] == "fail"
    assert table.loc["x 1.001", "as_expected"] and not table.loc["missed", "as_expected"]
    failed = sensitivity_rows(pd.DataFrame([{"experiment": "e", "dtype": "bf16", "status": "failed", "reason": "boom"}]), {})
    assert failed["status"].tolist() == ["failed"] and failed["reason"].tolist() == ["boom"]


def test_the_reordered_reference_is_the_same_math_in_another_order():
    """Split-K linear layers equal the plain ones to rounding (float64), and each micro-batch splits in two."""
    from torch import nn

    from shardlab.strategies.single import smaller_micro_batch, split_reduction_forward

    linear = nn.Linear(6, 3).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    assert torch.allclose(split_reduction_forward(linear, x), linear(x), rtol=0, atol=1e-12)
    assert [smaller_micro_batch(n) for n in (2, 8, 9, 7)] == [1, 4, 3, 1]
    with pytest.raises(ValueError, match="one sequence"):
        smaller_micro_batch(1)


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


# The settings of the default study's parity_bf16 experiment: SGD at lr 0.1 for 4 steps of 32 x 32 tokens
# moves the loss from 5.6 to 4.1; a gradient error grows steadily, rounding differences have not yet grown
# chaotically and average out over the batch.
SENSITIVITY_TRAINING = {"lr": 0.1, "steps": 4, "global_batch_size": 32}


@pytest.fixture(scope="module")
def sensitivity(tiny_assets, tmp_path_factory):
    """The sensitivity benchmark under real torchrun (2 ranks, gloo) in fp32 and bf16, judged by the rule."""
    from shardlab.bench.parity_sensitivity import main

    model_dir, tokens = tiny_assets
    root = tmp_path_factory.mktemp("sensitivity")
    exp = deep_merge(json.loads(json.dumps(TEST_EXPERIMENT)), {"training": SENSITIVITY_TRAINING})
    (root / "exp.json").write_text(json.dumps(exp))
    main(["--experiment-config", str(root / "exp.json"), "--model-dir", str(model_dir), "--tokens", str(tokens),
          "--out", str(root / "losses.csv"), "--timeout-s", "600"])
    losses = pd.read_csv(root / "losses.csv")
    assert (losses["status"] == "ok").all(), losses["reason"].dropna().tolist()
    return losses, sensitivity_rows(losses, {exp["name"]: exp})


@pytest.mark.torchrun
@pytest.mark.parity
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_injected_error_fails_and_every_correct_strategy_passes(sensitivity, dtype):
    """Gradients summed instead of averaged, rank 1's gradient x 1.01 (0.5 % of the mean gradient), one TP
    all-reduce skipped, one pipeline micro-batch dropped: each outside the tolerance;
    DDP, TP and 1F1B without them inside it. The tolerance stays a small fraction of the loss."""
    table = sensitivity[1]
    rows = table[table["dtype"] == dtype]
    assert rows["as_expected"].all(), rows.loc[~rows["as_expected"], ["case", "strategy", "outcome"]].to_dict("records")
    assert (rows.loc[rows["expected"] == "fail", "outcome"] == "fail").sum() == 4
    assert rows["tolerance_fraction"].max() < 2e-3
    for row in rows.itertuples():  # every comparison logged for scripts/parity-across-cpus.sh
        from helpers import assert_within

        if row.expected == "pass":
            assert_within(f"sensitivity {dtype}: {row.strategy}", row.max_loss_deviation, row.tolerance)


@pytest.mark.torchrun
def test_pipeline_stages_run_under_autocast_in_bf16(sensitivity):
    """A pipeline told bf16 computes in bf16 (its stages run under autocast). One that ignored the dtype ran
    float32 math in both dtypes, bit for bit the same losses, and passed the old bf16 rule."""
    losses = sensitivity[0]
    curve = lambda dtype: losses[(losses["dtype"] == dtype) & (losses["strategy"] == "pp_1f1b")  # noqa: E731
                                 & (losses["injected"] == "none")].sort_values("step")["loss"].tolist()
    assert curve("bf16") != curve("fp32")
