"""Checkpoints and resume: a run that dies continues from its latest complete checkpoint, under the
same plan (`training.checkpoint_every`: the same per-step losses as an uninterrupted run, bit for bit)
or under any other (`training.resume_from`, or the same run at another world size): another strategy,
other degrees, fewer or more ranks.

A checkpoint is plan-independent: a folder `<root>/step-<N>/` with
- `model.safetensors`: every parameter, whole, under the model's own names (a Hugging Face checkpoint's
  names; a mixture of experts' under its global expert indices), fp32 (the master weights);
- `optimizer.safetensors`: each parameter's optimizer state, whole, as `<name>::<key>` (AdamW's
  `exp_avg`, `exp_avg_sq`, `step`; SGD without momentum has none);
- `meta.json`: step, what the trajectory depends on (`trajectory`), the plan that wrote it (strategy,
  world size), the step records so far and earlier resumes;
- `rng_rank<r>.pt`: every rank's RNG states (restored when the world size is the same).
Every strategy writes it through `shardlab.strategies.portable` (its ranks' pieces made whole) and reads
it by cutting its own pieces from the whole tensors: loading is resharding. The data position is the
step itself: batches are a deterministic function of the step (`TokenBatches.global_batch`), and so is
the learning rate (`loop.learning_rate`).

A checkpoint is written under a temporary name and renamed when it is complete, so a folder named
`step-<N>` is whole; anything else (a crash mid-write) is skipped with a message and removed, never
loaded. A run's own checkpoints made with other settings are skipped; a checkpoint named by
`training.resume_from` that differs in what the trajectory depends on, or whose parameters the plan
cannot hold, is an error naming the difference, before training starts.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardlab.strategies import get_spec
from shardlab.strategies.expert_parallel.options import moe_settings
from shardlab.strategies.portable import SEPARATOR, IncompatibleCheckpoint, check_names, gather

KEEP = 2  # complete checkpoints kept: the newest, and the one before in case the newest is damaged
NAME = re.compile(r"^step-(\d{8})$")
MODEL_FILE, OPTIMIZER_FILE, META_FILE = "model.safetensors", "optimizer.safetensors", "meta.json"
# Settings that change neither the model nor the batches nor the update: a checkpoint survives them.
NOT_TRAJECTORY = ("checkpoint_every", "keep_checkpoints", "resume_from", "fault_injection", "log_every", "save_model",
                  "save_model_every")


def trajectory(exp: dict, strategy: str) -> dict:
    """What a checkpoint must share with the run that continues it: the model (with a mixture of experts'
    settings), the data and the training settings, but neither the plan nor the launch (world size,
    timeouts, restarts, threads): it resumes under any plan."""
    training = {k: v for k, v in exp["training"].items() if k not in NOT_TRAJECTORY}
    key = {"model": exp["model"], "data": exp["data"], "training": training}
    if get_spec(strategy).model is not None:  # the strategy trains a variant of the model (its experts)
        key["experts"] = moe_settings(exp.get("strategy_options", {}).get(strategy, {}))
    return key


def resume_key(trajectory: dict) -> str:
    """A trajectory's fingerprint: a run's own checkpoints made with other settings are skipped."""
    return hashlib.sha256(json.dumps(trajectory, sort_keys=True).encode()).hexdigest()[:12]


def differences(stored: dict, current: dict, path: str = "") -> list[str]:
    """The settings that differ between two trajectories, by field path."""
    found = []
    for key in sorted(set(stored) | set(current)):
        a, b, where = stored.get(key), current.get(key), f"{path}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, f"{where}.")
        elif a != b:
            found.append(f"{where}: {a!r} in the checkpoint, {b!r} in this run")
    return found


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Stored:
    """A checkpoint's whole state, read one parameter at a time (each rank reads only what it holds)."""

    def __init__(self, folder: Path, optimizer: bool = True):
        from safetensors import safe_open

        self.folder, self.with_optimizer = folder, optimizer
        missing = [name for name in (META_FILE, MODEL_FILE, OPTIMIZER_FILE) if not (folder / name).is_file()]
        if missing:
            raise IncompatibleCheckpoint(f"{folder} is not a plan-independent checkpoint: it has no {', '.join(missing)} "
                                         "(a checkpoint of this project's layout before 2026-12-07, or another program's)")
        self.meta = json.loads((folder / META_FILE).read_text())
        self.model = safe_open(str(folder / MODEL_FILE), framework="pt")
        self.optimizer = safe_open(str(folder / OPTIMIZER_FILE), framework="pt")
        self.states: dict[str, list[str]] = {}
        for key in self.optimizer.keys():
            name, _, state = key.rpartition(SEPARATOR)
            self.states.setdefault(name, []).append(state)

    def shapes(self) -> dict[str, tuple]:
        return {name: tuple(self.model.get_slice(name).get_shape()) for name in self.model.keys()}

    def __call__(self, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        keys = self.states.get(name, []) if self.with_optimizer else []
        return self.model.get_tensor(name), {k: self.optimizer.get_tensor(f"{name}{SEPARATOR}{k}") for k in keys}


def checkpoint_folder(path: Path) -> Path:
    """A checkpoint named by `training.resume_from`: a `step-<N>` folder, or a run's checkpoint root (its
    latest complete one)."""
    path = Path(path)
    if (path / META_FILE).exists():
        return path
    steps = sorted(p for p in path.iterdir() if NAME.match(p.name)) if path.is_dir() else []
    if not steps:
        raise IncompatibleCheckpoint(f"training.resume_from: no complete checkpoint in {path}")
    return steps[-1]


class Checkpointer:
    """Save every `every` steps under `root` (None, or every 0: never); find and load the latest complete
    checkpoint, or one from elsewhere."""

    def __init__(self, root: Path | None, every: int, trajectory: dict, rank: int, world_size: int, strategy: str = ""):
        self.root, self.every, self.trajectory = Path(root) if root else None, every if root else 0, trajectory
        self.key = resume_key(trajectory)
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
        self.seconds: list[float] = []  # wall time of each save (the checkpoint's cost)
        self.bytes = 0  # size of the last checkpoint on disk

    def due(self, step: int, last_step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0 and step < last_step

    def latest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint made with these settings; stale or partial ones are reported."""
        if self.root is None or not self.root.is_dir():
            return None
        found = []
        for path in self.root.iterdir():
            match = NAME.match(path.name)
            if not match:
                print(f"[checkpoint] skipping incomplete checkpoint {path} (never finished writing)", flush=True)
                continue
            meta = json.loads((path / META_FILE).read_text())
            if meta["resume_key"] != self.key:
                print(f"[checkpoint] skipping {path}: made with other settings", flush=True)
                continue
            found.append((int(match.group(1)), path))
        return max(found) if found else None

    def save(self, strategy, step: int, meta: dict) -> None:
        started = time.perf_counter()
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".step-{step:08d}.partial"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        state = gather(strategy)  # collective: every rank's pieces made whole on rank 0
        torch.save(rng_state(), tmp / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            from safetensors.torch import save_file

            save_file(state.parameters, str(tmp / MODEL_FILE))
            save_file(state.flat_optimizer(), str(tmp / OPTIMIZER_FILE))
        _barrier()
        if self.rank == 0:
            meta = dict(meta, step=step, resume_key=self.key, trajectory=self.trajectory, world_size=self.world_size,
                        strategy=self.strategy)
            (tmp / META_FILE).write_text(json.dumps(meta, default=str))
            tmp.rename(final)  # the commit: a folder named step-<N> is complete
            self._prune()
            self.bytes = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        _barrier()
        self.seconds.append(time.perf_counter() - started)

    def check(self, stored: Stored) -> None:
        """A checkpoint from elsewhere (`training.resume_from`) must share this run's trajectory."""
        differ = differences(stored.meta["trajectory"], self.trajectory)
        if differ:
            raise IncompatibleCheckpoint(f"{stored.folder} was written by another training: " + "; ".join(differ))

    def load(self, strategy, path: Path, foreign: bool = False, optimizer: bool = True) -> dict:
        """Restore model, optimizer and (at the same world size) this rank's RNG states, resharded for
        `strategy`; returns the checkpoint's meta. `foreign`: not this run's own (checked first).
        `optimizer` False leaves the optimizer's state out (the fault drop_optimizer_state)."""
        stored = Stored(path, optimizer)
        if foreign:
            self.check(stored)
        held = strategy.held_parameters()
        check_names(strategy, held, stored.shapes())
        strategy.restore(held, stored)
        strategy.resume_at(stored.meta["step"] + 1)
        rng = path / f"rng_rank{self.rank}.pt"
        if stored.meta["world_size"] == self.world_size and rng.exists():  # resharded: the ranks' streams differ anyway
            set_rng_state(torch.load(rng, weights_only=False))
        return stored.meta

    def _prune(self) -> None:
        for path in self.root.iterdir():
            if path.name.startswith(".step-"):
                shutil.rmtree(path, ignore_errors=True)
        complete = sorted(p for p in self.root.iterdir() if NAME.match(p.name))
        for path in complete[:-KEEP]:
            shutil.rmtree(path, ignore_errors=True)

    def remove_all(self) -> None:
        """After a finished run: a later rerun of it starts from scratch, not from its last step."""
        if self.rank == 0 and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
