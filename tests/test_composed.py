"""Composed plans (strategy `composed`): a Plan's degrees on one (pp, dp, cp, tp) mesh under real torchrun,
every technique composed with at least one other on 4 ranks and a 3-D plan on 8: the single-device loss by the
parity rule, can-fail runs without one dimension's reduction, every rank's memory against the one cost model's
prediction for the same Plan, and bad degrees rejected by name before anything runs."""

from __future__ import annotations

import copy

import pytest

from helpers import TEST_EXPERIMENT, assert_losses_match
from shardlab.config import deep_merge
from shardlab.costs.plan import Workload
from shardlab.costs.predict import rank_activations, rank_states
from shardlab.costs.shapes import ModelShape
from shardlab.errors import ConfigError
from shardlab.strategies import get_spec

STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")


# The plans run here: every technique composed with at least one other, on 4 ranks, and one 3-D plan on 8.
PLANS = {
    "dp2-tp2": {"world_size": 4, "tp": 2},
    "dp2-tp2-sp": {"world_size": 4, "tp": 2, "sp": True},
    "fsdp2-dp2-tp2-sp": {"world_size": 4, "tp": 2, "sp": True, "dp_shard": "fsdp2_full"},
    "zero1-dp2-tp2-sp": {"world_size": 4, "tp": 2, "sp": True, "dp_shard": "zero1"},
    "zero1-dp2-pp2": {"world_size": 4, "pp": 2, "n_microbatches": 2, "dp_shard": "zero1"},
    "fsdp2-dp2-pp2-full": {"world_size": 4, "pp": 2, "n_microbatches": 2, "dp_shard": "fsdp2_full", "recompute": "full"},
    "fsdp2-dp2-tp2sp-pp2": {"world_size": 8, "tp": 2, "sp": True, "pp": 2, "schedule": "interleaved",
                            "n_microbatches": 2, "dp_shard": "fsdp2_grad_op"},
    "tp2-cp2": {"world_size": 4, "tp": 2, "cp": 2},
    "dp2-cp2": {"world_size": 4, "cp": 2},
    "fsdp2-dp2-cp2": {"world_size": 4, "cp": 2, "dp_shard": "fsdp2_grad_op"},
    "pp2-tp2-sp": {"world_size": 4, "tp": 2, "sp": True, "pp": 2, "n_microbatches": 2},
    "pp2-cp2": {"world_size": 4, "cp": 2, "pp": 2, "schedule": "gpipe", "n_microbatches": 2},
    "dp2-tp2-pp2": {"world_size": 8, "tp": 2, "pp": 2, "n_microbatches": 2},
}


def overrides(options: dict, **training) -> dict:
    return {"strategy_options": {"composed": options}, "training": training}


@pytest.mark.parity
@pytest.mark.torchrun
@pytest.mark.parametrize("plan", PLANS)
def test_composed_plan_matches_single_and_its_prediction(plan, run_once, reference_losses):
    summary, steps = run_once("composed", overrides(PLANS[plan]))
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == PLANS[plan]["world_size"]
    assert_losses_match([s["loss"] for s in steps], reference_losses)
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), overrides(PLANS[plan]))
    spec, model = get_spec("composed"), ModelShape.from_dict(TEST_EXPERIMENT["model"])
    run_plan = spec.run_plan(exp, summary["world_size"])
    assert run_plan.world == summary["world_size"]
    for rank in summary["ranks"]:
        want = rank_states(model, run_plan, rank["rank"])
        for key in STATES:
            assert rank[key] == pytest.approx(getattr(want, key), rel=0.01), (key, rank["rank"])
        predicted = rank_activations(model, run_plan, Workload.from_training(exp["training"]), rank["rank"],
                                     working_set=False)  # what the probes count: saved by the forward
        measured = rank.get("pp_peak_live_activation_bytes") or rank["activation_bytes"]  # a stage's live peak
        assert measured == pytest.approx(predicted, rel=0.10), rank["rank"]


@pytest.mark.torchrun
@pytest.mark.parametrize("plan, fault", [("dp2-tp2-sp", "skip_grad_average"), ("dp2-tp2-sp", "skip_sp_grad_sum"),
                                         ("tp2-cp2", "skip_grad_average"), ("zero1-dp2-pp2", "skip_grad_average")])
