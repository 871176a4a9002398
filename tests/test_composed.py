"""Composed plans (strategy `composed`): a Plan's degrees on one mesh, dp x tp (+sp), under real torchrun on 4
ranks: the single-device loss by the parity rule, a can-fail run without the data-parallel reduction, every
rank's memory against the one cost model's prediction for the same Plan, and bad degrees rejected by name."""

from __future__ import annotations

import copy

import pytest

from conftest import TEST_EXPERIMENT, assert_losses_match
from shardlab.config import deep_merge
from shardlab.costs.plan import Workload
from shardlab.costs.predict import rank_activations, rank_states
from shardlab.costs.shapes import ModelShape
from shardlab.errors import ConfigError
from shardlab.strategies import get_spec

STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")


def overrides(sp: bool = False, **training) -> dict:
    return {"strategy_options": {"composed": {"world_size": 4, "tp": 2, "sp": sp}}, "training": training}


@pytest.mark.parity
@pytest.mark.torchrun
@pytest.mark.parametrize("sp", [False, True], ids=["dp2-tp2", "dp2-tp2-sp"])
def test_composed_dp_tp_matches_single_and_its_prediction(sp, run_once, reference_losses):
    summary, steps = run_once("composed", overrides(sp))
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == 4
    assert_losses_match([s["loss"] for s in steps], reference_losses)
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), overrides(sp))
    spec, model = get_spec("composed"), ModelShape.from_dict(TEST_EXPERIMENT["model"])
    plan = spec.run_plan(exp, 4)
    assert (plan.dp, plan.tp, plan.sp) == (2, 2, sp)
    for rank in summary["ranks"]:
        want = rank_states(model, plan, rank["rank"])
        for key in STATES:
            assert rank[key] == pytest.approx(getattr(want, key), rel=0.01), (key, rank["rank"])
        predicted = rank_activations(model, plan, Workload.from_training(exp["training"]), rank["rank"])
        assert rank["activation_bytes"] == pytest.approx(predicted, rel=0.10), rank["rank"]


@pytest.mark.torchrun
def test_composed_fails_parity_without_the_data_parallel_reduction(run_strategy, reference_losses):
    """The check can fail: replicas stepping on their own half of the batch leave the reference."""
    summary, steps = run_strategy("composed", overrides(fault_injection="skip_grad_average"))
    assert summary["status"] == "ok", summary["reason"]
    with pytest.raises(AssertionError, match="max \\|loss - reference\\|"):
        assert_losses_match([s["loss"] for s in steps], reference_losses)


@pytest.mark.parametrize("options, field, problem", [
    ({"world_size": 4, "tp": 3}, "strategy_options.composed.tp", "does not divide the world size"),
    ({"world_size": 6, "tp": 3}, "model.num_heads", "not divisible by the tensor-parallel degree 3"),
    ({"world_size": 4, "tp": 1, "sp": True}, "strategy_options.composed.sp", "needs tp > 1"),
    ({"world_size": 4, "tp": "two"}, "strategy_options.composed.tp", "positive integer"),
    ({"world_size": 4, "pp": 2}, "strategy_options.composed.pp", "unknown option"),
])
def test_bad_degrees_are_rejected_by_name(options, field, problem):
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"strategy_options": {"composed": options}})
    with pytest.raises(ConfigError, match=problem) as err:
        get_spec("composed").check(exp, "experiments.test")
    assert err.value.field == f"experiments.test.{field}"
