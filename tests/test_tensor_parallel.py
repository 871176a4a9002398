"""Tensor and sequence parallelism (hand-written and DTensor) reproduce the single-device model.

Tolerance: shardlab.tables.parity's float32 rounding rule, for losses and for every reassembled gradient
(scaled by the largest reference gradient, one backward over the batch's tokens).
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from helpers import TEST_EXPERIMENT, assert_losses_match, assert_within

from shardlab.costs.activations import (COMPONENTS, SPLITS, component_of, comparison_rows, korthikanti_per_layer,
                                       korthikanti_total, paper_mode, this_model_per_layer)
from shardlab.config import deep_merge
from shardlab.errors import ConfigError
from shardlab.strategies import REGISTRY, strategies_of
from shardlab.tables import TableInputs
from shardlab.tables.parity import tolerance
from shardlab.tables.tensor_parallel import TWIN_GOAL, build

TP_STRATEGIES = ["tp", "tp_sp", "tp_dtensor", "tp_sp_dtensor"]
WORKER = Path(__file__).parent / "workers" / "tp_parity.py"


@pytest.fixture(scope="module")
def tp_runs(run_once):
    """One real 2-rank launch per strategy (plus the single-device reference), shared by the tests."""
    return {strategy: run_once(strategy) for strategy in ["single", *TP_STRATEGIES]}


@pytest.fixture(scope="module", params=[2, 4])
def parity(request, tiny_assets, tmp_path_factory):
    """Gradients and 3 SGD steps of every TP strategy vs the single-device model, at 2 and 4 ranks."""
    model_dir, _ = tiny_assets
    out = tmp_path_factory.mktemp(f"parity{request.param}") / "parity.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={request.param}",
           str(WORKER), str(model_dir), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _sharded_and_replicated_bytes(shapes: dict) -> tuple[int, int]:
    """fp32 bytes of the parameters TP splits and of those it keeps whole on every rank."""
    sharded = replicated = 0
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        is_row_bias = name.endswith(("attention.dense.bias", "dense_4h_to_h.bias"))
        is_split = any(k in name for k in ("query_key_value", "attention.dense", "dense_h_to_4h", "dense_4h_to_h",
                                           "embed_in", "lm_head"))
        if is_split and not is_row_bias:
            sharded += 4 * numel
        else:
            replicated += 4 * numel
    return sharded, replicated


@pytest.mark.parity
@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", TP_STRATEGIES)
def test_tp_losses_match_single_device(strategy, tp_runs):
    summary, steps = tp_runs[strategy]
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == 2
    reference = [s["loss"] for s in tp_runs["single"][1]]
    assert_losses_match([s["loss"] for s in steps], reference)


@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", TP_STRATEGIES)
def test_tp_parameter_bytes_are_one_over_t_of_sharded_layers(strategy, tp_runs, tiny_assets):
    from shardlab.core.model import load_model

    summary, _ = tp_runs[strategy]
    single = tp_runs["single"][0]["ranks"][0]
    shapes = {n: tuple(p.shape) for n, p in load_model(tiny_assets[0]).named_parameters()}
    sharded, replicated = _sharded_and_replicated_bytes(shapes)
    assert sharded + replicated == single["param_bytes"]
    embedding = 4 * shapes["gpt_neox.embed_in.weight"][0] * shapes["gpt_neox.embed_in.weight"][1]
    for rank in summary["ranks"]:
        assert rank["param_bytes"] == sharded // 2 + replicated
        if strategy.endswith("_dtensor"):
            # Measured (torch 2.13): DTensor's vocab-sharded embedding gets a Replicate (whole) gradient.
            assert rank["grad_bytes"] == rank["param_bytes"] + embedding // 2
        else:
            assert rank["grad_bytes"] == rank["param_bytes"]  # gradients are sharded like their parameters
    assert summary["ranks"][0]["param_bytes"] < 0.55 * single["param_bytes"]


@pytest.mark.parity
@pytest.mark.torchrun
def test_tp_gradients_match_single_device(parity):
    t = parity["world_size"]
    sharded, replicated = _sharded_and_replicated_bytes(parity["full_shapes"])
    for strategy in [*TP_STRATEGIES, "tp_parallel_cross_entropy", "tp_sp_parallel_cross_entropy"]:
        result = parity[strategy]
        assert_losses_match(result["losses"], parity["reference_losses"], tokens_per_step=parity["tokens_per_step"])
        assert_within(f"gradient: {strategy} t={t}", result["max_grad_error"], _gradient_tolerance(parity))
        assert result["param_bytes"] == sharded // t + replicated, (strategy, t)


def _gradient_tolerance(parity: dict) -> float:
    """One backward pass (steps=1) over the step's tokens, gradients as large as the reference's largest."""
    return tolerance(parity["reference_grad_scale"], parity["tokens_per_step"], steps=1)


@pytest.mark.parity
@pytest.mark.torchrun
def test_gradient_check_catches_missing_sequence_parallel_reduction(parity):
    """The parity check can fail: without the all-reduce of LayerNorm gradients SP is wrong, by far more
    than rounding."""
    assert parity["tp_sp_without_grad_sync"]["max_grad_error"] > 100 * _gradient_tolerance(parity)


@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", ["single", *TP_STRATEGIES])
def test_activation_bytes_per_component_match_formulas(strategy, tp_runs):
    model, training = TEST_EXPERIMENT["model"], TEST_EXPERIMENT["training"]
    dims = {"s": training["seq_len"], "b": training["global_batch_size"], "h": model["hidden_size"],
            "a": model["num_heads"], "n_layers": model["num_layers"]}
    summary, _ = tp_runs[strategy]
    for rank in summary["ranks"]:
        rows = comparison_rows(split_of(strategy), rank["activation_by_module"], dims,
                               t=summary["world_size"])
        for row in rows:
            if row["model_formula_bytes"] == 0:
                assert row["measured_bytes"] == 0, row
                continue
            assert row["measured_bytes"] == pytest.approx(row["model_formula_bytes"], rel=0.10), row
            if row["paper_assumptions_hold"]:
                assert row["measured_bytes"] == pytest.approx(row["paper_formula_bytes"], rel=0.10), row


def test_paper_components_sum_to_closed_forms():
    s, b, h, a, t = 128, 2, 256, 8, 4
    for mode in ("none", "tensor", "tensor_sequence"):
        parts = korthikanti_per_layer(s, b, h, a, t if mode != "none" else 1, mode)
        assert sum(parts.values()) == pytest.approx(korthikanti_total(s, b, h, a, t, mode))
    assert set(parts) == set(COMPONENTS)


def test_module_names_map_to_components():
    assert component_of("gpt_neox.layers.3.input_layernorm") == "layernorm"
    assert component_of("gpt_neox.layers.0.attention.query_key_value") == "qkv"
    assert component_of("gpt_neox.layers.0.attention") == "attention_core"
    assert component_of("gpt_neox.layers.0.attention.dense") == "attention_projection"
    assert component_of("gpt_neox.layers.1.mlp.act") == "mlp"
    assert component_of("gpt_neox.layers.1.post_mlp_dropout") == "dropout"
    assert component_of("gpt_neox.final_layer_norm") == "outside_layers"
    assert component_of("lm_head") == "outside_layers"


def test_tp_config_rejects_unknown_option():
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"strategy_options": {"tp_dtensor": {"parallel_cross_entropy": True}}})
    with pytest.raises(ConfigError, match="strategy_options.tp_dtensor.parallel_cross_entropy"):
        REGISTRY["tp_dtensor"].check(exp, "experiments.test")


def test_tp_config_rejects_heads_not_divisible():
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"model": {"num_heads": 2}, "launch": {"world_size": 4}})
    with pytest.raises(ConfigError, match="launch.world_size.*2 heads are not divisible by tp=4"):
        REGISTRY["tp"].check(exp, "experiments.test")


@pytest.mark.torchrun
def test_tp_component_table_from_run_summaries(tp_runs):
    """The workflow's table builder reads the runs' summaries and finds the same agreement."""
    inputs = TableInputs([tp_runs[s][0] for s in ["single", "tp_sp"]], {TEST_EXPERIMENT["name"]: TEST_EXPERIMENT})
    table = build(inputs)["tp_activation_components"]
    assert set(table["strategy"]) == {"single", "tp_sp"}
    assert len(table) == len(COMPONENTS) * (1 + 2)  # single: one rank; tp_sp: two
    layer_norm = table[(table["component"] == "layernorm") & (table["rank"] == 0)].set_index("strategy")
    assert layer_norm.loc["tp_sp", "measured_bytes"] == pytest.approx(layer_norm.loc["single", "measured_bytes"] / 2)


@pytest.mark.torchrun
def test_tp_inference_matches_single_device_with_half_the_cache(tiny_assets, tmp_path):
    from shardlab.bench.inference import benchmarked_strategy

    exp_path = tmp_path / "exp.json"
    exp_path.write_text(json.dumps(TEST_EXPERIMENT))
    out = tmp_path / "tp_inference.csv"
    cmd = [sys.executable, "-m", "shardlab", "bench-inference", "--experiment-config", str(exp_path), "--model-dir",
           str(tiny_assets[0]), "--out", str(out), "--batch", "2", "--new-tokens", "8", "--repeats", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = pd.read_csv(out)
    strategy = benchmarked_strategy()
    single = table[table["mode"] == REGISTRY[strategy].reference].iloc[0]
    tp = table[table["mode"] == strategy]
    assert set(table["experiment"]) == {TEST_EXPERIMENT["name"]}
    assert list(tp["status"]) == ["ok", "ok"], tp["reason"].tolist()
    assert tp["matches_single"].all()  # greedy tokens identical to the single device's
    assert (tp["kv_cache_bytes"] == single["kv_cache_bytes"] // 2).all()  # each rank caches its own heads
    assert (tp["param_bytes"] < single["param_bytes"]).all()


# --- the tables, from synthetic run summaries (no torchrun) ------------------------------------
LAYER_MODULES = {"layernorm": "input_layernorm", "qkv": "attention.query_key_value", "attention_core": "attention",
                 "attention_projection": "attention.dense", "mlp": "mlp"}


def _probe_saw(per_layer: dict[str, float], n_layers: int) -> dict[str, int]:
    """An `activation_by_module` whose layers saved exactly `per_layer` bytes per component."""
    return {f"gpt_neox.layers.{i}.{module}": int(per_layer[c]) for i in range(n_layers)
            for c, module in LAYER_MODULES.items()} | {"gpt_neox.embed_in": 12345}


def _tp_summary(strategy: str, world: int, tokens_per_s: float, exp: dict = TEST_EXPERIMENT) -> dict:
    model, training = exp["model"], exp["training"]
    split = split_of(strategy)
    t = world if split != "none" else 1
    per_layer = this_model_per_layer(training["seq_len"], training["global_batch_size"], model["hidden_size"],
                                     model["num_heads"], t, paper_mode(split),
                                     gathered_inputs_saved=split == "tensor_sequence_gathered")
    ranks = [{"rank": r, "activation_by_module": _probe_saw(per_layer, model["num_layers"])} for r in range(world)]
    return {"experiment": exp["name"], "strategy": strategy, "status": "ok", "world_size": world,
            "tokens_per_s": tokens_per_s, "step_time_median_s": 1 / tokens_per_s, "ranks": ranks}


def split_of(strategy: str) -> str:
    """How the strategy's Plan splits a layer's activations (costs.plan.Plan.activation_split)."""
    return REGISTRY[strategy].run_plan(TEST_EXPERIMENT, 2).activation_split


def test_every_strategy_names_a_known_activation_split():
    assert {split_of(name) for name in REGISTRY} <= set(SPLITS)
    with pytest.raises(ValueError, match="unknown activation split"):
        paper_mode("tp_sideways")


def test_gathered_sequence_parallel_inputs_break_the_papers_qkv_and_mlp_split():
    dims = {"s": 32, "b": 8, "h": 64, "a": 4, "n_layers": 2}
    shard = {r["component"]: r for r in comparison_rows("tensor_sequence", {}, dims, t=2)}
    gathered = {r["component"]: r for r in comparison_rows("tensor_sequence_gathered", {}, dims, t=2)}
    assert shard["qkv"]["mode"] == gathered["qkv"]["mode"] == "tensor_sequence"
    assert gathered["qkv"]["model_formula_bytes"] == 2 * shard["qkv"]["model_formula_bytes"]
    assert shard["qkv"]["paper_assumptions_hold"] and not gathered["qkv"]["paper_assumptions_hold"]
    assert {r["tp"] for r in comparison_rows("none", {}, dims, t=2)} == {1}  # no TP: the degree is 1


def test_the_probed_micro_batch_is_the_plans():
    """What one rank's forward sees: the global batch over the data-parallel ranks, cut by the micro-batch."""
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"training": {"micro_batch_size": 2}})
    gbs = TEST_EXPERIMENT["training"]["global_batch_size"]
    assert REGISTRY["tp"].run_plan(TEST_EXPERIMENT, 2).micro_batch == gbs  # TP ranks see the whole batch
    assert REGISTRY["ddp"].run_plan(TEST_EXPERIMENT, 2).micro_batch == gbs // 2
    assert REGISTRY["ddp"].run_plan(exp, 2).micro_batch == 2


