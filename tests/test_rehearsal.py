"""Rehearsals of cluster plans (`strategies.composed.rehearsal`): a plan the planner found at scale keeps its
composition on at most 16 ranks of a toy model, what a composed run cannot do is refused by name, the block
passes the composed strategy's check, and (torchrun) the 16-rank 4-D rehearsal of the Llama-3-405B scenario's
best plan reproduces the single-device losses and the cost model's memory per rank."""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import pytest

from helpers import TEST_EXPERIMENT, assert_losses_match, launch_test_run, with_experiments
from shardlab.config import deep_merge
from shardlab.costs.plan import Plan, Workload
from shardlab.costs.shapes import ModelShape
from shardlab.errors import ConfigError
from shardlab.strategies import get_spec
from shardlab.strategies.composed.rehearsal import (NotRehearsable, check_block, composition, rehearsal_plan,
                                                    rehearse, scenario_plan)

LLAMA = "llama3-405b-16k-h100"  # config/planning.yaml
FOUR_D = Plan(dp=8, tp=8, pp=16, cp=2, sp=True, schedule="interleaved", virtual_stages=2, framework="megatron",
              zero=1, recompute="selective")
STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")
SAME_FIELDS = ("dp", "tp", "sp", "cp", "pp", "schedule", "virtual_stages", "zero", "framework", "micro_batch",
               "recompute")


@pytest.fixture(scope="module")
def llama():
    """(best plan, where it was found) of the Llama-3-405B planning scenario."""
    return scenario_plan(None, LLAMA)


def test_the_rehearsal_module_imports_no_torch():
    code = "import sys, shardlab.strategies.composed.rehearsal; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_llama_405b_best_plan_keeps_its_composition_on_two_per_degree(llama):
    plan, source = llama
    small = rehearsal_plan(plan)
    assert composition(small) == composition(plan)
    for dim in ("dp", "tp", "pp", "cp"):
        assert getattr(small, dim) == (2 if getattr(plan, dim) > 1 else 1), dim
    assert small.world == 2 ** len(composition(plan)["split"]) <= 16
    assert LLAMA in source and "H100" in source


def test_a_hand_made_4d_plan_becomes_the_16_rank_plan():
    assert rehearsal_plan(FOUR_D) == Plan(dp=2, tp=2, pp=2, cp=2, sp=True, schedule="interleaved", virtual_stages=2,
                                          framework="torch", zero=1, recompute="selective")


@pytest.mark.parametrize("sharding, runs_as", [
    (("megatron", 0), ("torch", 0)), (("mcore", 1), ("torch", 1)), (("deepspeed", 1), ("torch", 1)),
    (("torch", 1), ("torch", 1)), (("fsdp2", 3), ("fsdp2", 3)), (("fsdp2", 2), ("fsdp2", 2)),
])
def test_dp_sharding_maps_to_what_a_composed_run_shards(sharding, runs_as):
    small = rehearsal_plan(Plan(dp=4, tp=2, framework=sharding[0], zero=sharding[1]))
    assert (small.framework, small.zero) == runs_as


@pytest.mark.parametrize("plan, max_ranks, why", [
    (Plan(dp=8, ep=4, framework="mcore", zero=1), 16, "^ep: rehearsals are of dense plans"),
    (Plan(dp=8, framework="deepspeed", zero=3, offload="optimizer"), 16, "^offload: .* not composed"),
    (Plan(dp=8, tp=2, framework="deepspeed", zero=2), 16, "^zero: deepspeed ZeRO-2 does not compose.*framework=fsdp2"),
    (Plan(dp=8, tp=2, recompute="op"), 16, "^recompute: .* no per-op checkpointing"),
    (FOUR_D, 8, "^world: .* needs 16 ranks \\(dp2 x tp2 x pp2 x cp2\\), more than 8"),
])
def test_what_a_composed_run_cannot_rehearse_is_refused_by_name(plan, max_ranks, why):
    with pytest.raises(NotRehearsable, match=why):
        rehearsal_plan(plan, max_ranks)


