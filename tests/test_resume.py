"""Checkpoint and resume (`training.checkpoint_every`, `launch.max_restarts`) under real torchrun:
a run that loses a rank continues from its latest complete checkpoint, by the launcher's restart
or by a rerun of the job, with per-step losses equal to an uninterrupted run's, bit for bit (CPU,
fp32, deterministic kernels), and no step missing or recorded twice."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import ADAMW_OVERRIDES, MOE_OVERRIDES, REPO, TEST_EXPERIMENT, assert_losses_match, launch_test_run
from shardlab.config import deep_merge
from shardlab.runner.faults import FAULT_STEP, ONCE_STEP
from shardlab.runner.launch import checkpoint_dir
from shardlab.strategies.composed.export import search_runnable
from shardlab.runner.process import run_processes
from shardlab.strategies import REGISTRY

HANG_TIMEOUT_S = 5  # process-group timeout: longer than any healthy collective of these runs
DEADLINE_S = 150  # the run's own deadline (launch.timeout_s), which the collective timeout must beat
EVERY = 2  # checkpoints after steps 1, 3: the fault at step 3 comes before the second one
STEPS = list(range(TEST_EXPERIMENT["training"]["steps"]))
# One or more strategies of every multi-process family, each with the options its tests use.
FAMILIES = {
    "ddp": {}, "zero3": {}, "fsdp2_full": {},
    "tp_sp": {}, "tp_sp_dtensor": {},
    "pp_1f1b": {},
    "hybrid_dp_pp": {"strategy_options": {"hybrid_dp_pp": {"world_size": 4, "n_microbatches": 2}}},
    "cp_ring": {},
    "ep_moe": MOE_OVERRIDES,
}
FAMILY_OF = {name: REGISTRY[name].family for name in FAMILIES}


FAULT_LOG = os.environ.get("SHARDLAB_FAULT_LOG")  # scripts/fault-drill.sh collects the outcomes here


def _losses(steps):
    return [s["loss"] for s in steps]


def _steps_lost(attempts: Path, resumed_from: int) -> int:
    """Steps the first (failed) attempt completed that the resumed run had to redo."""
    first = min(attempts.iterdir())  # attempt folders are named by their start time
    done = len((first / "metrics.jsonl").read_text().splitlines())
    return done - resumed_from


def _record(strategy: str, fault: str, recovery: str, summary: dict, started: float, steps_lost=None,
            every: int = EVERY) -> None:
    """One fault's outcome for scripts/fault-drill.sh (nothing unless SHARDLAB_FAULT_LOG is set)."""
    if not FAULT_LOG:
        return
    row = {"strategy": strategy, "family": REGISTRY[strategy].family, "fault": fault, "recovery": recovery,
           "status": summary["status"], "restarts": len(summary.get("restarts", [])),
           "resumed_from": [r["from_step"] for r in summary.get("resumes", [])], "steps_lost": steps_lost,
           "checkpoint_every": every, "wall_s": round(time.monotonic() - started, 1)}
    with open(FAULT_LOG, "a") as log:
        log.write(json.dumps(row) + "\n")


def test_every_multi_process_family_is_covered():
    families = {spec.family for spec in REGISTRY.values() if not spec.single_process}
    assert families == set(FAMILY_OF.values())


@pytest.fixture
def uninterrupted(run_once):
    """Per-step losses of the run without checkpoints or faults (shared with the parity tests)."""
    def losses(strategy):
        summary, steps = run_once(strategy, FAMILIES.get(strategy))
        assert summary["status"] == "ok", summary["reason"]
        return _losses(steps)

    return losses


@pytest.mark.torchrun
def test_the_same_config_run_twice_gives_the_same_losses(run_strategy, uninterrupted):
    """Determinism, which exact resume rests on: deterministic kernels, pinned threads, seeded data."""
    summary, steps = run_strategy("tp_sp")
    assert summary["status"] == "ok", summary["reason"]
    assert _losses(steps) == uninterrupted("tp_sp")  # another launch of the same settings: the same bits