def test_activation_table_matches_the_formula_the_probe_followed():
    names = ["single", *strategies_of("tensor_parallel")]
    inputs = TableInputs([_tp_summary(s, 1 if s == "single" else 2, 100.0) for s in names],
                         {TEST_EXPERIMENT["name"]: TEST_EXPERIMENT})
    tables = build(inputs)
    comp = tables["tp_activation_components"]
    assert len(comp) == len(COMPONENTS) * (1 + 2 * (len(names) - 1))
    assert (comp["b"] == TEST_EXPERIMENT["training"]["global_batch_size"]).all()
    matched = comp[comp["model_formula_bytes"] > 0]
    assert matched["measured_over_model"].tolist() == pytest.approx([1.0] * len(matched))
    assert set(comp["activation_split"]) == {split_of(s) for s in names}
    totals = tables["tp_activation_totals"].set_index(["strategy", "rank"])
    single, tp = totals.loc[("single", 0), "measured_bytes"], totals.loc[("tp", 1), "measured_bytes"]
    assert tp < single  # embedding bytes are outside the layers and not counted
    assert totals["measured_bytes"].tolist() == pytest.approx(totals["model_formula_bytes"].tolist())


def test_twins_table_compares_each_hand_written_strategy_with_its_twin():
    rates = {"single": 100.0, "tp": 96.0, "tp_dtensor": 100.0, "tp_sp": 50.0, "tp_sp_dtensor": 100.0}
    summaries = [_tp_summary(s, 1 if s == "single" else 2, r) for s, r in rates.items()]
    summaries.append({"experiment": "x", "strategy": "tp", "status": "failed", "ranks": []})
    tables = build(TableInputs(summaries, {"test": TEST_EXPERIMENT, "x": TEST_EXPERIMENT}))
    twins = tables["tp_twins"].set_index(["experiment", "strategy"])
    assert twins.loc[("test", "tp"), "ratio_to_twin"] == pytest.approx(0.96)
    assert bool(twins.loc[("test", "tp"), "goal_met"]) and not bool(twins.loc[("test", "tp_sp"), "goal_met"])
    assert (twins["goal_ratio"] == TWIN_GOAL).all()
    assert pd.isna(twins.loc[("x", "tp"), "ratio_to_twin"])  # a failed run has no throughput to compare
    throughput = tables["tp_throughput"].set_index(["experiment", "strategy"])
    assert throughput.loc[("test", "tp_sp"), "ratio_to_reference"] == pytest.approx(0.5)


