"""Composed plans (strategy `composed`): a Plan's degrees on one (pp, dp, cp, tp) mesh under real torchrun,
every technique composed with at least one other on 4 ranks and a 3-D plan on 8: the single-device loss by the
parity rule, can-fail runs without one dimension's reduction, every rank's memory against the one cost model's
prediction for the same Plan, and bad degrees rejected by name before anything runs."""

from __future__ import annotations

import copy

import pytest

from helpers import MOE_OPTIONS, MOE_OVERRIDES, TEST_EXPERIMENT, assert_losses_match
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


# Mixture-of-experts plans (strategy composed_moe, reference moe_single): experts over ep ranks carved from dp.
# Their model states are checked against the cost model; their saved activations are not: they hang on how
# many tokens the router sends each rank's experts (the cost model predicts the mean, k copies of the rank's
# tokens), and under SP this runner gathers the tokens over tp for the experts, which the model does not
# price (measured in the DAG's table composed_ranks: docs/strategies-and-planning.md).
MOE_PLANS = {
    "moe-dp4-ep2": {"world_size": 4, "ep": 2},  # edp 2: expert gradients summed over it, one queue over both groups
    "moe-ep2-tp2-sp": {"world_size": 4, "ep": 2, "tp": 2, "sp": True},  # experts' MLPs split over tp
    # The router's loss inside stages, on one micro-batch: the router queues and balances the tokens of each
    # forward, so micro-batches would need a reference that runs the same ones (docs/strategies-and-planning.md).
    "moe-ep2-pp2": {"world_size": 4, "ep": 2, "pp": 2, "schedule": "gpipe", "n_microbatches": 1},
}


def overrides(options: dict, strategy: str = "composed", **training) -> dict:
    return {"strategy_options": {strategy: options}, "training": training}


def moe_overrides(options: dict, **training) -> dict:
    """The composed MoE run's options and the same MoE settings for its reference (the expert tests' own where
    the plan keeps them, so that their reference run is shared)."""
    moe = {**MOE_OPTIONS, **{k: v for k, v in options.items() if k in MOE_OPTIONS}}
    runs = {"strategy_options": {name: moe for name in MOE_OVERRIDES["strategy_options"]}}
    return deep_merge(runs, overrides({**moe, **options}, "composed_moe", **training))


def moe_reference(run_once, options: dict) -> list[float]:
    reference = {"strategy_options": moe_overrides(options)["strategy_options"]}
    del reference["strategy_options"]["composed_moe"]
    summary, steps = run_once("moe_single", reference)
    assert summary["status"] == "ok", summary["reason"]
    return [s["loss"] for s in steps]


def assert_memory_as_predicted(summary: dict, exp: dict, strategy: str, activations: bool = True) -> None:
    """Every rank's model states within 1 % and (with `activations`) saved activations within 10 % of the
    cost model's prediction for the run's Plan."""
    spec = get_spec(strategy)
    model = spec.run_model(ModelShape.from_dict(exp["model"]), exp)
    run_plan = spec.run_plan(exp, summary["world_size"])
    assert run_plan.world == summary["world_size"]
    for rank in summary["ranks"]:
        want = rank_states(model, run_plan, rank["rank"])
        for key in STATES:
            assert rank[key] == pytest.approx(getattr(want, key), rel=0.01), (key, rank["rank"])
        if activations:
            predicted = rank_activations(model, run_plan, Workload.from_training(exp["training"]), rank["rank"],
                                         working_set=False)  # what the probes count: saved by the forward
            measured = rank.get("pp_peak_live_activation_bytes") or rank["activation_bytes"]  # a stage's live peak
            assert measured == pytest.approx(predicted, rel=0.10), rank["rank"]


@pytest.mark.parity
@pytest.mark.torchrun
@pytest.mark.parametrize("plan", PLANS)
def test_composed_plan_matches_single_and_its_prediction(plan, run_once, reference_losses):
    summary, steps = run_once("composed", overrides(PLANS[plan]))
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == PLANS[plan]["world_size"]
    assert_losses_match([s["loss"] for s in steps], reference_losses)
    assert_memory_as_predicted(summary, deep_merge(copy.deepcopy(TEST_EXPERIMENT), overrides(PLANS[plan])), "composed")


@pytest.mark.parity
@pytest.mark.torchrun
@pytest.mark.parametrize("plan", MOE_PLANS)
def test_composed_moe_plan_matches_moe_single_and_its_prediction(plan, run_once):
    """The same tokens dropped, the same load-balancing loss, the same losses as the unsharded MoE model."""
    summary, steps = run_once("composed_moe", moe_overrides(MOE_PLANS[plan]))
    assert summary["status"] == "ok", summary["reason"]
    assert_losses_match([s["loss"] for s in steps], moe_reference(run_once, MOE_PLANS[plan]))
    assert_memory_as_predicted(summary, deep_merge(copy.deepcopy(TEST_EXPERIMENT), moe_overrides(MOE_PLANS[plan])),
                               "composed_moe", activations=False)


@pytest.mark.torchrun
@pytest.mark.parametrize("plan, fault", [("dp2-tp2-sp", "skip_grad_average"), ("dp2-tp2-sp", "skip_sp_grad_sum"),
                                         ("tp2-cp2", "skip_grad_average"), ("zero1-dp2-pp2", "skip_grad_average"),
                                         ("moe-dp4-ep2", "skip_expert_grad_sum")])
def test_composed_fails_parity_without_one_dimensions_reduction(plan, fault, run_strategy, run_once, reference_losses):
    """The check can fail: skipping the reduction over one dimension (the dp x cp replicas, SP's partial
    LayerNorm gradients over tp, or the experts' copies over edp) leaves the reference."""
    if plan in MOE_PLANS:
        summary, steps = run_strategy("composed_moe", moe_overrides(MOE_PLANS[plan], fault_injection=fault))
        reference_losses = moe_reference(run_once, MOE_PLANS[plan])
    else:
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
