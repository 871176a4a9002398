"""The workflow end to end: lint, the DAG on the reduced config, failures recorded as data."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import REPO


def snakemake(*args, timeout=1500):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_lint_is_clean():
    proc = snakemake("--lint")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Lints for" not in proc.stdout + proc.stderr, proc.stdout[-3000:]


def test_runpod_profile_resolves_from_repository_root():
    proc = snakemake("-n", "--cores", "all", "--profile", "runpod", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run_strategy" in proc.stdout


@pytest.mark.e2e
def test_dag_end_to_end_on_reduced_config(tmp_path):
    results, resources = tmp_path / "results", tmp_path / "resources"
    proc = snakemake("--cores", "2", "--nolock", "--configfile", "config/test.yaml",
                     "--config", f"results_dir={results}", f"resources_dir={resources}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]

    config = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    expected = {(exp, s) for exp, e in config["experiments"].items() for s in e["strategies"]}
    runs = pd.read_csv(results / "tables" / "runs.csv")
    assert set(zip(runs["experiment"], runs["strategy"])) == expected
    assert (runs["status"] == "ok").all(), runs[runs["status"] != "ok"][["strategy", "reason"]]
    steps = pd.read_csv(results / "tables" / "steps.csv")
    assert len(steps) == sum(config["defaults"]["training"]["steps"] if "training" not in e or "steps" not in e["training"]
                             else e["training"]["steps"] for e in config["experiments"].values() for _ in e["strategies"])

    html = (results / "report" / "report.html").read_text()
    assert html.count("vegaEmbed(\"#chart-") >= 5  # every chart embedded...
    assert html.count("window.vegaEmbed=") == 1  # ...with the Vega bundle inlined once (offline)
    assert "Traceback" not in html
    assert 'data-mime-type="application/vnd.jupyter.stderr"' not in html  # no cell wrote to stderr
    for figure in ("throughput", "memory_by_category", "loss_curves", "dp_comm_time"):
        assert (results / "report" / "figures" / f"{figure}.png").stat().st_size > 1000
    renderer = (results / "report" / "renderer.txt").read_text()
    assert renderer.startswith("quarto") or renderer.startswith("fallback")


@pytest.mark.torchrun
def test_out_of_memory_is_recorded_and_partial_metrics_kept(run_strategy):
    summary, steps = run_strategy("dp_naive", {"training": {"fault_injection": "raise_oom"}})
    assert summary["status"] == "oom"
    assert "OutOfMemoryError" in summary["reason"]
    assert [s["step"] for s in steps] == [0]  # what was measured before the failure is kept


@pytest.mark.torchrun
def test_crash_is_recorded_with_reason(tiny_assets, tmp_path):
    from conftest import TEST_EXPERIMENT
    from shardlab.runner.launch import launch

    _, tokens = tiny_assets
    exp_path = tmp_path / "exp.json"
    exp_path.write_text(json.dumps(TEST_EXPERIMENT))
    summary = launch(TEST_EXPERIMENT, exp_path, "ddp", tmp_path / "no-such-model", tokens, tmp_path / "runs" / "ddp")
    assert summary["status"] == "failed"
    assert summary["reason"].startswith("rank ")
    assert json.loads((tmp_path / "runs" / "ddp" / "summary.json").read_text())["status"] == "failed"
    # Every attempt keeps its own folder, outside what Snakemake deletes on a rerun.
    assert [p.name for p in (tmp_path / "attempts" / "ddp").iterdir()] and Path(summary["attempt"]).is_dir()


def test_hub_model_offline_gives_a_clear_error(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    spec = json.dumps({"name": "pythia-160m", "source": "hub", "hub_id": "EleutherAI/pythia-160m"})
    proc = subprocess.run([sys.executable, "-m", "shardlab", "prepare-model", "--model-json", spec, "--out", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert "could not download 'EleutherAI/pythia-160m'" in proc.stderr
    assert "model.source: local" in proc.stderr
    assert "Traceback" not in proc.stderr
