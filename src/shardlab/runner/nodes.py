"""Runs over several nodes: one torchrun agent per node, joined by a c10d rendezvous.

Under Slurm (`SLURM_JOB_ID` set, a run of launch.nodes > 1) the launcher starts the agents with
`srun --ntasks=<nodes>`, one task per node of the job's allocation; the rendezvous lives on the
allocation's first node (`scontrol show hostnames` of its node list) at a port and id of this job,
so two jobs sharing a node never join each other's rendezvous. Outside Slurm every rank of a run
runs on this machine (`torchrun --standalone`).

The executor's job step strips most SLURM_* variables from a job's shell (SLURM_JOB_ID stays), so
the node list is read from `scontrol show job` when SLURM_JOB_NODELIST is not set.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

PORT_BASE, PORT_SPAN = 20000, 10000  # rendezvous ports: PORT_BASE + job id mod PORT_SPAN


@dataclass(frozen=True)
class Rendezvous:
    """Where the agents of one multi-node run meet: `nodes` agents at host:port under `run_id`."""

    nodes: int
    host: str
    port: int
    run_id: str

    def torchrun_args(self) -> list[str]:
        return [f"--nnodes={self.nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.host}:{self.port}",
                f"--rdzv-id={self.run_id}"]


def slurm_job_id() -> str | None:
    """The Slurm job this process runs in, if any."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"scontrol {' '.join(args)} failed: {err}") from err


def job_nodelist(job_id: str) -> str:
    """The allocation's node list (compressed, e.g. gpu[01-04]): SLURM_JOB_NODELIST, else scontrol."""
    if os.environ.get("SLURM_JOB_NODELIST"):
        return os.environ["SLURM_JOB_NODELIST"]
    found = re.search(r"(?:^|\s)NodeList=(\S+)", _scontrol("show", "job", "--oneliner", job_id))
    if not found or found.group(1) in ("(null)", ""):
        raise RuntimeError(f"Slurm job {job_id} has no node list yet (scontrol show job)")
    return found.group(1)


def head_node(nodelist: str) -> str:
    """The first host of a Slurm node list, expanded by `scontrol show hostnames`."""
    hosts = _scontrol("show", "hostnames", nodelist).split()
    if not hosts:
        raise RuntimeError(f"scontrol show hostnames {nodelist} named no host")
    return hosts[0]


def rendezvous_port(job_id: str) -> int:
    return PORT_BASE + int(re.sub(r"\D", "", job_id) or 0) % PORT_SPAN


def slurm_rendezvous(nodes: int, job_id: str, restart: int) -> Rendezvous:
    """This job's rendezvous: its first node, its port, and an id per restart (a fresh rendezvous)."""
    return Rendezvous(nodes, head_node(job_nodelist(job_id)), rendezvous_port(job_id), f"shardlab-{job_id}-{restart}")


def srun_prefix(nodes: int, cpus_per_node: int, gpus_per_node: int) -> list[str]:
    """`srun` starting one task (one torchrun agent) per node of the allocation; a failed agent ends all."""
    prefix = ["srun", f"--ntasks={nodes}", f"--cpus-per-task={cpus_per_node}", "--kill-on-bad-exit=1",
              "--cpu-bind=none"]
    return [*prefix, f"--gres=gpu:{gpus_per_node}"] if gpus_per_node else prefix
