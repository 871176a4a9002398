"""Timed steps measure training only: no instrumentation, no evaluation traffic.

- Pipelines record their op timeline and live saved bytes (bubble, memory) on untimed steps only:
  the warm-up steps after step 0 (step 0 is the loop's ActivationProbe), topped up with extra steps
  after training. The worker's medians time the steps from `training.warmup_steps` on.
- Communication issued by validation (cp_ring's ring, ep_moe's all-to-all) is not counted in any
  step's communication time: the loop pauses the strategy's comm timer around evaluation.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import TEST_EXPERIMENT
from shardlab.core.data import TokenBatches
from shardlab.runner.loop import train
from shardlab.runner.metrics import StepLog
from shardlab.strategies.base import CommTimer, Strategy
from shardlab.tables.pipeline import run_rows, timeline_rows


def _batches(training: dict) -> TokenBatches:
    tokens = np.random.default_rng(0).integers(0, TEST_EXPERIMENT["model"]["vocab_size"], 20_000)
    return TokenBatches(tokens, training["seq_len"], training["global_batch_size"], training["seed"])


def _cpu_topology(world_size: int = 1):
    from shardlab.core.topology import Topology

    return Topology(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), backend="gloo")


# --- (8) evaluation communication stays out of the steps' comm time ----------------------------------
STEP_COMM_S = 0.004  # what each fake step reports as its own communication
EVAL_COMM_S = 0.02  # what each fake validation batch spends blocked in communication


class _EvaluatesWithComm(Strategy):
    """cp_ring / ep_moe in miniature: evaluation's collectives run under the step's comm timer."""

    measures_comm = True

    def forward_backward(self, inputs, labels, scale):
        loss = self.model(inputs.float()).pow(2).mean()
        (loss * scale).backward()
        self.comm.seconds += STEP_COMM_S  # the step's own (deterministic) communication
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, inputs, labels):
        with self.comm.blocked():
            time.sleep(EVAL_COMM_S)
        self.evaluated = getattr(self, "evaluated", 0) + 1
        return self.model(inputs.float()).pow(2).mean()


def test_validation_communication_is_not_counted_in_any_step():
    training = dict(TEST_EXPERIMENT["training"], steps=6, eval_every=2, eval_batches=2)
    strategy = _EvaluatesWithComm(nn.Linear(training["seq_len"], 1), _cpu_topology(), training, {})
    log = StepLog(None)
    train(strategy, _batches(training), training, log)
    assert strategy.evaluated == 3 * training["eval_batches"]  # after steps 1, 3 and 5
    assert [r["step"] for r in log.records if "val_loss" in r] == [1, 3, 5]
    comm = [r["comm_time_s"] for r in log.records]
    assert comm == pytest.approx([STEP_COMM_S] * training["steps"], abs=1e-9), comm  # steps 2 and 4 leaked before


def test_comm_timer_pause_drops_only_what_ran_inside():
    timer = CommTimer()
    timer.seconds = 1.0
    with timer.paused():
        with timer.blocked():
            time.sleep(0.001)
    with timer.blocked():
        pass
    assert 1.0 <= timer.pop() < 1.001


# --- (7) pipelines time their steps uninstrumented ----------------------------------------------------
@pytest.fixture
def one_rank_gloo():
    """A one-process gloo world: the pipeline strategies run their schedules (one stage) in-process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.torchrun
@pytest.mark.parametrize("warmup_steps", [1, 3])
@pytest.mark.parametrize("strategy_name", ["pp_gpipe", "pp_1f1b"])
def test_pipeline_timed_steps_run_uninstrumented(strategy_name, warmup_steps, one_rank_gloo, monkeypatch):
    from transformers import GPTNeoXForCausalLM

    from shardlab.core.model import tiny_neox_config
    from shardlab.strategies import get_spec
    from shardlab.strategies.pipeline_parallel import probe

    hooks_on = []  # True while the live-saved-bytes hooks are installed

    class SpyLiveSavedBytes(probe.LiveSavedBytes):
        def __enter__(self):
            hooks_on.append(True)
            return super().__enter__()

        def __exit__(self, *exc):
            hooks_on.pop()
            return super().__exit__(*exc)

    monkeypatch.setattr(probe, "LiveSavedBytes", SpyLiveSavedBytes)
    training = dict(TEST_EXPERIMENT["training"], steps=6, warmup_steps=warmup_steps, eval_every=2)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(tiny_neox_config(TEST_EXPERIMENT["model"]))
    strategy = get_spec(strategy_name).load()(model, _cpu_topology(), training, {"n_microbatches": 2})

    calls = []  # per training schedule step: (timeline recording, saved-bytes hooks on); one per loop step
    schedule = strategy.pipeline.schedule
    schedule_step = schedule.step

    def spy_step(*args, **kwargs):
        if schedule._has_backward:  # schedule.eval (validation) runs step() forward-only
            calls.append((strategy.probe.timeline.recording, bool(hooks_on)))
        return schedule_step(*args, **kwargs)

    monkeypatch.setattr(schedule, "step", spy_step)
    optimizer_steps = []
    optimizer_step = strategy.optimizer.step
    monkeypatch.setattr(strategy.optimizer, "step", lambda *a, **k: (optimizer_steps.append(1), optimizer_step(*a, **k))[1])

    log = StepLog(None)
    measured = train(strategy, _batches(training), training, log)

    timed = [r["step"] for r in log.records if r["step"] >= warmup_steps]  # runner.worker.summarize's rule
    assert timed and all(calls[step] == (False, False) for step in timed), calls
    assert calls[0] == (False, False)  # step 0: the loop's ActivationProbe, whose hooks must not be shadowed
    # The bubble and memory measurements still exist, taken on untimed steps only.
    steps = measured["pp_instrumented_steps"]
    assert measured["pp_measured_steps"] == len(steps) == probe.MEASURED_STEPS
    assert all(step not in timed for step in steps), steps
    assert all(calls[step] == (True, True) for step in steps), calls
    assert len(calls) == max(steps) + 1  # extra steps (and the bare step that re-sets up after the last eval)
    # Never the step right after an evaluation: its schedule re-setup would inflate idle time and saved bytes.
    evaluated_after = {r["step"] for r in log.records if "val_loss" in r}
    assert all(step - 1 not in evaluated_after for step in steps), (steps, evaluated_after)
    assert len(set(strategy.probe.live_peaks)) == len(set(strategy.probe.saved_totals)) == 1  # one stage, fixed shapes
    # Extra measuring steps change nothing: one optimizer step per training step, no gradients left.
    assert len(optimizer_steps) == training["steps"]
    assert all(p.grad is None for p in strategy.model.parameters())
    assert measured["pp_peak_live_activation_bytes"] > 0 and measured["pp_timeline"]
    summary = {"experiment": "e", "strategy": strategy_name, "status": "ok", "ranks": [dict(measured, rank=0)]}
    row = run_rows(summary)[0]
    assert row["busy_s"] > 0 and row["span_s"] >= row["busy_s"] * 0.99 and row["idle_fraction"] is not None
    assert {r["op"] for r in timeline_rows(summary)} == {"forward", "loss", "backward"}


