"""Checkpoint and resume (`training.checkpoint_every`, `launch.max_restarts`) under real torchrun:
a run that loses a rank continues from its latest complete checkpoint, by the launcher's restart
or by a rerun of the job, with per-step losses equal to an uninterrupted run's, bit for bit (CPU,
fp32, deterministic kernels), and no step missing or recorded twice."""

from __future__ import annotations

import json

import pytest

from conftest import TEST_EXPERIMENT, launch_test_run
from shardlab.errors import ConfigError
from shardlab.runner.checkpoint import Checkpointer
from shardlab.runner.faults import ONCE_STEP
from shardlab.strategies import REGISTRY

EVERY = 2  # checkpoints after steps 1, 3: the fault at step 3 comes before the second one
STEPS = list(range(TEST_EXPERIMENT["training"]["steps"]))


def _losses(steps):
    return [s["loss"] for s in steps]


@pytest.fixture(scope="module")
def uninterrupted(tiny_assets, tmp_path_factory):
    """Per-step losses of runs without checkpoints or faults, by strategy (one launch each)."""
    cache = {}

    def losses(strategy):
        if strategy not in cache:
            summary, steps = launch_test_run(tiny_assets, tmp_path_factory.mktemp(strategy), strategy)
            assert summary["status"] == "ok", summary["reason"]
            cache[strategy] = _losses(steps)
        return cache[strategy]

    return losses


@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2_full", "zero3", "tp_sp_dtensor", "cp_ring"])
def test_a_restart_after_a_lost_rank_resumes_exactly(strategy, run_strategy, uninterrupted):
    summary, steps = run_strategy(strategy, {"training": {"checkpoint_every": EVERY, "fault_injection": "kill_rank1_once"},
                                             "launch": {"max_restarts": 1}})
    assert summary["status"] == "ok", summary["reason"]
    assert [s["step"] for s in steps] == STEPS  # none missing, none twice
    assert _losses(steps) == uninterrupted(strategy)  # exactly: the same bits
    resumed = summary["resumes"]
    assert [(r["from_step"], r["restart"]) for r in resumed] == [(ONCE_STEP - ONCE_STEP % EVERY, 1)]
    assert len(summary["restarts"]) == 1 and "rank 1: killed by SIGKILL" in summary["restarts"][0]
    assert [s["step"] for s in steps if s.get("untimed")] == [resumed[0]["from_step"]]  # probe + reload step


@pytest.mark.torchrun
def test_a_rerun_resumes_where_the_failed_attempt_stopped(tiny_assets, tmp_path, uninterrupted):
    overrides = {"training": {"checkpoint_every": EVERY, "fault_injection": "kill_rank1_once"}}
    failed, steps = launch_test_run(tiny_assets, tmp_path, "dp_naive", overrides)
    assert failed["status"] == "oom" and failed["reason"].startswith("rank 1: killed by SIGKILL")
    assert [s["step"] for s in steps] == list(range(ONCE_STEP))  # what the failed attempt measured
    checkpoints = tmp_path / "checkpoints" / "dp_naive"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000001"]

    summary, steps = launch_test_run(tiny_assets, tmp_path, "dp_naive", overrides)  # Snakemake reruns the job
    assert summary["status"] == "ok", summary["reason"]
    assert [s["step"] for s in steps] == STEPS
    assert _losses(steps) == uninterrupted("dp_naive")
    assert [r["from_step"] for r in summary["resumes"]] == [EVERY]
    assert not checkpoints.exists()  # finished: a forced rerun starts from step 0


@pytest.mark.torchrun
def test_restarts_exhausted_is_recorded(run_strategy):
    summary, _ = run_strategy("ddp", {"training": {"checkpoint_every": 1, "fault_injection": "kill_rank0"},
                                      "launch": {"max_restarts": 1}})
    assert summary["status"] == "oom"
    assert summary["reason"].startswith("rank 0: killed by SIGKILL"), summary["reason"]
    assert len(summary["restarts"]) == 1  # the first failure, then the restart's


def test_partial_and_foreign_checkpoints_are_never_loaded(tmp_path, capsys):
    def folder(name, config_hash):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(json.dumps({"config_hash": config_hash}))

    folder("step-00000001", "mine")
    folder("step-00000005", "other settings")
    (tmp_path / ".step-00000003.partial").mkdir()  # a crash while writing
    assert Checkpointer(tmp_path, 2, "mine", 0, 1).latest() == (1, tmp_path / "step-00000001")
    out = capsys.readouterr().out
    assert "incomplete" in out and "other settings" in out


def test_a_strategy_that_cannot_resume_is_rejected_before_launch():
    exp = dict(TEST_EXPERIMENT, training=dict(TEST_EXPERIMENT["training"], checkpoint_every=2))
    assert not REGISTRY["tp"].resumable
    with pytest.raises(ConfigError, match="cannot checkpoint") as err:
        REGISTRY["tp"].check(exp, "experiments.test")
    assert err.value.field == "experiments.test.training.checkpoint_every"
    REGISTRY["ddp"].check(exp, "experiments.test")
