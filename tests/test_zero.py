"""The ZeRO ladder (DeepSpeed stages 0-3, offload) and FSDP2 under real torchrun (2 ranks, gloo, CPU):
parity with the single-device reference, measured model-state bytes against the memory model, the
decision tree, and the config checks that reject malformed DeepSpeed settings before launch."""

from __future__ import annotations

import copy
import json

import pytest

from helpers import TEST_EXPERIMENT, TEST_TOKENS_PER_STEP, assert_losses_match, assert_within, rung_states
from shardlab.config import deep_merge
from shardlab.errors import ConfigError
from shardlab.tables.parity import tolerance
from shardlab.strategies import REGISTRY
from shardlab.costs.plan import Cluster, Workload
from shardlab.costs.predict import Prediction, evaluate
from shardlab.costs.shapes import model_shape
from shardlab.costs.zero_tree import cluster_of, rung_plan
from shardlab.strategies.zero import deepspeed_ladder
from shardlab.strategies.zero.tree import main as plan_zero_main, plan

ZERO_RUNGS = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]
FSDP2 = ["fsdp2_full", "fsdp2_grad_op"]
MEMORY_TOL = 0.01  # target: model states within 1 % of the memory model


SAVED = {"training": {"save_model": True}}  # the sharded rungs whose gathered weights are compared, and zero0


@pytest.fixture(scope="module")
def ladder_runs(run_once):
    """Every rung run once (2 ranks): (summary, steps, run folder), shared by the tests below and, for
    the rungs not saving their model, with the other tests reading the same healthy runs."""
    runs = {}
    for strategy in ZERO_RUNGS + FSDP2:
        overrides = SAVED if strategy in ("zero0", "zero3", "zero3_offload", "fsdp2_full") else None
        runs[strategy] = (*run_once(strategy, overrides), run_once.run_dir(strategy, overrides))
    return runs


def model_states(rank: dict) -> int:
    return rank["param_bytes"] + rank["grad_bytes"] + rank["optimizer_bytes"]


@pytest.mark.parity
@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", ZERO_RUNGS + FSDP2)
def test_rung_matches_single_device(strategy, ladder_runs, reference_losses):
    summary, steps, _ = ladder_runs[strategy]
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == 2
    assert_losses_match([s["loss"] for s in steps], reference_losses)


@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", ZERO_RUNGS + FSDP2)
def test_measured_model_states_match_memory_model(strategy, ladder_runs):
    summary, _, _ = ladder_runs[strategy]
    n_params = summary["model"]["parameters"]
    want = rung_states(strategy, n_params, ranks=2, dtype="fp32", optimizer="sgd")
    for rank in summary["ranks"]:
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            predicted = getattr(want, key)
            assert abs(rank[key] - predicted) <= MEMORY_TOL * max(predicted, 1), (key, rank[key], predicted)


@pytest.mark.torchrun
def test_adamw_state_matches_memory_model(run_strategy):
    """AdamW's two fp32 moments are sharded with the master partition: (4 + 8)Ψ/N per rank at stage 2."""
    summary, _ = run_strategy("zero2", {"training": {"optimizer": "adamw", "lr": 1e-3}})
    assert summary["status"] == "ok", summary["reason"]
    want = rung_states("zero2", summary["model"]["parameters"], 2, dtype="fp32", optimizer="adamw")
    for rank in summary["ranks"]:
        assert rank["optimizer_bytes"] == pytest.approx(want.optimizer_bytes, rel=MEMORY_TOL)
        assert model_states(rank) == pytest.approx(want.total_bytes, rel=MEMORY_TOL)


@pytest.mark.torchrun
def test_model_states_shrink_as_the_stage_rises(ladder_runs):
    rank0 = {s: ladder_runs[s][0]["ranks"][0] for s in ZERO_RUNGS[:4]}
    per_rank = {s: model_states(r) for s, r in rank0.items()}
    # With SGD (no moments) stage 1's saving is exactly the fp32 master partition DeepSpeed adds, so
    # totals only fall weakly until stage 3; with AdamW they fall strictly (test_adamw_... and the report).
    assert per_rank["zero0"] >= per_rank["zero1"] >= per_rank["zero2"] > per_rank["zero3"], per_rank
    assert rank0["zero0"]["grad_bytes"] == 2 * rank0["zero1"]["grad_bytes"] == 2 * rank0["zero2"]["grad_bytes"]
    assert rank0["zero0"]["optimizer_bytes"] < rank0["zero1"]["optimizer_bytes"]  # the master partition appears
    # AdamW in the model: stage 1 and 2 hold the same at the step (DeepSpeed partitions gradients at the
    # boundary from stage 1 on); they differ in the gradient peak during backward.
    adamw = [rung_states(s, 1e6, 2, "fp32", "adamw").total_bytes for s in ZERO_RUNGS[:4]]
    assert adamw[0] > adamw[1] == adamw[2] > adamw[3]
    full = ladder_runs["zero0"][0]["ranks"][0]["param_bytes"]
    for sharded in ("zero3", "fsdp2_full", "fsdp2_grad_op"):
        for rank in ladder_runs[sharded][0]["ranks"]:
            assert rank["param_bytes"] == pytest.approx(full / 2, rel=MEMORY_TOL)  # each rank holds ~1/N


