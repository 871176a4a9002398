"""The decision guide's tables follow the measurements and the planner: what a rank holds is measured bytes over
its reference's, what it moves is the collectives' payload, and a scenario's plan sits beside the published run
its config names."""

import pandas as pd

from shardlab.tables.guide import plans, techniques

MIB = 2**20


def _tables(fsdp_params: float = 0.5 * MIB) -> dict[str, pd.DataFrame]:
    mechanisms = pd.DataFrame({"family": ["zero"] * 2, "strategy": ["fsdp2_full"] * 2, "experiment": ["zero"] * 2,
                               "world_size": [2, 2], "rank": [0, 1]})
    held = {"param_bytes": [MIB, fsdp_params, fsdp_params], "grad_bytes": [MIB, 0.5 * MIB, 0.5 * MIB],
            "optimizer_bytes": [2 * MIB, MIB, MIB], "activation_bytes": [4 * MIB, 2 * MIB, 2.2 * MIB]}
    ranks = pd.DataFrame({"experiment": "zero", "strategy": ["single", "fsdp2_full", "fsdp2_full"], **held})
    volume = pd.DataFrame({"experiment": "zero", "strategy": "fsdp2_full", "collective": ["all_gather", "reduce_scatter"],
                           "purpose": [
        "parameter all-gather (forward, backward)", "gradient reduce-scatter"], "size_bytes": [MIB, MIB], "count": [2, 1]})
    top = pd.DataFrame({"scenario": ["big", "small"], "rank": [1, 1], "plan_dp": [32, 2], "plan_tp": [8, 1],
                        "plan_pp": [16, 1], "plan_cp": [1, 1], "plan_ep": [1, 1], "plan_zero": [1, 3]})
    scenarios = pd.DataFrame({"scenario": ["big", "small"], "parameters_b": [405.0, 6.9], "active_parameters_b": [405.0, 6.9],
                              "gpus": [16384, 2], "hardware": ["H100-80GB SXM", "A100-80GB SXM"], "stack": "megatron-core",
                              "best_plan": ["dp32 tp8 pp16", "dp2 deepspeed-z3"], "mfu": [0.52, 0.38],
                              "error_band_pct": [16.6, 17.4], "error_band_basis": "held-out",
                              "implausible": ["", "MFU above the best published"], "published_row": ["llama3[1]", ""]})
    published = pd.DataFrame({"row": ["llama3[1]"], "model": ["405B"], "gpus": [16384], "accelerator": ["H100-80GB SXM"],
                              "plan": ["dp128 tp8 pp16"], "published_mfu_pct": [41.0], "error_pct": [-8.0],
                              "split": ["informed"]})
    return {"mechanisms": mechanisms, "ranks": ranks, "comm_volume": volume, "planning_top": top,
            "planning_scenarios": scenarios, "planning_published": published}


def test_a_technique_holds_its_measured_share_and_moves_its_collectives_payload():
    row = techniques(_tables()).set_index("family").loc["zero"]
    assert row["holds"] == "0.50 · 0.50 · 0.50 · 0.55"  # parameters, gradients, optimizer, activations: the fullest rank
    assert row["communicates"] == "3 MiB a step, 3× the weights, by all-gather and reduce-scatter"
    assert row["best_plan_at"] == "405B on 16,384 H100, 6.9B on 2 A100"  # both best plans shard model states
    assert techniques(_tables(fsdp_params=MIB)).set_index("family").loc["zero", "parameters_share"] == 1.0


def test_a_scenario_sits_beside_the_published_run_it_names():
    table = plans(_tables()).set_index("scenario")
    assert table.loc["big", "published_plan"] == "dp128 tp8 pp16" and table.loc["big", "published_mfu_pct"] == 41.0
    assert table.loc["big", "planner_error_on_published_pct"] == -8.0 and table.loc["big", "predicted_mfu_pct"] == 52.0
    assert pd.isna(table.loc["small", "published_plan"]) and table.loc["small", "above_published_mfu"]
    assert plans({}).empty  # a study without planning scenarios
