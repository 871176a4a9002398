"""A checkpoint resumes under any plan (`training.resume_from`), under real torchrun: plan A trains with
AdamW and keeps its checkpoint after step 2; plan B (another family, other degrees, often another world
size) loads it, resharding on load, and trains steps 3-5. B's losses there must match A's uninterrupted
run within the float32 parity rule (the reduction order changed with the plan, nothing else did); with
the optimizer's state dropped on load they must not. Checkpoints another training wrote, or whose
parameters the plan cannot hold, are refused by name before training starts."""

from __future__ import annotations

import copy
import time

import pytest
import yaml

from helpers import ADAMW_OVERRIDES, MOE_OPTIONS, REPO, TEST_EXPERIMENT, assert_losses_match, launch_test_run
from shardlab.config import deep_merge
from shardlab.errors import ConfigError
from shardlab.runner.checkpoint import Checkpointer, Stored, checkpoint_folder, differences, trajectory
from shardlab.runner.launch import checkpoint_dir
from shardlab.strategies import REGISTRY
from shardlab.strategies.portable import Held, IncompatibleCheckpoint, check_names
from shardlab.study import load_study

AT = 3  # A checkpoints after step 2 (checkpoint_every 3); B trains steps 3-5
ADAMW = ADAMW_OVERRIDES  # the optimizer's state matters (SGD without momentum, the other tests' optimizer, has none)
MOE = {name: MOE_OPTIONS for name in ("moe_single", "ep_moe")}

# A -> B: (strategy, its overrides). Every multi-process family is on one side at least; the named
# pairs are here (DeepSpeed ZeRO-3 -> FSDP2, TP+SP -> PP, composed -> single, 4 ranks -> 2 ranks).
PAIRS = {
    "zero3 -> fsdp2_full": (("zero3", {}), ("fsdp2_full", {})),
    "tp_sp -> pp_1f1b": (("tp_sp", {}), ("pp_1f1b", {"strategy_options": {"pp_1f1b": {"n_microbatches": 2}}})),
    "composed zero1 dp2 tp2+sp (4) -> single": (
        ("composed", {"strategy_options": {"composed": {"world_size": 4, "tp": 2, "sp": True, "dp_shard": "zero1"}}}),
        ("single", {})),
    "ddp (4) -> tp (2)": (("ddp", {"launch": {"world_size": 4}}), ("tp", {})),
    "fsdp2_full -> zero2": (("fsdp2_full", {}), ("zero2", {})),
    "single -> zero3": (("single", {}), ("zero3", {})),
    "hybrid_dp_pp (4) -> cp_ring": (
        ("hybrid_dp_pp", {"strategy_options": {"hybrid_dp_pp": {"world_size": 4, "n_microbatches": 2}}}),
        ("cp_ring", {})),
    "cp_ring -> composed pp2 tp2+sp (4)": (
        ("cp_ring", {}),
        ("composed", {"strategy_options": {"composed": {"world_size": 4, "tp": 2, "sp": True, "pp": 2,
                                                        "n_microbatches": 2}}})),
    "ep_moe -> moe_single": (("ep_moe", {"strategy_options": MOE}), ("moe_single", {"strategy_options": MOE})),
    "composed_moe ep2 tp2+sp (4) -> ep_moe": (
        ("composed_moe", {"strategy_options": {"composed_moe": {**MOE_OPTIONS, "world_size": 4, "ep": 2, "tp": 2,
                                                                "sp": True}}}),
        ("ep_moe", {"strategy_options": MOE})),
}
CAN_FAIL = "zero3 -> fsdp2_full"


def _losses(steps):
    return [s["loss"] for s in steps]


@pytest.fixture(scope="session")
def plan_a(tiny_assets, tmp_path_factory):
    """run(strategy, overrides) -> (uninterrupted losses, its checkpoint after step AT - 1): A's run, once."""
    cache = {}

    def run(strategy, overrides):
        key = (strategy, repr(overrides))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"a-{strategy}")
            settings = deep_merge(copy.deepcopy(ADAMW), overrides)
            settings = deep_merge(settings, {"training": {"checkpoint_every": AT, "keep_checkpoints": True}})
            summary, steps = launch_test_run(tiny_assets, root, strategy, settings)
            assert summary["status"] == "ok", summary["reason"]
            folder = checkpoint_dir(root / "runs" / strategy, strategy) / f"step-{AT - 1:08d}"
            assert folder.is_dir()
            cache[key] = (_losses(steps), folder)
        return cache[key]

    return run


def resume_b(tiny_assets, root, strategy, overrides, folder, **training):
    settings = deep_merge(deep_merge(copy.deepcopy(ADAMW), overrides),
                          {"training": {"resume_from": str(folder), **training}})
    return launch_test_run(tiny_assets, root, strategy, settings)


def test_every_multi_process_family_is_on_a_side():
    families = {spec.family for spec in REGISTRY.values() if not spec.single_process}
    covered = {REGISTRY[name].family for (a, _), (b, _) in PAIRS.values() for name in (a, b)}
    assert families <= covered