@pytest.mark.torchrun
def test_deepspeed_json_is_saved_beside_the_run(ladder_runs):
    for strategy, stage in [("zero1", 1), ("zero3_offload", 3)]:
        cfg = json.loads((ladder_runs[strategy][2] / "artifacts" / "ds_config.json").read_text())
        assert cfg["zero_optimization"]["stage"] == stage
        assert cfg["train_batch_size"] == TEST_EXPERIMENT["training"]["global_batch_size"]
    offload = json.loads((ladder_runs["zero3_offload"][2] / "artifacts" / "ds_config.json").read_text())
    assert offload["zero_optimization"]["offload_param"]["device"] == "cpu"


@pytest.mark.parity
@pytest.mark.torchrun
def test_sharded_rungs_save_the_same_full_model(ladder_runs):
    """full_state_dict gathers stage-3 partitions / FSDP2 shards into the same weights as unsharded zero0."""
    from safetensors.torch import load_file

    def weights(strategy):
        summary, _, out = ladder_runs[strategy]
        assert summary["status"] == "ok", summary["reason"]
        return load_file(str(next((out / "model").glob("*.safetensors"))))

    ref = weights("zero0")
    scale = max(float(v.float().abs().max()) for v in ref.values())
    tol = tolerance(scale, TEST_TOKENS_PER_STEP, steps=TEST_EXPERIMENT["training"]["steps"])
    for strategy in ("zero3", "zero3_offload", "fsdp2_full"):
        got = weights(strategy)
        assert set(got) == set(ref)
        assert_within(f"weights: {strategy}", max(float((got[k].float() - ref[k].float()).abs().max()) for k in ref), tol)


# --- the memory model against hand-computed cases -------------------------------------------------
PYTHIA = 6.9e9
GB = 1e9


@pytest.mark.parametrize("rung, ranks, params_gb, grads_gb, optimizer_gb", [
    # 2Ψ + 2Ψ + 12Ψ with Ψ = 6.9e9, bf16 mixed precision with fp32 master weights and Adam moments
    ("zero0", 2, 13.8, 13.8, 82.8),          # 16Ψ = 110.4 GB: does not fit an 80 GB device
    ("zero1", 2, 13.8, 6.9, 41.4),           # optimizer /2; gradients partitioned at the boundary
    ("zero2", 2, 13.8, 6.9, 41.4),           # 2Ψ + 14Ψ/2 = 62.1 GB
    ("zero3", 2, 6.9, 6.9, 41.4),            # 16Ψ/2 = 55.2 GB
    ("zero2", 8, 13.8, 1.725, 10.35),        # 2Ψ + 14Ψ/8 = 25.875 GB
    ("zero3", 8, 1.725, 1.725, 10.35),       # 16Ψ/8 = 13.8 GB
])
def test_memory_model_pythia_bf16(rung, ranks, params_gb, grads_gb, optimizer_gb):
    got = rung_states(rung, PYTHIA, ranks, dtype="bf16", optimizer="adamw")
    assert got.param_bytes / GB == pytest.approx(params_gb)
    assert got.grad_bytes / GB == pytest.approx(grads_gb)
    assert got.optimizer_bytes / GB == pytest.approx(optimizer_gb)


def test_memory_model_zero1_holds_the_full_gradient_during_backward():
    # The ZeRO paper's ZeRO-1 figure, 4Ψ + 12Ψ/N, is the backward-time peak (full bf16 gradient).
    got = rung_states("zero1", PYTHIA, 8, dtype="bf16", optimizer="adamw")
    assert (got.param_bytes + got.grad_peak_bytes - got.grad_bytes + got.optimizer_bytes) / GB == pytest.approx(4 * 6.9 + 12 * 6.9 / 8)


