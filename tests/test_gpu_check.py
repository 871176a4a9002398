"""The GPU check's record (shardlab.tables.gpu_check): the planner's error before and after calibration on
the GPU, the memory model's error per category, and what counts as a failed check. The record's whole
path (the DAG, the tables, scripts/gpu-summary.py) runs in `.ci/run` as `scripts/gpu-check.sh --dry`."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from shardlab.config import REPO_ROOT, resolve_experiment
from shardlab.costs.plan import Cluster
from shardlab.costs.predict import evaluate
from shardlab.tables import TableInputs
from shardlab.tables.gpu_check import STACK, failures, name, record
from shardlab.tables.rank_predictions import run_setting

H100 = "NVIDIA H100 80GB HBM3"  # what torch.cuda.get_device_name says on the lent machine


def check_experiment() -> dict:
    config = yaml.safe_load((REPO_ROOT / "config" / "gpu-check.yaml").read_text())
    return {**resolve_experiment(config, "gpu_check"), "name": "gpu_check"}


def run(strategy: str, step_s: float, device: str = H100, status: str = "ok") -> dict:
    return {"experiment": "gpu_check", "strategy": strategy, "status": status, "reason": None, "world_size": 1,
            "step_time_median_s": step_s, "tokens_per_s": 4096 / step_s, "model.parameters": 1_011_781_632,
            "environment.device_name": device, "environment.torch": "2.11.0+cu130", "environment.cuda": "13.0",
            "environment.nccl": "2.28.9", "started": "2026-12-08T03:00:00"}


def inputs(runs: list[dict], ranks=None, predicted=None, parity=None) -> TableInputs:
    empty_ranks = pd.DataFrame(columns=["experiment", "strategy", "rank", "param_bytes"])
    tables = {"runs": pd.DataFrame(runs), "ranks": ranks if ranks is not None else empty_ranks,
              "rank_predictions": predicted if predicted is not None else pd.DataFrame(),
              "parity": parity if parity is not None else pd.DataFrame(columns=["experiment", "strategy"])}
    return TableInputs(experiments={"gpu_check": check_experiment()}, tables=tables)


def test_the_planner_is_scored_before_calibration_then_calibrated_on_the_single_device_run():
    runs = [run("single", 0.100), run("ddp", 0.110), run("zero3", 0.150)]
    rows = {r["strategy"]: r for r in record(inputs(runs))["runs"]}
    exp = check_experiment()
    for r in runs:  # before: the catalog's H100 and this project's stack, nothing fitted to these runs
        model, plan, workload = run_setting(r, exp, TableInputs(experiments={"gpu_check": exp}))
        predicted = evaluate(model, plan, Cluster("H100-80GB SXM", 1, 1), workload, STACK).step_s
        assert rows[r["strategy"]]["planner_before_error"] == pytest.approx((predicted - r["step_time_median_s"])
                                                                            / r["step_time_median_s"])
    # after: the compute rate that reproduces the single-device run, which is then the calibration point
    assert rows["single"]["calibration_run"] and not rows["ddp"]["calibration_run"]
    assert rows["single"]["planner_after_error"] == pytest.approx(0, abs=1e-9)
    assert rows["single"]["planner_after_step_s"] == pytest.approx(0.100)
    # DDP on one rank is the single-device plan: predicted the calibrated 0.100 s against 0.110 s measured
    assert rows["ddp"]["planner_after_error"] == pytest.approx(0.100 / 0.110 - 1, abs=1e-6)
    # MFU: 6 FLOPs per parameter multiplied by (the untied input embedding is a lookup) + attention
    matmul = 1_011_781_632 - 50304 * 2048
    assert rows["single"]["mfu"] == pytest.approx(40960 * (6 * matmul + 12 * 16 * 2048 * 512) / 989e12, rel=1e-9)


def test_a_device_the_catalog_does_not_know_gets_no_planner_figures_and_the_record_says_where_it_ran():
    rec = record(inputs([run("single", 0.1, device="Intel(R) Xeon(R) Processor")]))
    assert not any(k.startswith("planner_") for k in rec["runs"][0])
    assert rec["runs"][0]["mfu"] is None
    assert name(rec) == "2026-12-08-intel-r-xeon-r-processor"
    assert name(record(inputs([run("single", 0.1)]))) == "2026-12-08-nvidia-h100-80gb-hbm3"


def test_the_memory_model_error_is_per_category_on_the_fullest_rank():
    ranks = pd.DataFrame([{"experiment": "gpu_check", "strategy": "single", "rank": 0, "param_bytes": 100.0,
                           "grad_bytes": 100.0, "optimizer_bytes": 200.0, "activation_bytes": 50.0,
                           "peak_bytes": 500.0, "peak_kind": "allocator"}])
    predicted = pd.DataFrame([{"experiment": "gpu_check", "strategy": "single", "rank": 0,
                               "predicted_param_bytes": 100.0, "predicted_grad_bytes": 110.0,
                               "predicted_optimizer_bytes": 200.0, "predicted_activation_bytes": 40.0}])
    row = record(inputs([run("single", 0.1)], ranks, predicted))["runs"][0]
    assert (row["param_error"], row["optimizer_error"]) == (0.0, 0.0)
    assert row["grad_error"] == pytest.approx(0.10) and row["activation_error"] == pytest.approx(-0.20)
    assert row["peak_bytes"] == 500.0
    # the planner's device bytes for the fullest rank, against the allocator's peak
    assert row["planner_device_bytes_error"] == pytest.approx((row["planner_device_bytes"] - 500.0) / 500.0)


def test_a_failed_run_or_one_outside_the_parity_rule_fails_the_check():
    parity = pd.DataFrame([{"experiment": "gpu_check", "strategy": "ddp", "max_loss_deviation": 0.02,
                            "tolerance": 0.01, "tolerance_fraction": 0.002, "noise_floor": 0.002,
                            "within_tolerance": False, "undecided": None}])
    runs = [run("single", 0.1), run("ddp", 0.1), run("zero3", 0.1, status="failed")]
    assert failures(record(inputs(runs, parity=parity))) == ["ddp", "zero3"]
    assert failures(record(inputs(runs[:1]))) == []


def test_the_report_shows_the_newest_record_and_its_caption_follows_the_table():
    from shardlab.reporting.captions import gpu_measured
    from shardlab.tables.gpu_check import table

    assert gpu_measured(table([])).startswith("No run of this study on a GPU is recorded yet")
    parity = pd.DataFrame([{"experiment": "gpu_check", "strategy": s, "max_loss_deviation": d, "tolerance": 0.01,
                            "tolerance_fraction": 0.002, "noise_floor": 0.002, "within_tolerance": d < 0.01,
                            "undecided": None} for s, d in (("ddp", 0.001), ("zero3", 0.02))])
    older = record(inputs([run("single", 0.1)]))
    newer = record(inputs([run("single", 0.100), run("ddp", 0.110), run("zero3", 0.150)], parity=parity))
    older["date"], newer["date"] = "2026-12-01", "2026-12-08"
    newest = table([newer, older])
    assert list(newest["strategy"]) == ["single", "ddp", "zero3"] and set(newest["date"]) == {"2026-12-08"}
    caption = gpu_measured(newest)
    assert caption.startswith(f"On {H100}, 2026-12-08 (torch 2.11.0+cu130, CUDA 13.0, NCCL 2.28.9): 3 of 3 runs finished")
    assert "single device ran 40,960 tokens/s, 23% MFU" in caption
    assert "1 of 2 parallel runs reproduce the single-device losses within the parity rule in bf16" in caption
    held = (abs(0.100 / 0.110 - 1) + abs(newest.loc[2, "planner_after_error"])) / 2
    assert f"by {100 * held:.0f} % on the 2 runs held out" in caption
