"""What each technique keeps where (tables.mechanisms): shares of the single-device amount per rank, from the
cost model on each run's layout (tables.rank_predictions), for the family's most sharded run."""

import copy

import pytest

from shardlab.study import load_study_file
from shardlab.tables import TableInputs
from shardlab.tables.mechanisms import mechanisms as mechanisms_of
from shardlab.tables.mechanisms import strategies
from shardlab.tables.rank_predictions import rank_predictions
from shardlab.strategies import REGISTRY

from helpers import REPO


@pytest.fixture(scope="module")
def study():
    return load_study_file(REPO / "config/test.yaml", REPO).experiments


def mechanisms(inputs: TableInputs):
    """The table as the runs step builds it: from the runs' rows of `rank_predictions`."""
    return mechanisms_of(inputs.summaries, rank_predictions(inputs))


def _held(study, *runs):
    summaries = [{"experiment": exp, "strategy": s, "status": "ok", "world_size": world} for exp, s, world in runs]
    table = mechanisms(TableInputs(summaries=summaries, experiments=study))
    return table.set_index(["strategy", "rank", "category"])["share"].sort_index()


def test_each_family_splits_what_its_technique_splits(study):
    held = _held(study, ("data_parallel", "single", 1), ("data_parallel", "ddp", 2), ("zero", "zero3", 2),
                 ("tensor_parallel", "tp", 2), ("pipeline", "pp_1f1b", 2))
    assert held[("single", 0)].eq(1).all()
    for rank in (0, 1):
        assert held[("ddp", rank, "parameters")] == held[("ddp", rank, "optimizer state")] == 1  # replicas
        assert held[("ddp", rank, "activations")] == pytest.approx(0.5)  # half the batch each
        assert held[("zero3", rank, "parameters")] == pytest.approx(0.5, abs=0.02)  # every state sharded
        # DeepSpeed adds an fp32 master copy (4 bytes a value) to Adam's 8 and shards both: 12 / 8 / 2
        assert held[("zero3", rank, "optimizer state")] == pytest.approx(0.75, abs=0.02)
        assert 0.4 < held[("tp", rank, "parameters")] < 0.6  # split weights (layer norms and biases stay whole)
    # The pipeline's stages hold different layers, so their shares add up to the whole model.
    assert held[("pp_1f1b", 0, "parameters")] + held[("pp_1f1b", 1, "parameters")] == pytest.approx(1, abs=0.01)


def test_the_most_sharded_run_of_a_family_is_drawn_and_noise_runs_are_not(study):
    held = _held(study, ("zero", "zero1", 2), ("zero", "zero3", 2), ("data_parallel", "single_reordered", 1))
    assert set(held.index.get_level_values("strategy")) == {"zero3"}


def test_the_strategies_table_is_the_registry_in_order():
    table = strategies()
    assert list(table["strategy"]) == list(REGISTRY) and table["order"].is_monotonic_increasing


def test_a_composed_plan_splits_over_each_of_its_axes():
    """dp2 × tp2 × pp2: replicas over dp, a quarter of the states per rank (tp halves a stage's half),
    the same share on both dp replicas."""
    study = copy.deepcopy(load_study_file(REPO / "config/config.yaml", REPO).experiments)
    study["composed"]["strategies"].append("composed_dp2_tp2_pp2")
    study["composed"]["strategy_options"]["composed_dp2_tp2_pp2"] = {"world_size": 8, "tp": 2, "pp": 2,
                                                                     "n_microbatches": 2}
    held = _held(study, ("composed", "composed_dp2_tp2_pp2", 8))
    assert len(held) == 8 * 4
    params = held.xs("parameters", level="category")
    assert params.to_numpy() == pytest.approx(0.25, abs=0.01)
    table = mechanisms(TableInputs(summaries=[{"experiment": "composed", "strategy": "composed_dp2_tp2_pp2",
                                               "status": "ok", "world_size": 8}], experiments=study))
    by_place = table[table["category"] == "activations"].set_index("coordinates")["share"]
    assert by_place["dp0 tp0 pp0"] == by_place["dp1 tp1 pp0"] > by_place["dp0 tp0 pp1"]  # stage 0 holds more in flight


def test_a_run_without_optimizer_state_does_not_pass_for_the_most_sharded():
    """zero3 under SGD (parity_bf16) sums fewer categories than zero3 under AdamW: the AdamW run is drawn."""
    study = load_study_file(REPO / "config/config.yaml", REPO).experiments
    summaries = [{"experiment": exp, "strategy": "zero3", "status": "ok", "world_size": 2} for exp in ("parity_bf16", "zero")]
    table = mechanisms(TableInputs(summaries=summaries, experiments=study))
    assert set(table["experiment"]) == {"zero"} and "optimizer state" in set(table["category"])
