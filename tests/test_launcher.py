"""The launcher owns its runs: every way out leaves no process behind, the recorded reason is the
root cause (first failing rank and why), and a rerun never leaves an earlier attempt's files
beside its own. Faults come from `training.fault_injection` (shardlab.runner.faults)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import TEST_EXPERIMENT
from shardlab.costs.shapes import ModelShape
from shardlab.runner.failures import failure_outcome, launch_failure
from shardlab.runner.launch import launch, share_reference
from shardlab.runner.faults import FAULT_STEP
from shardlab.errors import Interrupted
from shardlab.runner.process import AGENT_ERROR_FILE, GRACE_S, RANK_LOG_DIR, Outcome, run_processes


def _left_running(tag) -> list[str]:
    return [" ".join(p.info["cmdline"])[:200] for p in run_processes(str(tag))]


def _parameters(tiny_assets) -> int:
    record = json.loads((tiny_assets[0] / "shardlab_model.json").read_text())
    return ModelShape.from_dict(record["shape"]).parameters()


@pytest.mark.torchrun
def test_a_silent_hang_is_stopped_at_the_deadline_and_nothing_is_left(run_strategy, tmp_path):
    deadline = 12  # about twice a launch's start-up: the ranks usually reach the hang first
    started = time.monotonic()
    summary, steps = run_strategy("dp_naive", {"training": {"fault_injection": "hang"}, "launch": {"timeout_s": deadline}})
    assert summary["status"] == "failed" and summary["reason"].startswith(f"timed out after {deadline} s")
    # The deadline holds although the ranks print nothing (they would sleep for an hour).
    assert time.monotonic() - started < deadline + 2 * GRACE_S + 20
    assert all(s["step"] < FAULT_STEP for s in steps)  # steps before the hang (if it got that far) are kept
    assert not _left_running(tmp_path)


@pytest.mark.torchrun
def test_sigterm_to_the_launcher_stops_the_whole_run(tiny_assets, tmp_path):
    import copy

    from shardlab.config import deep_merge

    model_dir, tokens = tiny_assets
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"training": {"fault_injection": "hang"}})
    (tmp_path / "exp.json").write_text(json.dumps(exp))
    out = tmp_path / "runs" / "dp_naive"
    launcher = subprocess.Popen([sys.executable, "-m", "shardlab", "launch", "--experiment-config",
                                 str(tmp_path / "exp.json"), "--strategy", "dp_naive", "--model-dir", str(model_dir),
                                 "--tokens", str(tokens), "--out", str(out)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any("shardlab.runner.worker" in " ".join(p.info["cmdline"]) for p in run_processes(str(tmp_path))):
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.5)
    time.sleep(2)
    launcher.send_signal(signal.SIGTERM)  # what Snakemake sends when a job is cancelled
    assert launcher.wait(timeout=60) == 128 + signal.SIGTERM  # the job fails...
    assert not _left_running(tmp_path)  # ...and takes torchrun and every rank with it
    attempt = json.loads((out / "summary.json").read_text())["attempt"]
    recorded = json.loads((Path(attempt) / "summary.json").read_text())  # ...and says so where it is kept
    assert recorded["status"] == "failed" and "interrupted by SIGTERM" in recorded["reason"]


@pytest.mark.torchrun
def test_a_rank_killed_by_sigkill_is_the_reason_not_its_peer(run_strategy, tiny_assets):
    summary, _ = run_strategy("dp_naive", {"training": {"fault_injection": "kill_rank0"}})
    assert summary["status"] == "oom"
    assert summary["reason"].startswith("rank 0: killed by SIGKILL"), summary["reason"]
    assert summary["model"]["parameters"] == _parameters(tiny_assets)  # failures still say what they trained


@pytest.mark.torchrun
def test_out_of_memory_on_one_rank_names_that_rank(run_strategy):
    summary, _ = run_strategy("dp_naive", {"training": {"fault_injection": "oom_rank1"}})
    assert summary["status"] == "oom"
    assert summary["reason"].startswith("rank 1: OutOfMemoryError"), summary["reason"]
    assert any("rank 0" in f for f in summary["failures"][1:])  # rank 0's lost peer, listed after the cause


@pytest.mark.torchrun
def test_output_that_is_not_utf8_is_logged_and_the_run_finishes(run_strategy, tmp_path):
    summary, _ = run_strategy("dp_naive", {"training": {"fault_injection": "non_utf8"}})
    assert summary["status"] == "ok", summary["reason"]
    assert "\ufffd" in (tmp_path / "runs" / "dp_naive" / "run.log").read_text(encoding="utf-8")


@pytest.mark.torchrun
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_an_init_failure_is_recorded_with_its_reason(run_strategy):
    summary, _ = run_strategy("ddp", {"launch": {"device": "cuda"}})
    assert summary["status"] == "failed"
    assert "launch.device is 'cuda' but torch sees no CUDA device" in summary["reason"], summary["reason"]


def test_a_failed_rerun_leaves_no_stale_files(tiny_assets, tmp_path):
    """An earlier successful attempt's artifacts, model and log are gone when a rerun fails (here
    before launch, on a batch that does not divide)."""
    out = tmp_path / "runs" / "zero1"
    for stale in ("artifacts/ds_config.json", "model/config.json", "run.log"):
        (out / stale).parent.mkdir(parents=True, exist_ok=True)
        (out / stale).write_text("from an earlier attempt")
    exp = dict(TEST_EXPERIMENT, training=dict(TEST_EXPERIMENT["training"], global_batch_size=7))
    (tmp_path / "exp.json").write_text(json.dumps(exp))
    summary = launch(exp, tmp_path / "exp.json", "zero1", *tiny_assets, out)
    assert summary["status"] == "failed" and "global_batch_size" in summary["reason"]
    assert not (out / "artifacts").exists() and not (out / "model").exists()
    assert "configuration rejected" in (out / "run.log").read_text()
    assert summary["started"] <= summary["finished"]


def test_a_shared_reference_shares_the_saved_model(tmp_path):
    source, out = tmp_path / "a" / "runs" / "single", tmp_path / "b" / "runs" / "single"
    (source / "model").mkdir(parents=True)
    (source / "model" / "config.json").write_text("{}")
    (source / "summary.json").write_text(json.dumps({"experiment": "a", "status": "ok"}))
    (source / "metrics.jsonl").write_text("")
    summary = share_reference(source, out, "b")
    assert (summary["experiment"], summary["reused_from"]) == ("b", "a")
    assert (out / "model" / "config.json").exists()


# --- root cause, without launching ----------------------------------------------------------------
TORCHRUN_REPORT = """Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 11)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 10)  (SIGKILL)
"""


def _error(run_dir: Path, rank: int, type_: str, message: str, t: float) -> None:
    """A rank's error file as torch's ErrorHandler writes it, with the rank and time `record` adds."""
    folder = run_dir / RANK_LOG_DIR / "run_abc" / "attempt_0" / str(rank)
    folder.mkdir(parents=True)
    (folder / "error.json").write_text(json.dumps({"message": {
        "message": f"{type_}: {message}",
        "extraInfo": {"py_callstack": f"Traceback (most recent call last):\n  ...\n{type_}: {message}\n",
                      "timestamp": str(int(t)), "rank": rank, "time": t}}}))


def _outcome(run_dir: Path, returncode=1, stopped=None) -> Outcome:
    return Outcome(run_dir, returncode, stopped, 60)


def test_root_cause_order(tmp_path):
    """Own errors by time first, then signal deaths, then lost peers; torchrun's SIGTERM to the
    survivors is never a cause."""
    (tmp_path / "run.log").write_text(TORCHRUN_REPORT)
    _error(tmp_path, 1, "RuntimeError", "[pair.cc:537] Read error: Connection reset by peer", 1.0)
    outcome = failure_outcome(_outcome(tmp_path))
    assert outcome["status"] == "oom" and outcome["reason"].startswith("rank 0: killed by SIGKILL")
    assert outcome["failures"][1].startswith("rank 1: RuntimeError")

    _error(tmp_path, 0, "ValueError", "bad shape\nmore", 2.0)
    _error(tmp_path, 2, "TypeError", "earlier", 1.5)
    outcome = failure_outcome(_outcome(tmp_path))
    assert outcome["status"] == "failed" and outcome["reason"] == "rank 2: TypeError: earlier"
    assert [f.split(":")[0] for f in outcome["failures"]] == ["rank 2", "rank 0", "rank 0", "rank 1"]
    assert outcome["traceback"].endswith("TypeError: earlier\n")  # where the root cause was raised


def test_an_out_of_memory_error_file_is_recorded_as_oom(tmp_path):
    _error(tmp_path, 1, "OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", 5.0)
    outcome = failure_outcome(_outcome(tmp_path))
    assert outcome["status"] == "oom" and outcome["reason"].startswith("rank 1: OutOfMemoryError: CUDA out of memory")


def test_torch_plain_error_file_takes_the_rank_from_its_folder(tmp_path):
    """A rank decorated with torch's own @record (no rank in the file) is named by its local-rank folder."""
    folder = tmp_path / RANK_LOG_DIR / "run_abc" / "attempt_0" / "1"
    folder.mkdir(parents=True)
    (folder / "error.json").write_text(json.dumps({"message": {"message": "KeyError: 'x'", "extraInfo": {
        "py_callstack": "Traceback ...", "timestamp": "1700000000"}}}))
    assert failure_outcome(_outcome(tmp_path))["reason"] == "rank 1: KeyError: 'x'"