@pytest.mark.parametrize("which", ["llama", "four_d"])
def test_the_block_passes_the_composed_check_and_runs_the_rehearsal_plan(which, llama):
    plan, source = llama if which == "llama" else (FOUR_D, "by hand")
    block = rehearse(plan, source)  # raises unless every run passes its strategy's check
    name = block["strategies"][1]
    assert block["strategies"] == ["single", name] and plan.label() in block["description"]
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {k: block[k] for k in ("model", "training", "strategy_options")})
    run = get_spec(name).run_plan(exp, block["strategy_options"][name]["world_size"])
    small = rehearsal_plan(plan)
    assert {f: getattr(run, f) for f in SAME_FIELDS} == {f: getattr(small, f) for f in SAME_FIELDS}


def test_the_check_refuses_a_broken_block(llama):
    block = rehearse(*llama)
    block["training"]["seq_len"] = 34  # not 2 x cp = 4 zig-zag chunks
    with pytest.raises(ConfigError, match="not divisible"):
        check_block(block)


def test_scenarios_are_found_by_name_or_model():
    assert scenario_plan(None, "llama-3-405b")[0] == scenario_plan(None, LLAMA)[0]
    with pytest.raises(ValueError, match="several scenarios .* dense-1t"):
        scenario_plan(None, "dense-1t")
    with pytest.raises(ValueError, match="no scenario .* 'gpt-5'"):
        scenario_plan(None, "gpt-5")


@pytest.fixture(scope="module")
def rehearsal(llama, tmp_path_factory):
    """The Llama-3-405B rehearsal block and (model_dir, tokens) of its toy model."""
    from shardlab.core.data import prepare_corpus
    from shardlab.core.model import prepare_model

    block = rehearse(*llama)
    root = tmp_path_factory.mktemp("rehearsal-assets")
    model_dir = prepare_model(block["model"], root / "model")
    prepare_corpus(TEST_EXPERIMENT["data"], block["model"], model_dir, root / "data")
    return block, (model_dir, root / "data" / "tokens.npy")


@pytest.mark.parity
@pytest.mark.torchrun
def test_the_llama_405b_rehearsal_matches_single_and_its_prediction(rehearsal, tmp_path):
    """16 ranks on a laptop: the 4-D rehearsal's losses by the fp32 parity rule, every rank's model states
    within 1 % and saved activations within 10 % of the cost model's prediction for the run's Plan."""
    from shardlab.costs.predict import rank_activations, rank_states

    block, assets = rehearsal
    name = block["strategies"][1]
    overrides = {k: block[k] for k in ("model", "training", "strategy_options")} | {"launch": {"timeout_s": 600}}
    single, reference = launch_test_run(assets, tmp_path / "single", "single", overrides)
    assert single["status"] == "ok", single["reason"]
    start = time.perf_counter()
    summary, steps = launch_test_run(assets, tmp_path / "composed", name, overrides)
    print(f"{name}: {summary['world_size']} ranks in {time.perf_counter() - start:.0f} s")
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == 16
    training = block["training"]
    assert_losses_match([s["loss"] for s in steps], [s["loss"] for s in reference],
                        training["global_batch_size"] * training["seq_len"])
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), overrides)
    run_plan, model = get_spec(name).run_plan(exp, 16), ModelShape.from_dict(block["model"])
    for rank in summary["ranks"]:
        want = rank_states(model, run_plan, rank["rank"])
        for key in STATES:
            assert rank[key] == pytest.approx(getattr(want, key), rel=0.01), (key, rank["rank"])
        predicted = rank_activations(model, run_plan, Workload.from_training(training), rank["rank"], working_set=False)
        measured = rank.get("pp_peak_live_activation_bytes") or rank["activation_bytes"]
        assert measured == pytest.approx(predicted, rel=0.10), rank["rank"]


def test_plan_export_rehearse_writes_a_block_the_study_accepts(tmp_path):
    import yaml

    from helpers import REPO
    from shardlab.strategies.composed.export import main
    from shardlab.study import load_study

    out = tmp_path / "rehearsal.yaml"
    study_config = REPO / "config/config.yaml"  # its scenarios: config/planning.yaml's
    assert main(["--config", str(study_config), "--rehearse", "llama-3-405b", "--out", str(out)]) == 0
    config = yaml.safe_load((REPO / "config/test.yaml").read_text())
    config = with_experiments(config, yaml.safe_load(out.read_text()))
    assert load_study(config, REPO).experiments["rehearsal"]["strategy_options"]  # resolved and checked
    assert main(["--config", str(study_config), "--rehearse", "gpt-5"]) == 2  # said on stderr, nothing written
