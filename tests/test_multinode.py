"""Several nodes: the launch settings (nodes x gpus_per_node), the run layout and its topology rule
(tensor parallel inside a node), the multi-node torchrun command, and two torchrun agents meeting in a
c10d rendezvous on loopback (2 "nodes" x 1 process, no Slurm) whose losses match the single-device
reference."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess

import pytest

from helpers import REPO, TEST_EXPERIMENT, TEST_TOKENS_PER_STEP, assert_losses_match, with_experiments
from shardlab.config import deep_merge, resolve_launch, run_layout
from shardlab.errors import ConfigError
from shardlab.runner import nodes
from shardlab.runner.launch import agent_command, run_environment, torchrun_command
from shardlab.study import load_study, run_resources
from shardlab.tables.parity import loss_tolerance, max_deviation
from test_config import mutated


def _launch(**fields) -> dict:
    launch = {"nodes": 1, **fields}
    resolve_launch(launch, "launch")
    return launch


def test_world_is_nodes_times_gpus_per_node_and_auto_stays_on_one_node():
    assert _launch(nodes=2, gpus_per_node=4) == {"nodes": 2, "gpus_per_node": 4, "world_size": 8}
    assert _launch(nodes=2, world_size=8)["gpus_per_node"] == 4
    assert _launch(world_size="auto")["gpus_per_node"] == "auto"
    assert _launch(gpus_per_node="auto")["world_size"] == "auto"


@pytest.mark.parametrize("fields,field,problem", [
    ({"nodes": 2, "gpus_per_node": 4, "world_size": 6}, "launch.world_size", "nodes x gpus_per_node = 2 x 4"),
    ({"nodes": 3, "world_size": 8}, "launch.nodes", "does not split evenly over 3 nodes"),
    ({"nodes": 2, "gpus_per_node": "auto"}, "launch.gpus_per_node", "one machine"),
    ({"nodes": 2, "world_size": "auto"}, "launch.world_size", "one machine"),
])
def test_launch_settings_that_disagree_are_rejected_naming_the_field(fields, field, problem):
    with pytest.raises(ConfigError) as err:
        _launch(**fields)
    assert err.value.field == field and problem in str(err.value)


BAD_STUDIES = [
    ("defaults.launch.nodes", 0, "defaults.launch.nodes", "minimum"),
    ("defaults.launch.gpus_per_node", 0, "defaults.launch.gpus_per_node", ""),
    ("defaults.launch.nodes", 3, "experiments.data_parallel.launch.nodes", "does not split evenly"),
    ("defaults.launch.allow_tp_across_nodes", "yes", "defaults.launch.allow_tp_across_nodes", "boolean"),
]


@pytest.mark.parametrize("path,value,field,problem", BAD_STUDIES, ids=[f"{p}={v}" for p, v, _, _ in BAD_STUDIES])
def test_the_study_check_names_bad_launch_fields(path, value, field, problem):
    with pytest.raises(ConfigError) as err:
        load_study(mutated(path, value), base_dir=REPO)
    assert err.value.field == field and problem in str(err.value), str(err.value)


def _two_nodes(**launch) -> dict:
    """config/test.yaml on 2 nodes with these launch settings."""
    config = mutated("defaults.launch.nodes", 2)
    config["defaults"]["launch"].update(launch)
    return config


def test_tensor_parallel_across_nodes_is_rejected_unless_allowed():
    config = _two_nodes(world_size=2, gpus_per_node=1)
    with pytest.raises(ConfigError) as err:
        load_study(config, base_dir=REPO)
    assert err.value.field == "experiments.tensor_parallel.launch.nodes"
    assert "tensor-parallel group of 2 ranks across 2 nodes" in str(err.value)
    allowed = copy.deepcopy(config)
    allowed["defaults"]["launch"]["allow_tp_across_nodes"] = True
    study = load_study(allowed, base_dir=REPO)
    assert run_resources(study.experiments["tensor_parallel"], "tp")["nodes"] == 2
    # TP on one node of two (its own world size) is the rule's way: fine without the option
    inside = copy.deepcopy(config)
    inside["defaults"]["launch"].update(gpus_per_node=2, world_size=4)
    inside["experiments"]["tensor_parallel"]["strategy_options"] = {"tp": {"world_size": 2}, "tp_sp": {"world_size": 2}}
    inside = with_experiments(inside, {"tensor_parallel": inside["experiments"]["tensor_parallel"]})
    study = load_study(inside, base_dir=REPO)
    assert run_resources(study.experiments["tensor_parallel"], "tp")["nodes"] == 1


def test_layout_fills_nodes_and_resources_follow_it():
    launch = _launch(nodes=2, gpus_per_node=4, threads_per_rank=3)
    assert run_layout(launch, 8, "f") == (2, 4)
    assert run_layout(launch, 1, "f") == (1, 1)  # single: one process on one node
    assert run_layout(launch, 4, "f") == (1, 4)
    with pytest.raises(ConfigError, match="do not fill whole nodes"):
        run_layout(launch, 6, "f")
    exp = {"name": "e", "launch": dict(launch, device="cuda", mem_mb_per_rank=1000), "strategy_options": {}}
    assert run_resources(exp, "ddp") == {"nodes": 2, "ranks_per_node": 4, "threads": 12, "gpus_per_node": 4,
                                         "gpus": 8, "mem_mb": 4000}
    assert run_resources(exp, "single")["nodes"] == 1


def test_multi_node_command_under_slurm_and_standalone_otherwise(monkeypatch):
    exp = {"name": "e", "launch": _launch(nodes=2, gpus_per_node=4, threads_per_rank=2, device="cuda")}
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    command, where = agent_command(exp, 8, ["--x"], restart=0, env=dict(os.environ))
    assert "--rdzv-backend=static" in command and "--nproc-per-node=8" in command and "no Slurm job" in where

    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    monkeypatch.setattr(nodes, "_scontrol", lambda *args: "gpu07\ngpu08\n" if args[:2] == ("show", "hostnames") else "")
    command, where = agent_command(exp, 8, ["--x"], restart=1, env=dict(os.environ))
    assert command[:command.index(command[5])] == ["srun", "--ntasks=2", "--cpus-per-task=8", "--kill-on-bad-exit=1",
                                                   "--cpu-bind=none"]
    assert "--gres=gpu:4" in command and "--nproc-per-node=4" in command and "--rdzv-backend=static" not in command
    assert {"--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=gpu07:{20000 + 4711}",
            "--rdzv-id=shardlab-4711-1"} <= set(command)
    # without the node list in the environment (the executor's job step strips it), scontrol show job
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    monkeypatch.setattr(nodes, "_scontrol", lambda *args: {"job": "JobId=4711 NodeList=gpu[07-08] Other=x",
                                                           "hostnames": "gpu07\ngpu08"}[args[1]])
    assert nodes.slurm_rendezvous(2, "4711", 0).host == "gpu07"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.torchrun
@pytest.mark.parity
def test_two_agents_on_loopback_match_the_single_device_reference(tiny_assets, tmp_path, reference_losses):
    """Two torchrun agents (2 nodes x 1 process) join one c10d rendezvous on 127.0.0.1, as on two
    machines, and DDP's losses equal the single-device run's within the float32 rule."""
    model_dir, tokens = tiny_assets
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"launch": {"nodes": 2, "gpus_per_node": 1}})
    (tmp_path / "exp.json").write_text(json.dumps(exp))
    run_args = ["--experiment-config", str(tmp_path / "exp.json"), "--strategy", "ddp", "--model-dir", str(model_dir),
                "--tokens", str(tokens), "--out", str(tmp_path / "run")]
    rdzv = nodes.Rendezvous(2, "127.0.0.1", _free_port(), "loopback-test")
    agents = [subprocess.Popen(torchrun_command(1, run_args, rendezvous=rdzv), env=run_environment(exp, "ddp"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["status"] == "ok"
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
    assert_losses_match(losses, reference_losses)
    print(f"2 agents x 1 on loopback: max loss deviation {max_deviation(losses, reference_losses):.2g} "
          f"(tolerance {loss_tolerance(reference_losses, TEST_TOKENS_PER_STEP).value:.2g})")


def test_a_slurm_job_whose_allocation_cannot_be_read_is_recorded_as_failed(run_strategy, monkeypatch):
    """Under a Slurm job id that no controller knows (or without scontrol), a multi-node run fails
    before anything starts, with scontrol's failure as its reason; the DAG goes on."""
    monkeypatch.setenv("SLURM_JOB_ID", "999999999")
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol, whether Slurm is installed or not
    summary, steps = run_strategy("ddp", {"launch": {"nodes": 2, "gpus_per_node": 1}})
    assert summary["status"] == "failed" and steps == []
    assert summary["reason"].startswith("scontrol show job --oneliner 999999999 failed")
