"""The derived tables of the pipeline and context/expert sections, built from synthetic summaries:
what the report draws is computed here (theory grid, memory long form, the hybrid comparison, the
context-parallel ratio, the expert-load shares, the MoE-vs-dense comparison), with the runs
chosen by registry and data, not by name."""

import pandas as pd
import pytest

from shardlab.tables import TableInputs
from shardlab.tables import context_expert, pipeline


def _pp_rank(rank, dp_rank, stage, peak, m=4, v=1, schedule="Schedule1F1B"):
    return {"rank": rank, "dp_rank": dp_rank, "pp_size": 2, "pp_virtual_stages": v, "pp_n_microbatches": m,
            "pp_schedule": schedule, "pp_stage_ids": [stage], "pp_busy_s": 0.5 + stage / 10, "pp_step_span_s": 1.0,
            "pp_idle_fraction": 0.3, "pp_peak_live_activation_bytes": peak, "pp_saved_activation_bytes": 2 * peak,
            "param_bytes": 1000 + stage}


def _pp_run(exp, strategy, ranks, status="ok"):
    return {"experiment": exp, "strategy": strategy, "status": status, "world_size": len(ranks), "ranks": ranks,
            "tokens_per_s": 1.0, "final_loss": 3.0}


PIPELINES = [
    _pp_run("a", "single", [{"rank": 0}]),  # the reference: another topic, not a pipeline row
    _pp_run("a", "pp_gpipe", [_pp_rank(0, 0, 0, 80, schedule="ScheduleGPipe"),
                              _pp_rank(1, 0, 1, 60, schedule="ScheduleGPipe")]),
    _pp_run("a", "pp_1f1b", [_pp_rank(0, 0, 0, 40), _pp_rank(1, 0, 1, 20)]),
    _pp_run("a", "hybrid_dp_pp", [_pp_rank(0, 0, 0, 20), _pp_rank(1, 0, 1, 10),
                                  _pp_rank(2, 1, 0, 20), _pp_rank(3, 1, 1, 10)]),
    _pp_run("b", "pp_1f1b", [_pp_rank(0, 0, 0, 40, m=8), _pp_rank(1, 0, 1, 20, m=8)]),
    _pp_run("b", "pp_interleaved", [], status="failed"),
]


def test_pipeline_theory_covers_the_stage_and_virtual_counts_of_finished_runs():
    theory = pipeline.build(TableInputs(summaries=PIPELINES))["pipeline_theory"]
    assert set(zip(theory["p"], theory["v"])) == {(2, 1)}  # the failed interleaved run adds no v=2
    assert list(theory["m"]) == list(range(1, 17))
    row = theory[theory["m"] == 4].iloc[0]
    assert row["theory_idle_fraction"] == pytest.approx(1 / 5) and row["theory_bubble_ratio"] == pytest.approx(1 / 4)


def test_pipeline_memory_is_one_row_per_finished_rank_and_measure():
    memory = pipeline.build(TableInputs(summaries=PIPELINES))["pipeline_memory"]
    assert len(memory) == (2 + 2 + 4 + 2) * 3
    assert set(memory["measure"]) == {"activations saved over the step", "peak live activations", "parameters"}
    first = memory[(memory["strategy"] == "pp_1f1b") & (memory["experiment"] == "b")
                   & (memory["measure"] == "peak live activations")]
    assert first["run"].iloc[0] == "pp_1f1b m=8" and list(first["bytes"]) == [40, 20]


def test_hybrid_is_compared_with_the_single_pipeline_of_the_same_schedule_and_m():
    hybrid = pipeline.build(TableInputs(summaries=PIPELINES))["pipeline_hybrid"]
    # 1F1B at m=4 in the same experiment; not GPipe (other schedule), not experiment b (other experiment, m=8).
    assert hybrid[["experiment", "strategy"]].drop_duplicates().values.tolist() == [["a", "pp_1f1b"], ["a", "hybrid_dp_pp"]]
    assert hybrid.loc[hybrid["role"] == "dp x pp hybrid", "pipelines"].unique().tolist() == [2]
    ratios = hybrid.loc[hybrid["role"] == "dp x pp hybrid", "peak_live_ratio_to_pipeline"]
    assert ratios.tolist() == pytest.approx([0.5, 0.5, 0.5, 0.5])
    assert hybrid.loc[hybrid["role"] == "single pipeline", "peak_live_ratio_to_pipeline"].isna().all()


def test_pipeline_tables_from_no_runs_are_empty_with_their_columns():
    tables = pipeline.build(TableInputs())
    assert all(frame.empty for frame in tables.values())
    assert list(tables["pipeline_hybrid"].columns) == pipeline.HYBRID_COLUMNS
    assert list(tables["pipeline_theory"].columns) == pipeline.THEORY_COLUMNS


# --- context and expert parallelism --------------------------------------------------------------
def _settings(name, seq_len=64, lr=1e-3):
    return {"name": name, "model": {"name": "tiny"}, "data": {"corpus": "c"},
            "training": {"seq_len": seq_len, "global_batch_size": 8, "lr": lr}}