def test_composed_fails_parity_without_one_dimensions_reduction(plan, fault, run_strategy, reference_losses):
    """The check can fail: skipping the reduction over one dimension (the dp x cp replicas, or SP's partial
    LayerNorm gradients over tp) leaves the reference."""
    summary, steps = run_strategy("composed", overrides(PLANS[plan], fault_injection=fault))
    assert summary["status"] == "ok", summary["reason"]
    with pytest.raises(AssertionError, match="max \\|loss - reference\\|"):
        assert_losses_match([s["loss"] for s in steps], reference_losses)


@pytest.mark.parametrize("options, field, problem", [
    ({"world_size": 4, "tp": 3}, "strategy_options.composed.world_size", "dp\\*tp\\*pp\\*cp = 3 is not the cluster's 4"),
    ({"world_size": 6, "tp": 3}, "strategy_options.composed.tp", "4 heads are not divisible by tp=3"),
    ({"world_size": 4, "tp": 1, "sp": True}, "strategy_options.composed.sp", "needs tp > 1"),
    ({"world_size": 4, "tp": "two"}, "strategy_options.composed.tp", "positive integer"),
    ({"world_size": 8, "tp": 2, "cp": 3}, "strategy_options.composed.world_size", "= 6 is not the cluster's 8"),
    ({"world_size": 6, "cp": 3}, "strategy_options.composed.cp", "sequence 32 is not divisible by 2 x cp = 6"),
    ({"world_size": 8, "pp": 8}, "strategy_options.composed.pp", "8 pipeline stages .* cannot be cut from 2 layers"),
    ({"world_size": 4, "pp": 4, "schedule": "interleaved"}, "strategy_options.composed.virtual_stages",
     "8 pipeline stages .* cannot be cut from 2 layers"),
    ({"world_size": 4, "pp": 2, "n_microbatches": 1}, "strategy_options.composed.n_microbatches",
     "at least pp=2 micro-batches"),
    ({"world_size": 4, "pp": 2, "n_microbatches": 3, "schedule": "gpipe"}, "strategy_options.composed.n_microbatches",
     "does not divide the per-replica batch 4"),
    ({"world_size": 4, "n_microbatches": 2}, "strategy_options.composed.n_microbatches", "needs pp > 1"),
    ({"world_size": 4, "dp_shard": "zero3"}, "strategy_options.composed.dp_shard", "must be one of"),
    ({"world_size": 4, "recompute": "op"}, "strategy_options.composed.recompute", "shardlab has no 'op' recompute"),
    ({"world_size": 4, "ep": 2}, "strategy_options.composed.ep", "unknown option"),
])
def test_bad_degrees_are_rejected_by_name(options, field, problem):
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"strategy_options": {"composed": options}})
    with pytest.raises(ConfigError, match=problem) as err:
        get_spec("composed").check(exp, "experiments.test")
    assert err.value.field == f"experiments.test.{field}"


def test_a_context_shard_that_sequence_parallelism_cannot_split_is_rejected():
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"training": {"seq_len": 36}, "strategy_options": {
        "composed": {"world_size": 8, "tp": 4, "cp": 2, "sp": True}}})
    with pytest.raises(ConfigError, match="18 tokens is not divisible by the sequence-parallel degree tp=4") as err:
        get_spec("composed").check(exp, "experiments.test")
    assert err.value.field == "experiments.test.strategy_options.composed.sp"


@pytest.mark.torchrun
def test_zero1_in_a_composition_resumes_exactly_after_a_lost_rank(run_strategy, run_once):
    """The distributed optimizer's shards are checkpointed per partition and reloaded into its flat buffers:
    a restart after a killed rank continues with the same bits."""
    plan = overrides(PLANS["zero1-dp2-pp2"])
    faults = {"training": {"checkpoint_every": 2, "fault_injection": "kill_rank1_once"}, "launch": {"max_restarts": 1}}
    summary, steps = run_strategy("composed", deep_merge(faults, copy.deepcopy(plan)))
    assert summary["status"] == "ok", summary["reason"]
    assert [r["from_step"] for r in summary["resumes"]] == [2]
    uninterrupted = [s["loss"] for s in run_once("composed", plan)[1]]
    assert [s["loss"] for s in steps] == uninterrupted
