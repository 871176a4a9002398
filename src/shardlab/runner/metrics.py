"""What a run writes: per-step JSONL, per-rank measurements, environment, and summary.json."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import psutil

from shardlab.config import REPO_ROOT


FORKED_MARK = "SHARDLAB_FORKED_RANK"  # set by runner.rank_server in every process it forks
RESUMES_FILE = "resumes.json"  # in an attempt folder, written when the attempt resumes from a checkpoint


def attempt_resumes(attempt: Path) -> list[dict]:
    """The resumes so far of an attempt that resumed (the summary of one that then failed says so too)."""
    path = Path(attempt) / RESUMES_FILE
    return json.loads(path.read_text()) if path.exists() else []


def forked_by_rank_server() -> bool:
    """Whether this rank was forked by a rank server (`runner.rank_server` marks its children)."""
    return os.environ.get(FORKED_MARK) == "1"


def environment(topo) -> dict:
    import torch  # imported here: the launcher uses this module and must start fast, without torch
    import transformers

    on_gpu = topo.device.type == "cuda"
    device_name = torch.cuda.get_device_name(topo.device) if on_gpu else cpu_model()
    return {
        "torch": torch.__version__,
        # The CUDA toolkit torch was built with and the NCCL it loaded, where the run used them.
        "cuda": torch.version.cuda if on_gpu else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None,
        "transformers": transformers.__version__,
        "deepspeed": _version("deepspeed"),
        "python": platform.python_version(),
        "device_type": topo.device.type,
        "device_name": device_name,
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "world_size": topo.world_size,
        "backend": topo.backend,
        "threads_per_rank": torch.get_num_threads(),
        "rank_server": forked_by_rank_server(),
        "hostname": platform.node(),
        # A copy of the tree without its history (a lent machine) is named by whoever sent it.
        "git_commit": _git("rev-parse", "--short", "HEAD") or os.environ.get("SHARDLAB_GIT_COMMIT"),
        "git_dirty": git_dirty(),
    }


def _version(package: str) -> str | None:
    """An installed package's version without importing it (DeepSpeed's import costs seconds)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def git_dirty() -> bool | None:
    """Whether tracked files differ from `git_commit` (the run's code is then not that commit's);
    None outside a git checkout."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


class StepLog:
    """Per-step records, appended as JSON lines by rank 0."""

    def __init__(self, path: Path | None):
        self.path = path
        self.records: list[dict] = []
        if path:
            path.write_text("")

    def restore(self, records: list[dict]) -> None:
        """Start from a checkpoint's records (a resumed run): no step twice, none missing."""
        self.records = list(records)
        if self.path:
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def append(self, record: dict) -> None:
        self.records.append(record)
        if self.path:
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    tmp.replace(path)  # atomic: a reader never sees half a summary


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