CP_RUNS = [
    {"experiment": "cp", "strategy": "single", "status": "ok", "tokens_per_s": 10.0,
     "ranks": [{"rank": 0, "activation_bytes": 100}]},
    {"experiment": "cp", "strategy": "cp_ring", "status": "ok", "tokens_per_s": 8.0, "ranks": [
        {"rank": 0, "activation_bytes": 40, "cp_size": 2}, {"rank": 1, "activation_bytes": 50, "cp_size": 2}]},
]


def test_cp_ratio_is_each_context_parallel_run_over_its_registry_reference():
    tables = context_expert.build(TableInputs(summaries=CP_RUNS, experiments={"cp": _settings("cp", 128)}))
    per_run = tables["cp_activation"]
    assert per_run[["strategy", "run", "activation_bytes_per_rank"]].values.tolist() == [
        ["single", "single (c=1)", 100], ["cp_ring", "cp_ring (c=2)", 45]]
    ratio = tables["cp_activation_ratio"].iloc[0]
    assert (ratio["strategy"], ratio["reference"], ratio["seq_len"]) == ("cp_ring", "single", 128)
    assert ratio["activation_ratio"] == pytest.approx(0.45) and ratio["expected_ratio"] == pytest.approx(0.5)
    assert (ratio["reference_tokens_per_s"], ratio["tokens_per_s"]) == (10.0, 8.0)


def _moe_run(strategy, world):
    return {"experiment": "moe", "strategy": strategy, "status": "ok", "world_size": world, "ranks": [
        {"rank": r, "expert_routed": [[6, 2]], "expert_kept": [[4, 2]]} for r in range(world)]}


def test_expert_load_shares_draw_the_expert_sharded_runs():
    summaries = [_moe_run("moe_single", 1), _moe_run("ep_moe", 2)]
    tables = context_expert.build(TableInputs(summaries=summaries, experiments={"moe": _settings("moe")}))
    assert len(tables["expert_load"]) == 4  # both runs' loads
    shares = tables["expert_load_shares"]
    assert set(shares["strategy"]) == {"ep_moe"}
    assert shares[["expert", "fate", "share"]].values.tolist() == [
        [0, "processed", 0.5], [1, "processed", 0.25], [0, "dropped", 0.25], [1, "dropped", 0.0]]
    alone = context_expert.build(TableInputs(summaries=[_moe_run("moe_single", 1)]))["expert_load_shares"]
    assert set(alone["strategy"]) == {"moe_single"}  # no sharded run: the unsharded one is drawn


def _runs_and_ranks():
    rows = [("moe", "moe_single", 1, None), ("moe", "ep_moe", 2, None), ("dense", "single", 1, None),
            ("dense", "dp_naive", 2, None), ("dense", "ddp", 2, None), ("again", "single", 1, "dense"),
            ("other", "single", 1, None), ("other", "ddp", 2, None)]
    runs = pd.DataFrame([{"experiment": e, "strategy": s, "status": "ok", "world_size": w, "tokens_per_s": 1.0,
                          "final_loss": 3.0, "reused_from": reused} for e, s, w, reused in rows])
    ranks = pd.DataFrame([{"experiment": e, "strategy": s, "rank": r, "param_bytes": 100 * (r + 1),
                           "activation_bytes": 10, "dropped_assignments": 5 if e == "moe" else None,
                           "assignments": 50 if e == "moe" else None, "tokens_fully_dropped": 1 if e == "moe" else None}
                          for e, s, w, _ in rows for r in range(w)])
    return runs, ranks


def test_moe_is_compared_with_dense_runs_of_the_same_settings():
    runs, ranks = _runs_and_ranks()
    experiments = {"moe": _settings("moe"), "dense": _settings("dense"), "again": _settings("again"),
                   "other": _settings("other", lr=1e-2)}
    table = context_expert.build(TableInputs(experiments=experiments, tables={"runs": runs, "ranks": ranks}))["moe_dense"]
    # dense: the reference and the production data-parallel twin of the same settings; not the hand-written
    # dp_naive, not the reused copy of `single`, not the experiment with another learning rate.
    assert table[["experiment", "strategy", "role"]].values.tolist() == [
        ["moe", "moe_single", "mixture of experts"], ["moe", "ep_moe", "mixture of experts"],
        ["dense", "single", "dense"], ["dense", "ddp", "dense"]]
    assert set(table["moe_experiment"]) == {"moe"}
    assert table["max_rank_param_bytes"].tolist() == [100, 200, 100, 200]
    assert table["dropped_assignments_pct"].tolist()[:2] == [10.0, 10.0]
    assert table["tokens_fully_dropped"].isna().tolist() == [False, False, True, True]


def test_dense_strategies_come_from_the_registry():
    assert context_expert.dense_strategies() == {"single", "ddp"}


def test_context_expert_tables_without_runs_tables_are_empty():
    tables = context_expert.build(TableInputs(summaries=CP_RUNS, experiments={"cp": _settings("cp")}))
    assert tables["moe_dense"].empty and list(tables["moe_dense"].columns) == context_expert.DENSE_COLUMNS
    assert tables["expert_load"].empty and tables["expert_load_shares"].empty
