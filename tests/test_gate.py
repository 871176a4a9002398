"""One gate: a strategy's config check says no exactly when `costs.plan.rejection` of its run's Plan
does (or when its options ask for micro-batches that do not split the batch evenly, which no Plan holds).

The property test draws option sets of the pipeline, composed, context-parallel, expert-parallel and
ZeRO strategies over world sizes, layers, heads, batches, micro-batches and sequence lengths; the
explicit tests pin the cases where the two gates once disagreed."""

from __future__ import annotations

import copy
import random

import pytest

from helpers import TEST_EXPERIMENT
from shardlab.config import deep_merge
from shardlab.costs.plan import Cluster, Workload, rejection
from shardlab.costs.shapes import ModelShape
from shardlab.errors import ConfigError
from shardlab.strategies import REGISTRY

WHERE = "experiments.t"
DRAWS, SEED = 800, 47  # hypothesis is not installed here: a seeded generator draws the option sets
PIPELINES = ("pp_gpipe", "pp_1f1b", "pp_interleaved")
RUNGS = ("zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "fsdp2_full", "fsdp2_grad_op")
OFFLOAD_PAIRS = ({}, {"offload_optimizer": "cpu"}, {"offload_optimizer": "none"},
                 {"offload_optimizer": "cpu", "offload_param": "cpu"}, {"offload_optimizer": "none", "offload_param": "none"})


def experiment(model: dict, training: dict, strategy: str, options: dict) -> dict:
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"model": model, "training": training})
    exp["strategies"] = [strategy]
    exp["strategy_options"] = {strategy: options}
    return exp


def draw_shape(rng: random.Random) -> dict:
    heads = rng.choice([2, 3, 4, 8])
    hidden = 16 * heads
    return {"num_layers": rng.randint(1, 6), "num_heads": heads, "hidden_size": hidden,
            "intermediate_size": rng.choice([4 * hidden, 3 * hidden + 8]), "vocab_size": rng.choice([256, 250, 255])}


def draw_training(rng: random.Random, micro_batch_size: bool) -> dict:
    return {"global_batch_size": rng.choice([2, 3, 4, 6, 8, 12, 16]), "seq_len": rng.choice([8, 12, 16, 24, 30, 32, 36, 48]),
            "micro_batch_size": rng.choice([None, None, None, 1, 2, 3, 4]) if micro_batch_size else None}


def some(rng: random.Random, options: dict) -> dict:
    """A subset of the options: a run may leave any of them at its default."""
    return {k: v for k, v in options.items() if rng.random() < 0.6}


def pipeline_run(rng: random.Random):
    name = rng.choice([*PIPELINES, "hybrid_dp_pp"])
    options = some(rng, {"n_microbatches": rng.randint(1, 8)})
    if name == "hybrid_dp_pp":
        options |= some(rng, {"pp_size": rng.randint(2, 4)})
    return name, options, rng.randint(2, 5), False  # pipelines cut micro-batches themselves (an option check)


def composed_run(rng: random.Random):
    options = some(rng, {"tp": rng.randint(1, 4), "cp": rng.randint(1, 3), "pp": rng.randint(1, 4),
                         "dp_shard": rng.choice(["replicas", "fsdp2_full", "fsdp2_grad_op"])})
    if options.get("tp", 1) > 1:
        options |= some(rng, {"sp": rng.random() < 0.5})
    if options.get("pp", 1) > 1:  # pipeline settings need a pipeline (an option check, by name)
        options |= some(rng, {"schedule": rng.choice(["gpipe", "1f1b", "interleaved"]),
                              "virtual_stages": rng.randint(1, 3), "n_microbatches": rng.randint(1, 8)})
    degrees = options.get("tp", 1) * options.get("cp", 1) * options.get("pp", 1)
    world = degrees * rng.choice([1, 2]) if rng.random() < 0.7 else rng.randint(1, 8)  # mostly a filled mesh
    return "composed", options, world, options.get("pp", 1) == 1