@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", FAMILIES)
def test_a_restart_after_a_lost_rank_resumes_exactly(strategy, run_strategy, uninterrupted, tmp_path):
    started = time.monotonic()
    faults = {"training": {"checkpoint_every": EVERY, "fault_injection": "kill_rank1_once"}, "launch": {"max_restarts": 1}}
    summary, steps = run_strategy(strategy, deep_merge(faults, FAMILIES[strategy]))
    lost = _steps_lost(tmp_path / "attempts" / strategy, ONCE_STEP - ONCE_STEP % EVERY)
    _record(strategy, f"rank 1 SIGKILL at step {ONCE_STEP}", "launcher restart", summary, started, lost)
    assert summary["status"] == "ok", summary["reason"]
    assert [s["step"] for s in steps] == STEPS  # none missing, none twice
    assert _losses(steps) == uninterrupted(strategy)  # exactly: the same bits
    resumed = summary["resumes"]
    assert [(r["from_step"], r["restart"]) for r in resumed] == [(ONCE_STEP - ONCE_STEP % EVERY, 1)]
    assert len(summary["restarts"]) == 1 and "rank 1: killed by SIGKILL" in summary["restarts"][0]
    assert [s["step"] for s in steps if s.get("untimed")] == [resumed[0]["from_step"]]  # probe + reload step
    assert 0 <= lost <= EVERY


# Who waits for the hung rank: torch's process group in a collective (DDP; TP, CP and EP wait the same
# way), DeepSpeed's communication layer (ZeRO-3), and a point-to-point receive (a pipeline). One
# strategy of each kind of wait; the other families add launches (~10 s each), not cases. The launcher
# restarts once (and gives up) for DDP; that logic is the strategy's no more, so the others hang once.
HANG_CASES = {"ddp": 1, "zero3": 0, "pp_1f1b": 0}  # strategy: launch.max_restarts


@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", HANG_CASES)
def test_a_hung_rank_times_out_and_exhausted_restarts_are_recorded(strategy, run_strategy, tmp_path):
    """Rank 1 hangs silently at step 1 in every attempt: the others wait in a collective until the
    process-group timeout, the launcher restarts (if allowed), the restart hangs too, and the run is
    recorded as failed with the timeout as its reason, long before the run's own deadline."""
    started = time.monotonic()
    restarts = HANG_CASES[strategy]
    faults = {"training": {"checkpoint_every": 1, "fault_injection": "hang_rank1"},
              "launch": {"max_restarts": restarts, "collective_timeout_s": HANG_TIMEOUT_S, "timeout_s": DEADLINE_S}}
    summary, steps = run_strategy(strategy, deep_merge(faults, FAMILIES[strategy]))
    _record(strategy, f"rank 1 hangs at step {FAULT_STEP}, every attempt", "none: restarts exhausted", summary, started)
    assert summary["status"] == "failed"
    assert "collective timed out (launch.collective_timeout_s)" in summary["reason"], summary["reason"]
    assert len(summary["restarts"]) == restarts and all("collective timed out" in r for r in summary["restarts"])
    assert [r["from_step"] for r in summary["resumes"]] == [1] * restarts  # a restart resumes from step 0's checkpoint
    assert [s["step"] for s in steps] == [0]  # step 0, measured by the first attempt, kept
    assert time.monotonic() - started < DEADLINE_S  # the deadline was never needed
    assert not run_processes(str(tmp_path))  # and no rank of any attempt is left running


