"""The Kubernetes profile (profiles/kubernetes, snakemake-executor-plugin-kubernetes): a dry run plans
the study with runs as pods and tables/report as local rules, the pod spec the plugin builds for a
run asks for what the experiment's launch settings say (CPU, memory, GPUs), and a multi-node run is
refused (one pod per job). No cluster is contacted: the plugin's `run_job` is called with a fake
Kubernetes API that keeps the Job it is given."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from helpers import REPO

k8s_plugin = pytest.importorskip("snakemake_executor_plugin_kubernetes",
                                 reason="snakemake-executor-plugin-kubernetes not installed (pip install -e '.[cluster]')")
pytest.importorskip("snakemake_storage_plugin_fs", reason="snakemake-storage-plugin-fs not installed")


def _rule_resources(monkeypatch, executor: str, overrides: dict, exp: str, strategy: str) -> dict:
    """{resource: value} of one run job as the workflow computes it under `executor` (evaluated like
    Snakemake does, unset ones dropped), plus the profile's default resources."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, ResourceSettings
    from snakemake.workflow import Workflow

    plugin = SimpleNamespace(cli_prefix=executor, common_settings=SimpleNamespace(local_exec=False))
    monkeypatch.setattr(Workflow, "executor_plugin", property(lambda self: plugin))
    monkeypatch.setattr(Workflow, "local_exec", property(lambda self: False))
    with SnakemakeApi() as api:
        workflow = api.workflow(resource_settings=ResourceSettings(cores=64), snakefile=REPO / "Snakefile",
                                config_settings=ConfigSettings(configfiles=[REPO / "config/test.yaml"], config=overrides),
                                workdir=REPO)
        rule = workflow.dag().workflow_api._workflow.get_rule("run_strategy")
        wildcards = SimpleNamespace(exp=exp, strategy=strategy)
        names = ("_cores", "nodes", "tasks", "mpi", "gpu", "gres", "tasks_per_gpu", "mem_mb")  # run.smk's own
        values = {name: rule.resources[name].evaluate(wildcards).value for name in names}
    return {name: value for name, value in values.items() if value is not None} | {"gpu_manufacturer": "nvidia"}


def _pod_job(resources: dict):
    """The V1Job the Kubernetes plugin submits for a job with these resources."""
    executor = k8s_plugin.Executor.__new__(k8s_plugin.Executor)
    submitted = []
    executor.__dict__.update(
        run_namespace="test", container_image="shardlab:test", persistent_volumes=[], k8s_service_account_name=None,
        privileged=False, secret_envvars={}, namespace="default", k8s_cpu_scalar=0.95,
        batchapi=SimpleNamespace(create_namespaced_job=lambda namespace, body: submitted.append(body)),
        _kubernetes_retry=lambda call: call(), report_job_submission=lambda info: None,
        format_job_exec=lambda job: "snakemake --target-jobs run_strategy:exp=x,strategy=y")
    if "logger" not in vars(type(executor)):
        executor.logger = logging.getLogger("k8s-test")
    executor.run_job(SimpleNamespace(resources=resources, jobid=1, attempt=1, is_containerized=False))
    return submitted[0]


CUDA = {"defaults": {"launch": {"device": "cuda", "threads_per_rank": 4, "mem_mb_per_rank": 16000}}}


def test_a_run_pod_asks_for_its_ranks_cpus_memory_and_gpus(monkeypatch):
    resources = _rule_resources(monkeypatch, "kubernetes", CUDA, "data_parallel", "ddp")
    job = _pod_job(resources)
    pod = job.spec.template.spec
    (container,) = pod.containers
    assert container.resources.requests == {"cpu": f"{int(2 * 4 * 0.95 * 1000)}m", "memory": "32000M",
                                            "nvidia.com/gpu": "2"}
    assert pod.restart_policy == "Never" and job.spec.backoff_limit == 0  # a failed run is not rerun by Kubernetes
    assert [t.key for t in pod.tolerations] == ["nvidia.com/gpu"]
    single = _pod_job(_rule_resources(monkeypatch, "kubernetes", CUDA, "data_parallel", "single"))
    assert single.spec.template.spec.containers[0].resources.requests["nvidia.com/gpu"] == "1"


def test_a_cpu_run_pod_asks_for_no_gpu(monkeypatch):
    resources = _rule_resources(monkeypatch, "kubernetes", {}, "data_parallel", "ddp")
    assert "gpu" not in resources and "mpi" not in resources
    requests = _pod_job(resources).spec.template.spec.containers[0].resources.requests
    assert "nvidia.com/gpu" not in requests and requests["memory"] == "4000M"


def test_a_multi_node_run_is_refused_on_kubernetes_and_asked_of_slurm(monkeypatch):
    # (test.yaml's TP experiment would be refused first: TP across nodes needs the option)
    two_nodes = {"defaults": {"launch": {"nodes": 2, "gpus_per_node": 1, "world_size": 2, "device": "cuda",
                                         "allow_tp_across_nodes": True}}}
    with pytest.raises(Exception, match="runs on 2 nodes, but the kubernetes executor"):
        _rule_resources(monkeypatch, "kubernetes", two_nodes, "data_parallel", "ddp")
    slurm = _rule_resources(monkeypatch, "slurm", two_nodes, "data_parallel", "ddp")
    assert {k: slurm[k] for k in ("nodes", "tasks", "mpi", "gres", "tasks_per_gpu", "_cores")} == \
        {"nodes": 2, "tasks": 2, "mpi": "srun", "gres": "gpu:1", "tasks_per_gpu": 0, "_cores": 1}
    assert "gpu" not in slurm  # per node as gres; `gpu` would be --gpus for the whole job


def test_kubernetes_profile_dry_run_plans_runs_as_pods_and_tables_locally(tmp_path):
    """The profile's storage prefix replaced by a temporary folder holding the shipped inputs (code,
    data, report sources), as a cluster's storage would after staging them."""
    storage = tmp_path / "storage"
    for folder in ("src", "data", "reports", "workflow"):
        target = storage / str(REPO).lstrip("/") / folder
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(REPO / folder)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--profile", "kubernetes", "--configfile",
                           "config/test.yaml", "--default-storage-prefix", str(storage)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    experiments = yaml.safe_load((REPO / "config/test.yaml").read_text())["experiments"].values()
    runs = sum(len(e["strategies"]) for e in experiments)
    assert out.count("rule run_strategy:") + out.count("rule share_reference:") == runs  # each of test.yaml's runs
    assert "(in storage)" in out  # inputs and outputs planned through the storage provider


def test_only_computing_jobs_leave_the_submit_host():
    """Tables, the report and small bookkeeping rules are local rules; runs, benchmarks, preparation and
    evaluation are submitted (the Snakefile's localrules, from rule names: new topics' tables included)."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, ResourceSettings

    with SnakemakeApi() as api:
        workflow = api.workflow(resource_settings=ResourceSettings(cores=1), snakefile=REPO / "Snakefile",
                                config_settings=ConfigSettings(configfiles=[REPO / "config/test.yaml"]), workdir=REPO)
        inner = workflow.dag().workflow_api._workflow
        local = {rule.name for rule in inner.rules if rule.name in inner._localrules}
        names = {rule.name for rule in inner.rules}
    assert {"render_report", "runs_tables", "verdicts_tables", "experiment_settings", "share_reference"} <= local
    assert {n for n in names if n.endswith("_tables")} <= local
    assert not local & {"run_strategy", "comm_bench", "tp_inference", "prepare_model", "prepare_data",
                        "science_evaluate"}