def test_an_error_file_cut_off_by_the_stop_is_not_a_reason(tmp_path):
    """A rank stopped while writing its error file (its peer died first) leaves it empty or cut: the
    peer's death stays the reason, and the cut file is no failure of its own."""
    (tmp_path / "run.log").write_text(TORCHRUN_REPORT)
    _error(tmp_path, 1, "RuntimeError", "[pair.cc:553] Connection closed by peer", 1.0)
    folder = tmp_path / RANK_LOG_DIR / "run_abc" / "attempt_0" / "2"
    folder.mkdir(parents=True)
    for cut in ("", '{"message": {"message": "Runti'):
        (folder / "error.json").write_text(cut)
        outcome = failure_outcome(_outcome(tmp_path))
        assert outcome["reason"].startswith("rank 0: killed by SIGKILL") and len(outcome["failures"]) == 2


def test_torchruns_own_error_is_the_reason_when_no_rank_left_one(tmp_path):
    (tmp_path / AGENT_ERROR_FILE).write_text(json.dumps({"message": {"message": "RendezvousTimeoutError: no peers",
                                                                      "extraInfo": {"timestamp": "1"}}}))
    assert failure_outcome(_outcome(tmp_path))["reason"] == "torchrun: RendezvousTimeoutError: no peers"