def context_run(rng: random.Random):
    return "cp_ring", {}, rng.randint(1, 6), True


def expert_run(rng: random.Random):
    experts = rng.randint(1, 8)
    options = {"num_experts": experts, "top_k": rng.randint(1, min(2, experts))}
    return rng.choice(["ep_moe", "moe_single"]), options, rng.randint(1, 4), True


def zero_run(rng: random.Random):
    name = rng.choice(RUNGS)
    options = dict(rng.choice(OFFLOAD_PAIRS)) if name.startswith("zero") else {}
    if name == "zero3_offload" and options.get("offload_optimizer") == "none":
        options["offload_param"] = "none"  # parameters alone offloaded: refused by the option check (tested below)
    return name, options, rng.randint(1, 4), True


FAMILIES = (pipeline_run, composed_run, context_run, expert_run, zero_run)


def draw_case(rng: random.Random) -> tuple[str, dict, int]:
    name, options, world, may_set_micro_batch = rng.choice(FAMILIES)(rng)
    training = draw_training(rng, may_set_micro_batch)
    fields = REGISTRY[name].plan_fields(world, options)
    if rng.random() < 0.5:  # often a batch that splits evenly, so that the rules past it are reached
        training["global_batch_size"] = max(1, fields.get("dp", 1)) * (fields.get("micro_batches") or 1) * rng.choice([1, 2])
    exp = experiment(draw_shape(rng), training, name, options)
    if name == "ep_moe":  # its reference must be the same model (an option check)
        exp["strategy_options"]["moe_single"] = dict(options)
    return name, exp, world


