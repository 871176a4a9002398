"""One prediction per run (tables.rank_predictions): the runs step writes the cost model's bytes for every
rank of every run, and the other tables read that table instead of asking the cost model again."""

import pandas as pd
import pytest

from helpers import REPO
from shardlab.study import load_study_file
from shardlab.tables import TableInputs
from shardlab.tables import zero
from shardlab.tables.rank_predictions import COLUMNS, rank_predictions


@pytest.fixture(scope="module")
def study():
    return load_study_file(REPO / "config/test.yaml", REPO).experiments


def _inputs(study, *runs, tables=None) -> TableInputs:
    summaries = [{"experiment": exp, "strategy": s, "status": "ok", "world_size": world} for exp, s, world in runs]
    return TableInputs(summaries=summaries, experiments=study, tables=tables or {})


def test_every_rank_of_every_run_has_one_row(study):
    table = rank_predictions(_inputs(study, ("data_parallel", "single", 1), ("zero", "zero3", 2),
                                     ("pipeline", "pp_1f1b", 2)))
    assert list(table.columns) == COLUMNS
    assert table.groupby("strategy")["rank"].apply(list).to_dict() == {"single": [0], "zero3": [0, 1],
                                                                       "pp_1f1b": [0, 1]}
    zero3 = table[table["strategy"] == "zero3"]
    # ZeRO-3 shards every state: each rank holds about half of what one device would.
    assert (zero3["predicted_param_bytes"] / zero3["one_device_param_bytes"]).to_numpy() == pytest.approx(0.5, abs=0.02)
    states = zero3[["predicted_param_bytes", "predicted_grad_bytes", "predicted_optimizer_bytes"]].sum(axis=1)
    assert (states == zero3["predicted_model_state_bytes"]).all()
    pipeline = table[table["strategy"] == "pp_1f1b"].set_index("rank")
    assert pipeline.loc[0, "holds"].startswith("stage 0:") and pipeline.loc[1, "coordinates"] == "pp1"


def test_a_table_reads_the_predictions_it_is_given(study):
    """zero_memory shows the rule's rank_predictions, not a prediction of its own: a doctored table shows."""
    runs = [("zero", "zero3", 2)]
    predictions = rank_predictions(_inputs(study, *runs))
    doctored = predictions.assign(predicted_param_bytes=predictions["predicted_param_bytes"] * 2)
    summaries = [{"experiment": "zero", "strategy": "zero3", "status": "ok", "world_size": 2, "tokens_per_s": 1.0,
                  "ranks": [{"rank": r, "param_bytes": 1, "grad_bytes": 1, "optimizer_bytes": 1} for r in (0, 1)]}]
    memory = zero.build(TableInputs(summaries, study, tables={"rank_predictions": doctored}))["zero_memory"]
    assert list(memory["predicted_param_bytes"]) == list(doctored["predicted_param_bytes"])
    assert pd.notna(memory["error_param_bytes_pct"]).all()


def test_every_table_states_its_error_one_way():
    """Over-prediction is positive, relative to what was measured; nothing measured has no relative error."""
    import math

    from shardlab.tables.prediction_error import error_pct

    assert error_pct(measured=100, predicted=110) == pytest.approx(10.0)
    assert error_pct(measured=110, predicted=100) == pytest.approx(-100 / 11)
    assert math.isnan(error_pct(measured=0, predicted=0))