def test_without_error_files_the_printed_output_is_the_fallback(tmp_path):
    (tmp_path / "run.log").write_text("starting\nsomething: SomeError happened\nbye\n")
    assert failure_outcome(_outcome(tmp_path, 3))["reason"] == "exit code 3: something: SomeError happened"
    timed_out = failure_outcome(_outcome(tmp_path, None, "timeout"), "comm_bench.timeout_s")
    assert timed_out["reason"] == "timed out after 60 s (comm_bench.timeout_s); the run was stopped"
    assert timed_out["status"] == "failed" and timed_out["failures"] == []


def test_a_launch_that_was_interrupted_fails_the_job(tmp_path):
    with pytest.raises(Interrupted):
        launch_failure(_outcome(tmp_path, -15, "SIGTERM"), tmp_path / "out.json", "--timeout-s")
    (tmp_path / "out.json").write_text("{}")
    assert launch_failure(_outcome(tmp_path, 0), tmp_path / "out.json", "--timeout-s") is None


def test_provenance_says_whether_the_tree_was_dirty(tmp_path, monkeypatch):
    from shardlab.runner import metrics

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    monkeypatch.setattr(metrics, "REPO_ROOT", tmp_path)
    assert metrics.git_dirty() is False
    (tmp_path / "f.py").write_text("a = 2\n")
    assert metrics.git_dirty() is True


@pytest.mark.torchrun
def test_a_run_records_where_its_launch_time_went(run_once):
    """The launch-cost breakdown (docs/measurements.md, "Launch cost"): every phase from the launcher's start of
    the agent to the agent's exit is recorded, none negative, and together they fit in the wall time."""
    import pandas as pd

    from shardlab.tables.runs import LAUNCH_PHASES, launch_cost

    summary, _ = run_once("ddp")
    startup = summary["startup"]
    assert all(startup[p] >= 0 for p in LAUNCH_PHASES), startup
    assert sum(startup[p] for p in LAUNCH_PHASES) <= startup["launch_wall_s"]
    assert 0 < startup["first_step_s"] <= startup["training_s"]
    # ...and the launch-cost table reads exactly what the run wrote (its summary, flattened as the runs table is)
    cost = launch_cost(pd.json_normalize([summary])).set_index("phase")
    assert cost.loc["fixed_s", "median_s"] == pytest.approx(startup["launch_wall_s"] - startup["training_s"])
    assert cost.loc["fixed_s", "rank_server"] == "1 of 1"  # on CPU the ranks were forked by the rank server


def test_the_launch_cost_table_counts_each_launch_once():
    """Medians over finished runs that launched: a failed run and a shared reference (a copy of another
    run's launch) are left out; exit is the wall time no phase accounts for, fixed all but training."""
    import pandas as pd

    from shardlab.tables.runs import LAUNCH_PHASES, launch_cost

    def run(status, wall, training, reused=None, forked=True):
        phases = {f"startup.{p}": 0.1 for p in LAUNCH_PHASES}
        return {"status": status, "reused_from": reused, "environment.rank_server": forked, **phases,
                "startup.training_s": training, "startup.launch_wall_s": wall}

    runs = pd.DataFrame([run("ok", 3.0, 2.0), run("ok", 5.0, 2.0, forked=False), run("ok", 3.0, 2.0, reused="x"),
                         run("failed", 99.0, 1.0)])
    cost = launch_cost(runs).set_index("phase")
    assert cost.loc["launch_wall_s", "median_s"] == 4.0 and cost.loc["training_s", "median_s"] == 2.0
    assert cost.loc["fixed_s", "median_s"] == 2.0
    assert cost.loc["exit_s", "median_s"] == pytest.approx(4.0 - 2.0 - 0.1 * (len(LAUNCH_PHASES) - 1))
    assert set(cost["runs"]) == {2} and set(cost["rank_server"]) == {"1 of 2"}