def predicted_refusal(name: str, exp: dict, world: int) -> str | None:
    """What the gate should say, computed here from the Plan: the uneven micro-batches, else `rejection`."""
    spec, training = REGISTRY[name], exp["training"]
    fields = spec.plan_fields(world, spec.options(exp))
    gbs, dp = training["global_batch_size"], fields.get("dp", 1)
    count, rows = fields.get("micro_batches"), training.get("micro_batch_size")
    if dp >= 1 and gbs % dp == 0 and ((count and (gbs // dp) % count) or (rows and (gbs // dp) % rows)):
        return "uneven micro-batches"
    model = spec.run_model(ModelShape.from_dict(exp["model"]), exp)
    cluster = Cluster("cpu", 1, 1 if spec.single_process else world)
    return rejection(model, spec.run_plan(exp, world), cluster, Workload.from_training(training), "shardlab")


def test_the_config_check_refuses_exactly_what_rejection_refuses():
    rng, refused, outcomes = random.Random(SEED), 0, set()
    for _ in range(DRAWS):
        name, exp, world = draw_case(rng)
        expected = predicted_refusal(name, exp, world)
        options = exp["strategy_options"][name]
        try:
            REGISTRY[name].check(exp, WHERE, world)
        except ConfigError as err:
            assert expected is not None, f"{name} {options} on {world}: the check refused what rejection accepts: {err}"
            assert err.field.startswith(f"{WHERE}.")
            assert expected == "uneven micro-batches" or expected in str(err), \
                f"{name} {options} on {world}: the check refused for another reason than rejection ({expected}): {err}"
            refused += 1
            outcomes.add((name, expected.partition(":")[0]))
        else:
            assert expected is None, f"{name} {options} on {world}: rejection refused what the check accepts: {expected}"
    assert DRAWS / 5 < refused < DRAWS * 4 / 5  # both answers are drawn often
    assert len(outcomes) > 15, outcomes  # across strategies and reasons


@pytest.mark.parametrize("words", ["micro-batch", "stage", "seq", "offload", "divis"])
def test_a_config_check_that_skips_one_rule_is_caught(monkeypatch, words):
    """The property test can fail: a config check whose `rejection` lets one group of rules through."""
    import shardlab.strategies.spec as spec

    strict = spec.rejection

    def lenient(*args, **kwargs):
        reason = strict(*args, **kwargs)
        return None if reason and words in reason else reason

    monkeypatch.setattr(spec, "rejection", lenient)
    with pytest.raises(AssertionError, match="rejection refused what the check accepts"):
        test_the_config_check_refuses_exactly_what_rejection_refuses()


# --- the cases where the registry and `rejection` once disagreed ----------------------------------
def both_gates(name: str, exp: dict, world: int) -> tuple[bool, bool]:
    """(the config check accepts, `rejection` accepts) of `name` in `exp` on `world` ranks."""
    try:
        REGISTRY[name].check(exp, WHERE, world)
        checked = True
    except ConfigError:
        checked = False
    return checked, predicted_refusal(name, exp, world) is None


def test_interleaved_with_three_micro_batches_runs_in_one_round():
    """torch's ScheduleInterleaved1F1B runs max(1, m // pp) rounds and needs m a multiple of them:
    m = 3 on 2 ranks is one round of 3, which it accepts (m % pp it does not ask)."""
    exp = experiment({}, {"global_batch_size": 12}, "pp_interleaved", {"n_microbatches": 3})
    assert both_gates("pp_interleaved", exp, 2) == (True, True)
    five_on_two = experiment({}, {"global_batch_size": 10}, "pp_interleaved", {"n_microbatches": 5})
    assert both_gates("pp_interleaved", five_on_two, 2) == (False, False)  # 2 rounds do not hold 5


def test_three_layers_cut_over_two_stages():
    """The hand cut spreads embedding, layers and head over up to layers + 2 stages, evenly or not."""
    exp = experiment({"num_layers": 3}, {}, "pp_1f1b", {})
    assert both_gates("pp_1f1b", exp, 2) == (True, True)
    assert both_gates("pp_1f1b", experiment({"num_layers": 3}, {}, "pp_1f1b", {"n_microbatches": 8}), 6) == (False, False)


def test_deepspeed_offload_reaches_the_plan():
    exp = experiment({}, {}, "zero2", {"offload_optimizer": "cpu"})
    assert REGISTRY["zero2"].run_plan(exp, 2).offload == "optimizer"
    assert both_gates("zero2", exp, 2) == (True, True)
    none = experiment({}, {}, "zero3_offload", {"offload_optimizer": "none", "offload_param": "none"})
    assert REGISTRY["zero3_offload"].run_plan(none, 2).offload == "none"
    both = experiment({}, {}, "zero2", {"offload_optimizer": "cpu", "offload_param": "cpu"})
    assert both_gates("zero2", both, 2) == (False, False)  # DeepSpeed offloads parameters at stage 3 only


@pytest.mark.parametrize("options, field", [
    ({"offload_param": "cpu"}, "offload_param"),  # parameters without the optimizer: no Plan holds it
    ({"bucket_size": 1000}, "bucket_size"),
    ({"param_persistence_threshold": 100}, "param_persistence_threshold"),
])
def test_deepspeed_settings_without_a_plan_field_are_refused_by_name(options, field):
    with pytest.raises(ConfigError) as err:
        REGISTRY["zero3"].check(experiment({}, {}, "zero3", options), WHERE, 2)
    assert err.value.field == f"{WHERE}.strategy_options.zero3.{field}"


def test_deepspeed_overlap_reaches_the_plan_and_must_be_a_bool():
    assert REGISTRY["zero2"].run_plan(experiment({}, {}, "zero2", {}), 2).grad_sync_overlap is False
    overlapped = experiment({}, {}, "zero2", {"overlap_comm": True})
    assert REGISTRY["zero2"].run_plan(overlapped, 2).grad_sync_overlap is True
    assert both_gates("zero2", overlapped, 2) == (True, True)
    with pytest.raises(ConfigError) as err:
        REGISTRY["zero2"].check(experiment({}, {}, "zero2", {"overlap_comm": "yes"}), WHERE, 2)
    assert err.value.field == f"{WHERE}.strategy_options.zero2.overlap_comm"
