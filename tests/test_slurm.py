"""The DAG on a real Slurm (scripts/local-slurm.sh: one node from Debian's packages) through
`--profile slurm`: run jobs submitted by snakemake-executor-plugin-slurm, tables and report as local
rules, and one run launched as 2 "nodes" x 1 process (two torchrun agents started by `srun`, c10d
rendezvous on the allocation's first node) whose losses match the single-device reference.

On one machine the cluster has one node, so the test submits run jobs with --nodes=1
(`--set-resources run_strategy:nodes=1`): the two "nodes" are two tasks of one allocation. Skipped,
with the reason, where Slurm cannot be set up (not root, no apt mirror) or the plugin is missing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pandas as pd
import pytest
import yaml

from helpers import REPO, assert_losses_match, with_experiments
from shardlab.strategies import REGISTRY

SCRIPT = REPO / "scripts" / "local-slurm.sh"


def _slurm(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), command], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def slurm_cluster():
    """A working `srun`: the one already up, else one started here (and stopped afterwards)."""
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="snakemake-executor-plugin-slurm not installed "
                                                                    "(pip install -e '.[cluster]')")
    if _slurm("status").returncode == 0:
        yield
        return
    started = _slurm("start")
    if started.returncode == 3:
        pytest.skip(started.stderr.strip())
    assert started.returncode == 0, started.stdout + started.stderr
    yield
    _slurm("stop")


def two_node_config() -> dict:
    """config/test.yaml's settings with one experiment: the reference and DDP on 2 nodes x 1 process."""
    config = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    return with_experiments(config, {"two_nodes": {"strategies": ["single", "ddp"],
                                                   "launch": {"nodes": 2, "gpus_per_node": 1, "world_size": 2}}})


@pytest.mark.e2e
@pytest.mark.slurm
def test_reduced_dag_through_the_slurm_profile_with_a_two_node_run(slurm_cluster, tmp_path):
    results = tmp_path / "results"
    config = tmp_path / "slurm-test.yaml"
    config.write_text(yaml.safe_dump(dict(two_node_config(), results_dir=str(results),
                                          resources_dir=str(tmp_path / "resources"), allow_outside_project=True)))
    # The model and tokens first, locally: each job chained behind another costs the Slurm executor's
    # status-check back-off (5 s, then 15 s more), which would be most of this test.
    prepared = subprocess.run(["snakemake", "--cores", "2", "--nolock", "--configfile", str(config), "--until",
                               "prepare_data"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, (prepared.stdout + prepared.stderr)[-3000:]
    started = time.monotonic()
    # timeout -k: the Slurm executor ignores SIGTERM while it waits for jobs, so KILL follows
    proc = subprocess.run(["timeout", "-k", "10", "900", "snakemake", "--profile", "slurm", "--configfile", str(config),
                           "--set-resources", "run_strategy:nodes=1", "--nolock", "--slurm-keep-successful-logs"],
                          cwd=REPO, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "SLURM run ID" in proc.stdout + proc.stderr  # the slurm executor submitted the jobs

    runs = pd.read_csv(results / "tables" / "runs.csv")
    assert set(runs["strategy"]) == {"single", "ddp"} and (runs["status"] == "ok").all(), runs[["strategy", "reason"]]
    assert (results / "report" / "report.html").stat().st_size > 10_000
    parity = pd.read_csv(results / "tables" / "parity.csv").set_index("strategy")
    assert bool(parity.loc["ddp", "within_tolerance"]), parity.loc["ddp"]

    ddp = results / "two_nodes" / "runs" / "ddp"
    summary = json.loads((ddp / "summary.json").read_text())
    assert summary["world_size"] == 2
    launcher_log = (results / "two_nodes" / "logs" / "ddp.log").read_text()
    assert "on 2 nodes x 1 (Slurm job" in launcher_log, launcher_log[-2000:]  # two agents via srun, not standalone

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if line]

    training = two_node_config()["defaults"]["training"]
    reference = losses(results / "two_nodes" / "runs" / "single")
    assert_losses_match(losses(ddp), reference, tokens_per_step=training["global_batch_size"] * training["seq_len"])
    print(f"slurm DAG: {elapsed:.0f} s, ddp on 2 nodes x 1: max loss deviation "
          f"{parity.loc['ddp', 'max_loss_deviation']:.2g} (tolerance {parity.loc['ddp', 'tolerance']:.2g})")


@pytest.mark.parametrize("profile,configs", [("runpod", ["config/runpod.yaml"]),
                                             ("slurm", ["config/runpod.yaml", "config/cluster-gpu.yaml", "config/two-nodes.yaml"])])
def test_pod_study_dry_run_lists_every_family(profile, configs):
    """config/runpod.yaml is the full study: its dry run (through the pod profile, and through the Slurm
    profile with the cluster overlay) plans runs of every strategy family of the registry and the
    collective benchmark; on Slurm the 2-node experiment asks for 2 nodes, one task per node started
    with srun, 8 GPUs per node, and every run for GPUs."""
    pytest.importorskip("snakemake_executor_plugin_slurm")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--forceall", "--profile", profile, "--configfile",
                           *configs], cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    planned = set(re.findall(r"strategy=(\w+)", out))
    assert {REGISTRY[s].family for s in planned} == {spec.family for spec in REGISTRY.values()}
    assert "rule comm_bench:" in out
    if profile == "slurm":
        requests = re.findall(r"rule run_strategy:.*?resources: ([^\n]*)", out, flags=re.S)
        assert sum("nodes=2, tasks=2, mpi=srun, gres=gpu:8" in r for r in requests) == 3  # ddp, zero3, fsdp2_full
        asks_gpus = [re.search(r"(?:^|, )(?:gpu=[1-9]|gres=gpu:[1-9])", r) for r in requests]
        assert requests and all(asks_gpus)  # every run asks for its GPUs (no 'auto' on a cluster)
