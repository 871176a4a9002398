"""Checkpoints and resume (`training.checkpoint_every`): a run that dies continues from its latest
complete checkpoint, with the same per-step losses as an uninterrupted run.

A checkpoint is a folder `<root>/step-<N>/`: model and optimizer state as the strategy saves them
(`Strategy.save_state`: torch.distributed.checkpoint by default, each rank writing its own shards;
DeepSpeed's own `save_checkpoint` for the ZeRO rungs), every rank's RNG states, and `meta.json` (step, config hash, the step
records so far, earlier resumes). It is written under a temporary name and renamed when every
rank has finished, so a folder named `step-<N>` is complete; anything else (a crash mid-write) is
skipped with a message and removed, never loaded. The data position is the step itself: batches
are a deterministic function of the step (`TokenBatches.global_batch`), and so is the learning rate
(`loop.learning_rate`).
A checkpoint made with other settings (`resume_key`: what decides the training trajectory) is not
resumed from, nor one written at another world size by a strategy that cannot reshard its state.
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

KEEP = 2  # complete checkpoints kept: the newest, and the one before in case the newest is damaged
NAME = re.compile(r"^step-(\d{8})$")
# Settings that change neither the model nor the batches nor the update: a checkpoint survives them.
NOT_TRAJECTORY = ("checkpoint_every", "fault_injection", "log_every", "save_model", "save_model_every")


def resume_key(exp: dict, strategy: str) -> str:
    """What a checkpoint must share with the run that resumes it: model, data, training settings and
    the strategy's options, but not the launch (world size, timeouts, restarts, threads), so that a
    run restarted with more patience, or resharded to fewer ranks, still finds its checkpoints."""
    options = {k: v for k, v in exp.get("strategy_options", {}).get(strategy, {}).items() if k != "world_size"}
    training = {k: v for k, v in exp["training"].items() if k not in NOT_TRAJECTORY}
    key = {"model": exp["model"], "data": exp["data"], "training": training, "strategy": strategy, "options": options}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


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


class Checkpointer:
    """Save every `every` steps under `root`; find and load the latest complete checkpoint."""

    def __init__(self, root: Path, every: int, key: str, rank: int, world_size: int, reshardable: bool = False):
        self.root, self.every, self.key = Path(root), every, key
        self.rank, self.world_size, self.reshardable = rank, world_size, reshardable
        self.seconds: list[float] = []  # wall time of each save (the checkpoint's cost)
        self.bytes = 0  # size of the last checkpoint on disk

    def due(self, step: int, last_step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0 and step < last_step

    def latest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint made with these settings; stale or partial ones are reported."""
        if not self.root.is_dir():
            return None
        found = []
        for path in self.root.iterdir():
            match = NAME.match(path.name)
            if not match:
                print(f"[checkpoint] skipping incomplete checkpoint {path} (never finished writing)", flush=True)
                continue
            meta = json.loads((path / "meta.json").read_text())
            if meta["resume_key"] != self.key:
                print(f"[checkpoint] skipping {path}: made with other settings", flush=True)
                continue
            if meta["world_size"] != self.world_size and not self.reshardable:
                print(f"[checkpoint] skipping {path}: written by {meta['world_size']} ranks, and this strategy "
                      f"resumes only at the world size that wrote it (now {self.world_size})", flush=True)
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
        strategy.save_state(tmp)
        torch.save(rng_state(), tmp / f"rng_rank{self.rank}.pt")
        _barrier()
        if self.rank == 0:
            meta = dict(meta, step=step, resume_key=self.key, world_size=self.world_size)
            (tmp / "meta.json").write_text(json.dumps(meta, default=str))
            tmp.rename(final)  # the commit: a folder named step-<N> is complete
            self._prune()
            self.bytes = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        _barrier()
        self.seconds.append(time.perf_counter() - started)

    def load(self, strategy, path: Path) -> dict:
        """Restore model, optimizer and this rank's RNG states; returns the checkpoint's meta."""
        strategy.load_state(path)
        meta = json.loads((path / "meta.json").read_text())
        strategy.resume_at(meta["step"] + 1)
        rng = path / f"rng_rank{self.rank}.pt"
        if meta["world_size"] == self.world_size and rng.exists():  # resharded: the ranks' streams differ anyway
            set_rng_state(torch.load(rng, weights_only=False))
        return meta

    def _prune(self) -> None:
        for path in self.root.iterdir():
            if path.name.startswith(".step-"):
                shutil.rmtree(path, ignore_errors=True)
        complete = sorted(p for p in self.root.iterdir() if NAME.match(p.name))
        for path in complete[:-KEEP]:
            shutil.rmtree(path, ignore_errors=True)

    def remove_all(self) -> None:
        """After a finished run: a later rerun of it starts from scratch, not from its last step."""
        if self.rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)
