"""Fixtures: a tiny model and token file built once per session, and real `torchrun` launches of
TEST_EXPERIMENT (`helpers.launch_test_run`), once per test or once per session."""

from __future__ import annotations

import copy
import json

import pytest

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
