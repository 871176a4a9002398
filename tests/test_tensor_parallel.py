"""Tensor and sequence parallelism (hand-written and DTensor) reproduce the single-device model.

Tolerance: shardlab.tables.parity's float32 rounding rule, for losses and for every reassembled gradient
(scaled by the largest reference gradient, one backward over the batch's tokens).
"""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEST_EXPERIMENT, assert_losses_match, assert_within, launch_test_run

from shardlab.costs.activations import (COMPONENTS, component_of, comparison_rows, korthikanti_per_layer,
                                       korthikanti_total)
from shardlab.config import deep_merge
from shardlab.errors import ConfigError
from shardlab.tables.parity import tolerance

TP_STRATEGIES = ["tp", "tp_sp", "tp_dtensor", "tp_sp_dtensor"]
WORKER = Path(__file__).with_name("tp_parity_worker.py")


@pytest.fixture(scope="module")
def tp_runs(tiny_assets, tmp_path_factory):
    """One real 2-rank launch per strategy (plus the single-device reference), shared by the tests."""
    tmp = tmp_path_factory.mktemp("tp_runs")
    runs = {}
    for strategy in ["single", *TP_STRATEGIES]:
        runs[strategy] = launch_test_run(tiny_assets, tmp, strategy)
    return runs


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
        rows = comparison_rows(strategy, rank["activation_by_module"], dims, t=summary["world_size"])
        for row in rows:
            if row["model_formula_bytes"] == 0:
                assert row["measured_bytes"] == 0, row
                continue
            assert row["measured_bytes"] == pytest.approx(row["model_formula_bytes"], rel=0.10), row
            if row["paper_assumptions_hold"]:
                assert row["measured_bytes"] == pytest.approx(row["paper_formula_bytes"], rel=0.10), row


def test_paper_components_sum_to_closed_forms():
    s, b, h, a, t = 128, 2, 256, 8, 4
    for mode in ("none", "tp", "tp_sp"):
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
    from shardlab.strategies import REGISTRY

    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"strategy_options": {"tp_dtensor": {"parallel_cross_entropy": True}}})
    with pytest.raises(ConfigError, match="strategy_options.tp_dtensor.parallel_cross_entropy"):
        REGISTRY["tp_dtensor"].check_options(exp, "experiments.test.strategy_options.tp_dtensor")


def test_tp_config_rejects_heads_not_divisible():
    from shardlab.strategies import REGISTRY

    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"model": {"num_heads": 2}, "launch": {"world_size": 4}})
    with pytest.raises(ConfigError, match="model.num_heads"):
        REGISTRY["tp"].check_options(exp, "experiments.test.strategy_options.tp")


@pytest.mark.torchrun
def test_tp_component_table_from_run_summaries(tp_runs, tiny_assets, tmp_path):
    """The workflow's table tool reads the runs' summaries and finds the same agreement."""
    import pandas as pd

    from shardlab.tables.tensor_parallel import main as tp_tables

    summaries = []
    for strategy in ["single", "tp_sp"]:
        run = tmp_path / "exp" / "runs" / strategy
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps(tp_runs[strategy][0]))
        summaries.append(str(run / "summary.json"))
    (tmp_path / "exp" / "experiment.json").write_text(json.dumps(TEST_EXPERIMENT))
    out = tmp_path / "tp_activation_components.csv"
    tp_tables(["--out", str(out), *summaries])
    table = pd.read_csv(out)
    assert set(table["strategy"]) == {"single", "tp_sp"}
    assert len(table) == len(COMPONENTS) * (1 + 2)  # single: one rank; tp_sp: two
    layer_norm = table[(table["component"] == "layernorm") & (table["rank"] == 0)].set_index("strategy")
    assert layer_norm.loc["tp_sp", "measured_bytes"] == pytest.approx(layer_norm.loc["single", "measured_bytes"] / 2)


@pytest.mark.torchrun
def test_tp_inference_matches_single_device_with_half_the_cache(tiny_assets, tmp_path):
    import pandas as pd

    exp_path = tmp_path / "exp.json"
    exp_path.write_text(json.dumps(TEST_EXPERIMENT))
    out = tmp_path / "tp_inference.csv"
    cmd = [sys.executable, "-m", "shardlab.bench.inference", "--experiment-config", str(exp_path), "--model-dir",
           str(tiny_assets[0]), "--out", str(out), "--batch", "2", "--new-tokens", "8", "--repeats", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = pd.read_csv(out)
    single, tp = table[table["mode"] == "single"].iloc[0], table[table["mode"] == "tp"]
    assert list(tp["status"]) == ["ok", "ok"], tp["reason"].tolist()
    assert tp["matches_single"].all()  # greedy tokens identical to the single device's
    assert (tp["kv_cache_bytes"] == single["kv_cache_bytes"] // 2).all()  # each rank caches its own heads
    assert (tp["param_bytes"] < single["param_bytes"]).all()