@pytest.mark.torchrun
def test_a_rerun_resumes_where_the_failed_attempt_stopped(tiny_assets, tmp_path, uninterrupted):
    overrides = {"training": {"checkpoint_every": EVERY, "fault_injection": "kill_rank1_once"}}
    failed, steps = launch_test_run(tiny_assets, tmp_path, "dp_naive", overrides)
    assert failed["status"] == "oom" and failed["reason"].startswith("rank 1: killed by SIGKILL")
    assert [s["step"] for s in steps] == list(range(ONCE_STEP))  # what the failed attempt measured
    checkpoints = tmp_path / "checkpoints" / "dp_naive"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000001"]

    started = time.monotonic()
    summary, steps = launch_test_run(tiny_assets, tmp_path, "dp_naive", overrides)  # Snakemake reruns the job
    _record("dp_naive", f"rank 1 SIGKILL at step {ONCE_STEP}", "rerun of the job", summary, started,
            _steps_lost(tmp_path / "attempts" / "dp_naive", EVERY))
    assert summary["status"] == "ok", summary["reason"]
    assert [s["step"] for s in steps] == STEPS
    assert _losses(steps) == uninterrupted("dp_naive")
    assert [r["from_step"] for r in summary["resumes"]] == [EVERY]
    assert not checkpoints.exists()  # finished: a forced rerun starts from step 0


@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", ["tp_sp"])
def test_a_checkpoint_written_at_4_ranks_resumes_at_2(strategy, tiny_assets, tmp_path, uninterrupted):
    """The same run at another world size: a 4-rank run of hand-cut TP+SP shards dies after its first
    checkpoint and its rerun on 2 ranks cuts its halves from the checkpoint's whole tensors, with the losses
    of an uninterrupted 2-rank run within the float32 rule (the reduction order changed with the world)."""
    faults = {"training": {"checkpoint_every": EVERY, "fault_injection": "kill_rank1_once"}}
    failed, _ = launch_test_run(tiny_assets, tmp_path, strategy, deep_merge(faults, {"launch": {"world_size": 4}}))
    assert failed["status"] != "ok" and failed["world_size"] == 4
    started = time.monotonic()
    summary, steps = launch_test_run(tiny_assets, tmp_path, strategy, faults)  # the rerun, on 2 ranks
    _record(strategy, f"rank 1 SIGKILL at step {ONCE_STEP} (4 ranks)", "rerun on 2 ranks", summary, started,
            _steps_lost(tmp_path / "attempts" / strategy, EVERY))
    assert summary["status"] == "ok", summary["reason"]
    assert [(r["from_step"], r["world_size"]) for r in summary["resumes"]] == [(EVERY, 2)]
    assert [s["step"] for s in steps] == STEPS
    assert_losses_match(_losses(steps), uninterrupted(strategy))


# The elastic drill: a 4-rank composed plan (ZeRO-1 over dp2, TP+SP over tp2) loses rank 1, and the job is
# started again on the 2 ranks left, under the plan the planner picks for them, from the last checkpoint.
DRILL = ("composed", {"strategy_options": {"composed": {"world_size": 4, "tp": 2, "sp": True, "dp_shard": "zero1"}}})


@pytest.mark.parity
@pytest.mark.torchrun
def test_elastic_drill_a_lost_rank_continues_on_fewer_ranks_under_the_planners_plan(run_once, tiny_assets, tmp_path):
    strategy, options = DRILL
    settings = deep_merge(copy.deepcopy(ADAMW_OVERRIDES), options)
    _, uninterrupted = run_once(strategy, settings)
    started = time.monotonic()
    every = ONCE_STEP  # the checkpoint after step 2, then rank 1 dies at step 3
    fault = {"training": {"checkpoint_every": every, "fault_injection": "kill_rank1_once"}}
    failed, done = launch_test_run(tiny_assets, tmp_path, strategy, deep_merge(settings, fault))
    assert failed["status"] != "ok" and failed["reason"].startswith("rank 1: killed by SIGKILL"), failed["reason"]
    assert [s["step"] for s in done] == list(range(ONCE_STEP))

    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), ADAMW_OVERRIDES)
    (plan, found), = search_runnable(exp, world=2, top=1).plans.items()  # the planner's best plan for 2 ranks
    resumed = {"strategy_options": {plan: found["options"]},
               "training": {"resume_from": str(checkpoint_dir(tmp_path / "runs" / strategy, strategy))}}
    summary, steps = launch_test_run(tiny_assets, tmp_path, plan, deep_merge(copy.deepcopy(ADAMW_OVERRIDES), resumed))
    _record(strategy, f"rank 1 SIGKILL at step {ONCE_STEP} (4 ranks)", f"restart on 2 ranks as {found['label']} "
            "(the planner's plan)", summary, started, len(done) - every, every)
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == 2
    assert [(r["from_step"], r["written_by"]["world_size"]) for r in summary["resumes"]] == [(every, 4)]
    assert [s["step"] for s in steps] == STEPS
    assert_losses_match(_losses(steps)[every:], _losses(uninterrupted)[every:])


