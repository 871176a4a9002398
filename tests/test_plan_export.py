"""From plan to run (`strategies.composed.export`), torch-free: a searched Plan becomes composed options that
reproduce it (the registry's Plan of the run equals the searched Plan but for what only a run knows), plans a
composed run cannot execute are left out, and `plan_search` in a config adds one experiment of the top plans."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from helpers import REPO, TEST_EXPERIMENT
from shardlab.costs.plan import Plan
from shardlab.errors import ConfigError
from shardlab.strategies import REGISTRY, get_spec
from shardlab.strategies.composed.export import not_composable, runnable, search_runnable
from shardlab.strategies.composed.runs import composed_options, run_name
from shardlab.study import load_study

EXP = copy.deepcopy(TEST_EXPERIMENT)  # 2 layers, 4 heads, seq 32, batch 8
SAME_FIELDS = ("dp", "tp", "sp", "cp", "pp", "schedule", "virtual_stages", "zero", "framework", "micro_batch", "recompute")


@pytest.mark.parametrize("plan", [
    Plan(dp=2, tp=2, sp=True, micro_batch=4, framework="torch", dtype="fp32"),
    Plan(dp=2, tp=2, sp=True, micro_batch=4, framework="fsdp2", zero=3, dtype="fp32"),
    Plan(dp=1, cp=2, pp=2, schedule="gpipe", micro_batch=2, framework="torch", dtype="fp32"),
    Plan(dp=2, tp=2, pp=2, schedule="1f1b", micro_batch=2, framework="torch", dtype="fp32"),
    Plan(dp=2, tp=2, sp=True, micro_batch=4, framework="torch", zero=1, dtype="fp32", recompute="selective"),
    Plan(dp=2, pp=2, schedule="1f1b", micro_batch=2, framework="fsdp2", zero=2, dtype="fp32", recompute="full"),
], ids=lambda p: p.label())
def test_a_runnable_plan_becomes_a_run_with_the_same_plan(plan):
    options = runnable(plan, EXP)
    assert options == composed_options(plan, EXP["training"]["global_batch_size"])
    name = run_name(plan)
    exp = EXP | {"strategy_options": {name: options}}
    run = get_spec(name).run_plan(exp, options["world_size"])
    assert {f: getattr(run, f) for f in SAME_FIELDS} == {f: getattr(plan, f) for f in SAME_FIELDS}


@pytest.mark.parametrize("plan, why", [
    (Plan(dp=4, framework="deepspeed", zero=1, micro_batch=2), "deepspeed ZeRO-1 runs as its own strategy only"),
    (Plan(dp=4, framework="deepspeed", zero=2, offload="optimizer", micro_batch=2), "offload runs as DeepSpeed's"),
    (Plan(dp=4, framework="torch", micro_batch=1), "gradient accumulation without pipeline stages"),
    (Plan(dp=1, pp=4, schedule="interleaved", virtual_stages=2, framework="torch", micro_batch=1),
     "8 pipeline stages .* cannot be cut from 2 layers"),
])
def test_plans_a_composed_run_cannot_execute_are_left_out_with_their_reason(plan, why):
    assert runnable(plan, EXP) is None
    assert re.search(why, not_composable(plan, EXP))


def test_the_search_returns_distinct_runnable_layouts_fastest_first():
    found = search_runnable(EXP, world=4, top=3)
    assert len(found.plans) == 3 and "CPU" in found.cluster
    speeds = [f["tokens_per_s"] for f in found.plans.values()]
    assert speeds == sorted(speeds, reverse=True)
    layouts = {tuple(sorted((k, v) for k, v in f["options"].items() if k != "dp_shard")) for f in found.plans.values()}
    assert len(layouts) == 3
    assert all(name in REGISTRY for name in found.plans)


def test_the_fastest_plan_runs_again_under_each_recompute_mode_asked_for():
    found = search_runnable(EXP, world=4, top=2, recompute=("selective", "full"))
    names = list(found.plans)
    assert len(names) == 4
    fastest = found.plans[names[0]]
    for mode, name in zip(("selective", "full"), names[2:]):
        assert found.plans[name]["options"] == {**fastest["options"], "recompute": mode}
        assert found.plans[name]["label"].endswith(f"rc:{mode}")
    assert found.plans[names[3]]["tokens_per_s"] < fastest["tokens_per_s"]  # full recompute runs the forward twice


def test_faster_plans_left_out_are_counted_by_reason():
    """Nothing faster is dropped silently: each plan ranked ahead of the last one kept either runs or is
    counted under the reason `not_composable` gives."""
    found = search_runnable(EXP, world=4, top=6, per_layout=False)
    assert found.left_out  # DeepSpeed's rungs rank among them on this model
    assert all(re.search("not composed|gradient accumulation|composed strategy's check", why) for why in found.left_out)


def _config() -> dict:
    config = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    config["plan_search"] = {"experiment": "searched", "world_size": 4, "top": 2}
    return config


def test_plan_search_adds_one_experiment_of_the_top_plans():
    config = _config()
    study = load_study(config, REPO)
    searched = study.experiments["searched"]
    assert searched["strategies"][0] == "single" and len(searched["strategies"]) == 3
    assert set(study.plan_search["plans"]) == set(searched["strategies"][1:])
    assert "searched" not in config["experiments"]  # the config itself is left as written
    assert load_study(config, REPO).plan_search == study.plan_search


def test_plan_search_refuses_an_experiment_name_already_taken():
    config = _config()
    config["plan_search"]["experiment"] = next(iter(config["experiments"]))
    with pytest.raises(ConfigError, match="already an experiment") as err:
        load_study(config, REPO)
    assert err.value.field == "plan_search.experiment"


def test_plan_export_writes_an_experiment_the_study_accepts(tmp_path):
    from shardlab.strategies.composed.export import main

    out = tmp_path / "exported.yaml"
    assert main(["--config", str(REPO / "config/test.yaml"), "--experiment", next(iter(_config()["experiments"])),
                 "--world-size", "4", "--top", "2", "--name", "exported", "--out", str(out)]) == 0
    config = _config()
    del config["plan_search"]
    config["experiments"] |= yaml.safe_load(out.read_text())
    study = load_study(config, REPO)
    assert len(study.experiments["exported"]["strategies"]) == 3


def test_plan_export_names_a_bad_experiment():
    from shardlab.strategies.composed.export import main

    assert main(["--config", str(REPO / "config/test.yaml"), "--experiment", "nope", "--world-size", "4"]) == 2