def test_memory_model_fp32_split_and_offload():
    psi = 1e6
    zero0 = rung_states("zero0", psi, 2, dtype="fp32", optimizer="adamw")
    assert (zero0.param_bytes, zero0.grad_bytes, zero0.optimizer_bytes) == (4e6, 4e6, 8e6)  # 4 + 4 + 8
    zero2 = rung_states("zero2", psi, 2, dtype="fp32", optimizer="adamw")
    assert zero2.optimizer_bytes == (4 + 8) * psi / 2  # DeepSpeed's fp32 master partition + moments
    fsdp = rung_states("fsdp2_full", psi, 4, dtype="bf16", optimizer="adamw")
    assert fsdp.total_bytes == 16 * psi / 4 and fsdp.param_bytes == 4 * psi / 4  # fp32 shards, no master
    offload = rung_states("zero3_offload", psi, 2, dtype="bf16", optimizer="adamw")
    assert offload.offloaded_bytes == offload.param_bytes + offload.optimizer_bytes + offload.grad_bytes


# --- the decision tree: a view of the planner ---------------------------------------------------
A100 = "A100-80GB SXM"


def test_plan_zero_takes_the_cheapest_rung_the_planner_says_fits():
    model = model_shape("pythia-6.9b")
    # 2 x 80 GB: ZeRO-1 keeps 4 bytes of weights and gradients per parameter whole (83.9 GB with the
    # activations), ZeRO-2 shards the gradients (71.2 GB of 79.0 usable)
    assert plan(model, A100, 2)["choice"] == "zero2"
    assert plan(model, A100, 8)["choice"] == "zero1"  # 12 bytes of optimizer state over 8 ranks
    assert plan(model, A100, 2, overrides={"hbm_gb": 24})["choice"] == "zero2_offload"
    assert plan(model, A100, 1, host_memory_gb=64, overrides={"hbm_gb": 16})["choice"] is None  # host too small
    assert plan(model_shape("pythia-160m"), A100, 1)["choice"] == "zero0"


@pytest.mark.parametrize("name", ["pythia-160m", "pythia-1b", "pythia-6.9b", "pythia-12b", "gpt3-175b"])
@pytest.mark.parametrize("gpus", [1, 2, 8, 16, 64])
def test_plan_zero_and_plan_evaluate_agree_on_every_rung(name, gpus):
    """One memory model: each rung the tree lists fits exactly when `plan evaluate` says the same plan fits."""
    model = model_shape(name)
    cluster = cluster_of(A100, gpus)
    for row in plan(model, A100, gpus)["rows"]:
        fields = deepspeed_ladder()[row["rung"]]
        p = evaluate(model, rung_plan(fields, gpus), cluster, Workload(gpus, 2048), "deepspeed")
        assert isinstance(p, Prediction) and p.fits == row["fits"], (name, gpus, row["rung"])


def test_plan_zero_cli(capsys):
    assert plan_zero_main(["--model", "pythia-6.9b", "--hardware", A100, "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "choice: zero2" in out and "zero1" in out and "out of memory" in out
    for argv, message in ((["--gpus", "0"], "--gpus: 0 is not a count"), (["--gpus", "12"], "not whole nodes"),
                          (["--gpus", "2", "--what-if", "hbm=2"], "hbm"), (["--gpus", "2", "--hardware", "TPU"], "TPU")):
        with pytest.raises(SystemExit, match="2"):
            plan_zero_main(["--model", "pythia-6.9b", "--hardware", A100, *argv])
        assert message in capsys.readouterr().err


# --- malformed DeepSpeed settings are rejected before launch -------------------------------------
def _exp(strategy: str, options: dict | None = None, training: dict | None = None) -> dict:
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), {"training": training or {}})
    exp["strategy_options"] = {strategy: options or {}}
    return exp


@pytest.mark.parametrize("strategy, options, training, field, message", [
    ("zero0", {"offload_optimizer": "cpu"}, None, "offload_optimizer", "stage 0"),
    ("zero2", {"offload_param": "cpu"}, None, "offload_param", "needs ZeRO stage 3"),
    ("zero2_offload", {"offload_optimizer": "nvme"}, None, "offload_optimizer", "not an offload device"),
    ("zero3", {"stage": 2}, None, "stage", "unknown DeepSpeed option"),
    ("zero1", None, {"micro_batch_size": 3}, "training.micro_batch_size", "does not divide"),
    ("zero2", None, {"global_batch_size": 7}, "training.global_batch_size", "divisible"),
])
def test_malformed_deepspeed_settings_are_rejected(strategy, options, training, field, message):
    with pytest.raises(ConfigError, match=message) as err:
        REGISTRY[strategy].check(_exp(strategy, options, training), "experiments.test")
    assert err.value.field.endswith(field)


def test_wellformed_settings_pass():
    REGISTRY["zero3"].check(_exp("zero3", {"offload_param": "cpu", "offload_optimizer": "cpu"}), "x")
    REGISTRY["zero1"].check(_exp("zero1", None, {"micro_batch_size": 2}), "x")