def _study(root: Path, fault: str) -> Path:
    """The reduced study cut to one experiment (single, ddp), checkpointing every 2 steps, under `root`
    (the model and tokens beside it, shared by the studies of one test)."""
    config = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    config.update(results_dir=str(root / "results"), resources_dir=str(root.parent / "resources"), allow_outside_project=True,
                  experiments={"data_parallel": {"strategies": ["single", "ddp"]}})
    config.pop("resharding")  # its own launches: this test is about the runs' interrupt
    config["defaults"]["training"].update(checkpoint_every=EVERY, fault_injection=fault)
    path = root / "config.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def _snakemake(config: Path, *args: str, **popen) -> subprocess.Popen:
    # --prioritize: the single-device run first, so that one run has finished when the test interrupts.
    single = config.parent / "results" / "data_parallel" / "runs" / "single" / "summary.json"
    return subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", "--nolock", "--configfile", str(config),
                             "--prioritize", str(single), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


@pytest.mark.e2e
def test_an_interrupted_workflow_rerun_resumes_and_rebuilds_the_same_tables(tmp_path):
    """Ctrl-C (SIGINT to snakemake's process group, as a terminal sends it) while ddp stalls after its
    first checkpoint; the same command again redoes nothing finished, resumes ddp from step 2, and the
    tables equal those of a DAG that was never interrupted (timings, and the fault setting, aside)."""
    config = _study(tmp_path / "interrupted", "stall_rank1_once")
    results = config.parent / "results" / "data_parallel"
    proc = _snakemake(config, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (results / "checkpoints" / "ddp" / "step-00000001").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    single = (results / "runs" / "single" / "summary.json").read_text()  # finished before ddp started
    os.killpg(proc.pid, signal.SIGINT)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and "interrupted by SIGINT" in log, log[-3000:]
    assert not run_processes(str(config.parent))

    started = time.monotonic()
    rerun = _snakemake(config, "--omit-from", "render_report")  # the tables are compared, not the report
    log = rerun.communicate(timeout=600)[0]
    assert rerun.returncode == 0, log[-3000:]
    assert (results / "runs" / "single" / "summary.json").read_text() == single  # not redone
    assert len(list((results / "attempts" / "single").iterdir())) == 1
    ddp = json.loads((results / "runs" / "ddp" / "summary.json").read_text())
    _record("ddp", "Ctrl-C to snakemake at step 3", "same snakemake command again", ddp, started,
            _steps_lost(results / "attempts" / "ddp", EVERY))
    assert ddp["status"] == "ok" and [r["from_step"] for r in ddp["resumes"]] == [EVERY]

    baseline = _study(tmp_path / "uninterrupted", "none")
    log = _snakemake(baseline, "--omit-from", "render_report").communicate(timeout=600)[0]
    # Told to differ: the fault setting (and the settings hash), the resume record, the checkpoint
    # files' size (their meta.json lists the resumes), and which strategy the choice table names as
    # faster, with its text (a timing; its ratio columns are skipped as timings anyway), the
    # abstract's sentences, which quote those timings, and which steps are timed (the first step
    # after a resume reloads and probes: untimed).
    told = ("fault_injection|config_hash|resumes|checkpoint_bytes|^choice$|^versus$|^decided$|^evidence$|^sentence$"
            "|^timed$")
    compare = subprocess.run([sys.executable, str(REPO / "scripts" / "compare-tables.py"), "--ignore", told,
                              str(baseline.parent / "results" / "tables"), str(results.parent / "tables")],
                             capture_output=True, text=True)
    assert compare.returncode == 0, compare.stdout + log[-2000:]
