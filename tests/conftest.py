"""Fixtures: a tiny model and token file built once per session, and real `torchrun` launches of
TEST_EXPERIMENT (`helpers.launch_test_run`), once per test or once per session; and the fast tier's
guard: a test not marked `torchrun`, `e2e` or `slurm` fails if it starts a process group."""

from __future__ import annotations

import copy
import json
import subprocess

import pytest
import torch.distributed as dist

from helpers import TEST_EXPERIMENT, launch_test_run


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """(model_dir, tokens_path) for TEST_EXPERIMENT, built once."""
    from shardlab.core.data import prepare_corpus
    from shardlab.core.model import prepare_model

    root = tmp_path_factory.mktemp("assets")
    exp = TEST_EXPERIMENT
    model_dir = prepare_model(exp["model"], root / "model")
    prepare_corpus(exp["data"], exp["model"], model_dir, root / "data")
    return model_dir, root / "data" / "tokens.npy"


@pytest.fixture
def run_strategy(tiny_assets, tmp_path):
    """run_strategy(name, overrides) -> (summary, per-step records): one real torchrun launch."""
    return lambda strategy, overrides=None: launch_test_run(tiny_assets, tmp_path, strategy, overrides)


class RunOnce:
    """run_once(name, overrides) -> (summary, per-step records), launched once per session for each
    distinct (strategy, overrides): for tests that only read a healthy run's outcome (parity, probes, the
    uninterrupted runs that resumed ones must equal), so that they share one launch.
    `run_once.run_dir(name, overrides)` is that run's folder (saved model, DeepSpeed config)."""

    def __init__(self, assets, tmp_path_factory):
        self.assets, self.tmp_path_factory, self.cache = assets, tmp_path_factory, {}

    def _run(self, strategy, overrides):
        key = (strategy, json.dumps(overrides or {}, sort_keys=True))
        if key not in self.cache:
            root = self.tmp_path_factory.mktemp(strategy)
            self.cache[key] = (launch_test_run(self.assets, root, strategy, overrides), root / "runs" / strategy)
        return self.cache[key]

    def __call__(self, strategy, overrides=None):
        return copy.deepcopy(self._run(strategy, overrides)[0])

    def run_dir(self, strategy, overrides=None):
        return self._run(strategy, overrides)[1]


@pytest.fixture(scope="session")
def run_once(tiny_assets, tmp_path_factory):
    return RunOnce(tiny_assets, tmp_path_factory)


@pytest.fixture(scope="session")
def reference_losses(run_once):
    """Per-step losses of the single-device reference on TEST_EXPERIMENT (the shared launch)."""
    summary, steps = run_once("single")
    assert summary["status"] == "ok", summary["reason"]
    return [s["loss"] for s in steps]


# What a fast-tier test must not start: torchrun (directly, through the study's agent, or through a
# `shardlab` command that launches one) or a process group in the test process itself.
LAUNCHES = ("torch.distributed.run", "torchrun", "shardlab.runner.agent")
LAUNCHING_COMMANDS = ("launch", "pretrain", "bench-comm", "bench-inference", "bench-paired", "parity-sensitivity")
SLOW_TIERS = ("torchrun", "e2e", "slurm")


def starts_torchrun(args) -> bool:
    words = args.split() if isinstance(args, str) else [str(a) for a in args]
    shardlab_command = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "shardlab"), None)
    return any(w.endswith(LAUNCHES) for w in words) or shardlab_command in LAUNCHING_COMMANDS


@pytest.fixture(autouse=True)
def fast_tier_starts_no_process_group(request, monkeypatch):
    if any(request.node.get_closest_marker(tier) for tier in SLOW_TIERS):
        return
    where = f"{request.node.nodeid} is in the fast tier (not marked {' / '.join(SLOW_TIERS)}) but"
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *rest, **kwargs):
        assert not starts_torchrun(args), f"{where} starts {args}"
        popen_init(self, args, *rest, **kwargs)

    def no_process_group(*args, **kwargs):
        raise AssertionError(f"{where} initialises a process group")

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(dist, "init_process_group", no_process_group)