def test_memory_categories_pick_runs_with_the_same_model_and_training():
    other_training = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"name": "other", "training": {"lr": 0.1}})
    experiments = {"test": TEST_EXPERIMENT, "peer": dict(TEST_EXPERIMENT, name="peer"), "other": other_training}
    runs = {"test": ["single", "tp"], "peer": ["single", "ddp", "moe_single", "ep_moe"], "other": ["ddp", "zero3"]}
    ranks = pd.DataFrame([{"experiment": e, "strategy": s, "status": "ok", "rank": r, "param_bytes": 10.0 * (r + 1),
                           "grad_bytes": 1.0, "optimizer_bytes": 2.0, "activation_bytes": 3.0}
                          for e, names in runs.items() for s in names for r in range(2)])
    summaries = [_tp_summary("single", 1, 1.0), _tp_summary("tp", 2, 1.0)]
    memory = build(TableInputs(summaries, experiments, tables={"ranks": ranks}))["tp_memory_categories"]
    # the reference first, then the peer's parallel runs checked against the same reference, then TP;
    # not the peer's single (shown), nor its mixture of experts (another model), nor other settings
    assert list(zip(memory["experiment"], memory["strategy"])) == [("test", "single"), ("peer", "ddp"), ("test", "tp")]
    assert (memory["param_bytes"] == 15.0).all() and (memory["ranks"] == 2).all()
    assert (memory["tp_experiment"] == "test").all()


def test_inference_benchmarks_the_hand_written_tensor_parallel_strategy():
    from shardlab.bench.inference import benchmarked_strategy

    spec = REGISTRY[benchmarked_strategy()]
    assert spec.topic == "tensor_parallel" and spec.twin is not None and split_of(spec.name) == "tensor"
