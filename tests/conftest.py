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


@pytest.fixture(scope="session")
def run_once(tiny_assets, tmp_path_factory):
    """run_once(name, overrides) -> (summary, per-step records), launched once per session for each
    distinct (strategy, overrides): for tests that only read a healthy run's outcome (parity, and the
    uninterrupted runs that resumed ones must equal), so that they share one launch."""
    cache = {}

    def run(strategy, overrides=None):
        key = (strategy, json.dumps(overrides or {}, sort_keys=True))
        if key not in cache:
            cache[key] = launch_test_run(tiny_assets, tmp_path_factory.mktemp(strategy), strategy, overrides)
        return copy.deepcopy(cache[key])

    return run


@pytest.fixture(scope="session")
def reference_losses(tiny_assets, tmp_path_factory):
    """Per-step losses of the single-device reference on TEST_EXPERIMENT (one launch per session)."""
    summary, steps = launch_test_run(tiny_assets, tmp_path_factory.mktemp("reference"), "single")
    assert summary["status"] == "ok", summary["reason"]
    return [s["loss"] for s in steps]