@pytest.mark.parity
@pytest.mark.torchrun
@pytest.mark.parametrize("pair", PAIRS)
def test_a_checkpoint_resumes_under_another_plan(pair, plan_a, tiny_assets, tmp_path):
    (a, a_overrides), (b, b_overrides) = PAIRS[pair]
    uninterrupted, folder = plan_a(a, a_overrides)
    summary, steps = resume_b(tiny_assets, tmp_path, b, b_overrides, folder)
    assert summary["status"] == "ok", summary["reason"]
    assert [s["step"] for s in steps] == list(range(TEST_EXPERIMENT["training"]["steps"]))
    resumed = summary["resumes"]
    assert [(r["from_step"], r["written_by"]["strategy"]) for r in resumed] == [(AT, a)]
    assert _losses(steps)[:AT] == uninterrupted[:AT]  # A's records, carried over
    assert_losses_match(_losses(steps)[AT:], uninterrupted[AT:])  # B's own steps: A's trajectory, continued


@pytest.mark.parity
@pytest.mark.torchrun
def test_a_resume_without_the_optimizer_state_fails_the_check(plan_a, tiny_assets, tmp_path):
    """The can-fail case: the same pair with AdamW's moments and step count dropped on load leaves the
    trajectory, by far more than the rule allows."""
    (a, a_overrides), (b, b_overrides) = PAIRS[CAN_FAIL]
    uninterrupted, folder = plan_a(a, a_overrides)
    summary, steps = resume_b(tiny_assets, tmp_path, b, b_overrides, folder, fault_injection="drop_optimizer_state")
    assert summary["status"] == "ok", summary["reason"]
    assert [r["from_step"] for r in summary["resumes"]] == [AT]
    with pytest.raises(AssertionError, match="max \\|loss - reference\\|"):
        assert_losses_match(_losses(steps)[AT:], uninterrupted[AT:])


@pytest.mark.torchrun
def test_a_checkpoint_of_another_training_is_refused_by_name(plan_a, tiny_assets, tmp_path):
    """Another optimizer, and another model (a mixture of experts' state into the dense model): the run
    fails before its first step, naming what differs."""
    (a, a_overrides), _ = PAIRS[CAN_FAIL]
    _, folder = plan_a(a, a_overrides)
    started = time.monotonic()
    summary, steps = resume_b(tiny_assets, tmp_path / "sgd", "fsdp2_full", {"training": {"optimizer": "sgd"}}, folder)
    assert summary["status"] == "failed" and steps == []
    assert "training.optimizer: 'adamw' in the checkpoint, 'sgd' in this run" in summary["reason"], summary["reason"]

    _, moe_folder = plan_a(*PAIRS["ep_moe -> moe_single"][0])
    summary, steps = resume_b(tiny_assets, tmp_path / "dense", "ddp", {}, moe_folder)
    assert summary["status"] == "failed" and steps == []
    assert "experts: " in summary["reason"], summary["reason"]
    assert time.monotonic() - started < 120


def test_trajectory_differences_name_each_field():
    exp = copy.deepcopy(TEST_EXPERIMENT)
    base = trajectory(exp, "ddp")
    assert differences(base, trajectory(deep_merge(exp, {"launch": {"world_size": 4}}), "fsdp2_full")) == []
    assert differences(base, trajectory(deep_merge(exp, {"training": {"checkpoint_every": 2, "resume_from": "x"}}),
                                        "tp")) == []
    assert differences(base, trajectory(deep_merge(exp, {"model": {"hidden_size": 32}}), "ddp")) == [
        "model.hidden_size: 64 in the checkpoint, 32 in this run"]
    assert differences(base, trajectory(deep_merge(exp, {"data": {"max_documents": 10}}), "ddp")) == [
        "data.max_documents: 2000 in the checkpoint, 10 in this run"]
    moe = trajectory(deep_merge(exp, {"strategy_options": MOE}), "ep_moe")
    assert differences(moe, trajectory(deep_merge(exp, {"strategy_options": MOE}), "moe_single")) == []
    assert differences(base, moe)[0].startswith("experts: None in the checkpoint")


class _Holding:
    """A strategy as the name check sees it: what it holds."""

    name, holds_every_parameter = "target", True

    def __init__(self, shapes):
        import torch

        self.held = [Held(name, torch.empty(shape), torch.Size(shape)) for name, shape in shapes.items()]

    def held_parameters(self):
        return self.held


def test_parameters_the_plan_cannot_hold_are_named():
    stored = {"a.weight": (4, 2), "b.weight": (3,), "experts.0.w": (2, 2)}
    same = _Holding(stored)
    check_names(same, same.held_parameters(), stored)  # the same: nothing said
    with pytest.raises(IncompatibleCheckpoint) as err:
        other = _Holding({"a.weight": (4, 4), "b.weight": (3,), "c.bias": (1,)})
        check_names(other, other.held_parameters(), stored)
    message = str(err.value)
    assert "lacks 1 parameter(s) the target holds (c.bias)" in message
    assert "no place for 1 of the checkpoint's parameter(s) (experts.0.w)" in message
    assert "a.weight (4, 2) in the checkpoint, (4, 4) in the target" in message