# --- report tables: the tree-vs-runs check -------------------------------------------------------
def test_tree_check_flags_disagreement():
    """Outcomes of Pythia-6.9B runs on 80 GB devices against the planner's verdicts; failed runs count too
    (their parameter count comes from the model record, not from a summary they never wrote)."""
    from shardlab.tables import TableInputs
    from shardlab.tables.zero import build

    exp = {"name": "gpu", "strategies": ["zero0", "zero3", "zero2_offload"], "model": {"name": "pythia-6.9b", "source": "hub"},
           "training": {"dtype": "bf16", "optimizer": "adamw", "global_batch_size": 2, "seq_len": 8}}
    shape = {"vocab_size": 50432, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "intermediate_size": 16384}
    rank = {"rank": 0, "param_bytes": 1, "grad_bytes": 1, "optimizer_bytes": 1, "device_memory_bytes": 80e9}
    outcomes = {"zero0": "oom", "zero3": "ok", "zero2_offload": "oom"}  # the last one contradicts the tree
    summaries = [{"experiment": "gpu", "strategy": strategy, "status": status, "world_size": 2, "tokens_per_s": 1.0,
                  "model": {"parameters": PYTHIA}, "ranks": [rank] if status == "ok" else []}
                 for strategy, status in outcomes.items()]
    tables = build(TableInputs(summaries, {"gpu": exp}, {"pythia-6.9b": {"name": "pythia-6.9b", "shape": shape}}))
    check = tables["zero_tree_check"].set_index("strategy")
    assert check.loc["zero0", "consistent"] and not check.loc["zero0", "planner_says_fits"]
    assert check.loc["zero3", "consistent"]
    assert not check.loc["zero2_offload", "consistent"]
    assert set(tables["zero_plan"]["choice"]) >= {"zero0", "zero1", "zero2", "zero2_offload", "none (needs TP/PP)"}
    verdict = tables["zero_verdicts"].set_index("experiment").loc["gpu"]
    assert (verdict["tree_checked_runs"], verdict["tree_agreeing_runs"]) == (3, 2)


@pytest.mark.parametrize("held_activations,consistent", [(0.0, True), (2.0, False)])
def test_a_device_memory_budget_makes_the_tree_check_one_that_can_fail(held_activations, consistent):
    """On a CPU nothing runs out of memory: with a budget, each rung's measured device-resident model
    states and activations are the truth. A planner that put zero3_offload under the budget while its
    run held more (activations twice the usable bytes) fails the check."""
    from shardlab.costs.shapes import ModelShape
    from shardlab.costs.stacks import catalog
    from shardlab.tables import TableInputs
    from shardlab.tables.zero import build

    shape = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
             "intermediate_size": 256}
    model = ModelShape.from_dict(shape)
    rungs = ("zero0", "zero3", "zero3_offload")
    states = {s: rung_states(s, model.parameters(), 2, dtype="fp32", optimizer="adamw") for s in rungs}
    training = {"dtype": "fp32", "optimizer": "adamw", "global_batch_size": 2, "seq_len": 8}
    offload = evaluate(model, REGISTRY["zero3_offload"].run_plan({"training": training}, 2),
                       Cluster("CPU (calibrated)", 1, 2), Workload(2, 8), "shardlab", with_time=False)
    predicted = offload.device_bytes - offload.memory["comm_buffers"]
    budget = predicted / (1 - catalog()["reserved_memory_share"]) * 1.5  # zero3_offload fits, with half to spare
    exp = {"name": "cpu", "strategies": list(rungs), "model": {"name": "m", "source": "hub"}, "training": training,
           "launch": {"device_memory_budget_bytes": budget}}

    def held(s):
        extra = held_activations * budget if s == "zero3_offload" else 0.0
        return {"rank": 0, "param_bytes": states[s].param_bytes, "grad_bytes": states[s].grad_bytes,
                "optimizer_bytes": states[s].optimizer_bytes, "activation_bytes": extra, "device_memory_bytes": 25e9}

    summaries = [{"experiment": "cpu", "strategy": s, "status": "ok", "world_size": 2, "tokens_per_s": 1.0,
                  "model": {"parameters": model.parameters()}, "ranks": [held(s)]} for s in rungs]
    tables = build(TableInputs(summaries, {"cpu": exp}, {"m": {"name": "m", "shape": shape}}))
    check = tables["zero_tree_check"].set_index("strategy")
    assert check["budgeted"].all() and (check["evidence"] == "measured device bytes").all()
    assert not check.loc["zero0", "predicted_fits"] and check.loc["zero0", "consistent"]
    assert check.loc["zero3_offload", "predicted_fits"] and bool(check.loc["zero3_offload", "consistent"]) == consistent
    memory = tables["zero_memory"].set_index("strategy")
    assert memory.loc["zero3_offload", "measured_host_bytes"] > memory.loc["zero3_offload", "measured_device_bytes"]