@pytest.mark.torchrun
def test_pipeline_instruments_only_untimed_steps_under_torchrun(run_strategy):
    summary, steps = run_strategy("pp_1f1b", {"training": {"warmup_steps": 2, "eval_every": 2}})
    assert summary["status"] == "ok", summary["reason"]
    warmup, n_steps = 2, TEST_EXPERIMENT["training"]["steps"]
    for rank in summary["ranks"]:
        instrumented = rank["pp_instrumented_steps"]
        assert instrumented[0] == 1 and all(s < warmup or s >= n_steps for s in instrumented), instrumented
        assert rank["pp_measured_steps"] == len(instrumented) and rank["pp_timeline"]
        assert 0 <= rank["pp_idle_fraction"] < 1


# --- communication time on CUDA is the collective's completion, not its enqueue --------------------
def test_comm_timer_synchronizes_cuda_at_both_ends_and_not_cpu(monkeypatch):
    """NCCL calls return once enqueued, so an unsynchronized timer would read ~0 on GPU. Checked on
    CPU through the timer's path: a CUDA timer synchronizes before (queued compute is not counted)
    and after (the collective has finished); a CPU timer adds nothing."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    timer = CommTimer(torch.device("cuda", 0))
    with timer.blocked():
        events.append("collective")
    assert events == [("sync", torch.device("cuda", 0)), "collective", ("sync", torch.device("cuda", 0))]

    events.clear()
    with CommTimer(torch.device("cpu")).blocked():
        events.append("collective")
    assert events == ["collective"]


# --- the instrumentation benchmark (shardlab.bench.instrumentation) ------------------------------
def test_blocks_alternate_so_each_mode_runs_first_as_often():
    from shardlab.bench.instrumentation import block_order, overhead

    assert block_order(2) == ["instrumented", "bare", "bare", "instrumented"]
    assert block_order(3).count("bare") == 3
    value, low, high = overhead([1.1, 1.1, 1.1], [1.0, 1.0, 1.0])
    assert value == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)
    value, low, high = overhead([1.0, 1.2, 1.4], [1.0, 1.0, 1.0])
    assert low < value < high


@pytest.mark.torchrun
def test_the_instrumentation_benchmark_times_both_modes_under_torchrun(tiny_assets, tmp_path):
    """The benchmark runs (2 ranks, gloo) and records its samples; a benchmark, not a timed test: no
    speed is asserted."""
    import json

    from shardlab.runner.launch import launch_module, run_environment

    model_dir, tokens = tiny_assets
    settings, out = tmp_path / "experiment.json", tmp_path / "run" / "result.json"
    settings.write_text(json.dumps(TEST_EXPERIMENT))
    run_args = ["--experiment-config", str(settings), "--strategy", "dp_naive", "--model-dir", str(model_dir),
                "--tokens", str(tokens), "--blocks", "2", "--steps-per-block", "1", "--warmup-steps", "1",
                "--out", str(out)]
    failure = launch_module(2, "shardlab.bench.instrumentation", run_args, out.parent, out, 300, "launch.timeout_s",
                            env=run_environment(TEST_EXPERIMENT, "dp_naive"))
    assert failure is None, failure
    result = json.loads(out.read_text())
    assert {len(v) for v in result["samples"].values()} == {2}
    assert all(t > 0 for v in result["samples"].values() for t in v)
    assert result["overhead"] == pytest.approx(result["instrumented_step_s"] / result["bare_step_s"] - 1)
    assert result["overhead_low"] <= result["overhead"] <= result["overhead_high"]