def test_a_folder_without_the_layout_is_named_not_loaded(tmp_path):
    """A step folder of the earlier per-strategy layout (DCP shards and meta.json): what it lacks is said."""
    old = tmp_path / "step-00000003"
    old.mkdir()
    (old / "meta.json").write_text("{}")
    (old / "__0_0.distcp").write_bytes(b"")
    assert checkpoint_folder(tmp_path) == old
    with pytest.raises(IncompatibleCheckpoint, match="has no model.safetensors, optimizer.safetensors"):
        Stored(old)
    with pytest.raises(IncompatibleCheckpoint, match="no complete checkpoint in"):
        checkpoint_folder(tmp_path / "nothing")


def test_a_run_skips_its_own_checkpoints_of_other_settings(tmp_path, capsys):
    import json

    def folder(name, key):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(json.dumps({"resume_key": key, "world_size": 2}))

    mine = Checkpointer(tmp_path, 2, {"model": 1}, 0, 4)
    folder("step-00000001", mine.key)
    folder("step-00000005", "other settings")
    (tmp_path / ".step-00000009.partial").mkdir()  # a crash while writing
    assert mine.latest() == (1, tmp_path / "step-00000001")  # written by 2 ranks: resumed by 4 all the same
    out = capsys.readouterr().out
    assert "incomplete" in out and "other settings" in out


@pytest.mark.parametrize("change, field, problem", [
    ({"experiment": "nope"}, "resharding.experiment", "no experiment named 'nope'"),
    ({"plan": "tp_5d"}, "resharding.plan", "unknown strategy 'tp_5d'"),
    ({"at_step": 6}, "resharding.at_step", "the resumed plans would train none"),
    ({"resume_under": ["tp_sp", "ep_moe"]}, "resharding.resume_under[1]", "cannot hold its checkpoint"),
    ({"strategy_options": {"pp_1f1b": {}}}, "resharding.strategy_options.pp_1f1b", "does not run"),
    ({"strategy_options": {"tp_sp": {"world_size": 3}}}, "resharding.strategy_options.tp_sp.world_size", ""),
])
def test_the_resharding_block_is_checked_before_anything_runs(change, field, problem):
    config = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    config["resharding"].update(change)
    with pytest.raises(ConfigError) as err:
        load_study(config, base_dir=REPO)
    assert err.value.field == field, str(err.value)
    assert problem in str(err.value)


def test_the_resharding_table_and_its_caption_name_a_failed_plan(tmp_path):
    """The job's rows (bench.resharding.loss_rows, from launch summaries as the launcher writes them), the table
    (tables.resharding) and the caption on a study where one resumed plan failed and one left the uninterrupted
    run by more than rounding."""
    import pandas as pd

    from shardlab.bench.driver import write_rows
    from shardlab.bench.resharding import COLUMNS, loss_rows
    from shardlab.reporting import captions
    from shardlab.tables.resharding import resharding_rows

    a = [4.0, 3.5, 3.2, 3.0]
    steps = lambda losses: [{"step": i, "loss": x} for i, x in enumerate(losses)]  # noqa: E731
    resumed = {"status": "ok", "reason": None, "world_size": 2,
               "resumes": [{"from_step": 2, "written_by": {"strategy": "fsdp2_full", "world_size": 4}}]}
    rows = [*loss_rows("uninterrupted", "fsdp2_full", {"status": "ok", "reason": None, "world_size": 4}, steps(a)),
            *loss_rows("resumed", "tp_sp", resumed, steps(a)),
            *loss_rows("resumed", "pp_1f1b", resumed, steps([x + (0.01 if i >= 2 else 0) for i, x in enumerate(a)])),
            *loss_rows("resumed", "zero2", {"status": "failed", "reason": "rank 0: boom", "world_size": 2}, [])]
    experiments = {"e": {"training": {"global_batch_size": 8, "seq_len": 32, "dtype": "fp32"}}}
    reference = {"experiment": "e", "strategy": "single", "status": "ok", "step_log": [{"loss": x} for x in a]}
    write_rows("e", rows, COLUMNS, tmp_path / "resharding_losses.csv")  # the job's output, read as the table rule does
    losses = pd.read_csv(tmp_path / "resharding_losses.csv")
    resharding_rows(losses, experiments, [reference]).to_csv(tmp_path / "resharding.csv", index=False)
    table = pd.read_csv(tmp_path / "resharding.csv").set_index("strategy")  # as the report reads it
    assert table.loc["tp_sp", "within_tolerance"] == True and table.loc["tp_sp", "steps_compared"] == 2  # noqa: E712
    assert table.loc["pp_1f1b", "within_tolerance"] == False  # noqa: E712
    assert table.loc["pp_1f1b", "max_loss_deviation"] == pytest.approx(0.01)
    assert table.loc["zero2", "status"] == "failed" and pd.isna(table.loc["zero2", "max_loss_deviation"])
    text = captions.resharding(table.reset_index())
    assert "loaded under tp_sp on 2 ranks, pp_1f1b on 2 ranks and zero2 on 2 ranks" in text
    assert "1 of 3 continue the uninterrupted run's losses" in text and "zero2 failed: rank 0: boom." in text
