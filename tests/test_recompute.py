"""Activation recomputation (shardlab.strategies.recompute): in one process it keeps the same gradients,
dropout included (the RNG restore is what makes it so: without it they differ), and keeps for backward
what the cost model says each mode keeps; under torchrun the runner's recomputing runs match the
single device and their per-rank predictions; the tp_recompute table picks the right run to compare."""

from __future__ import annotations

import pytest
import torch

from shardlab.costs.activations import layer_bytes
from shardlab.runner.probes import ActivationProbe
from shardlab.strategies import recompute
from shardlab.tables.parity import UNIT_ROUNDOFF

FP32_EPS = UNIT_ROUNDOFF["fp32"]

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=256, vocab_size=96,
             max_position_embeddings=64)
ROWS, SEQ = 4, 32


def _model(dropout: float = 0.0):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(**SHAPE, hidden_dropout=dropout, attention_dropout=dropout, use_cache=False,
                           attn_implementation="sdpa")
    return GPTNeoXForCausalLM(config).train()


def _gradients(mode: str, dropout: float) -> dict[str, torch.Tensor]:
    model = _model(dropout)
    recompute.apply_recompute(model, mode)
    ids = torch.randint(0, SHAPE["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout masks
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _worst_relative_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in a)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_keeps_the_gradients_with_dropout(mode):
    """Recomputing replays the same float ops in the same order, so the gradients match the ones kept
    from the forward to within a few float32 roundings (here they are equal)."""
    assert _worst_relative_difference(_gradients(mode, 0.1), _gradients("none", 0.1)) <= 8 * FP32_EPS


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_without_the_rng_restore_dropout_differs_and_the_check_fails(mode, monkeypatch):
    """The check above can fail: recomputing without restoring the RNG draws other dropout masks."""
    monkeypatch.setattr(recompute, "PRESERVE_RNG_STATE", False)
    assert _worst_relative_difference(_gradients(mode, 0.1), _gradients("none", 0.1)) > 1e3 * FP32_EPS


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_each_mode_keeps_what_the_cost_model_says(mode):
    """Bytes saved for backward inside the transformer layers (the probe) against `layer_bytes` under
    this GPT-NeoX's SDPA layout, within 10 %; and each mode keeps less than the one before."""
    model = _model()
    recompute.apply_recompute(model, mode)
    ids = torch.randint(0, SHAPE["vocab_size"], (ROWS, SEQ))
    with ActivationProbe(model) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    kept = sum(n for name, n in probe.bytes_by_module().items() if name.startswith("gpt_neox.layers."))
    per_layer = layer_bytes(SEQ, ROWS, SHAPE["hidden_size"], SHAPE["num_attention_heads"],
                            SHAPE["intermediate_size"], attention="sdpa", recompute=mode)
    predicted = SHAPE["num_hidden_layers"] * sum(per_layer.values())
    assert abs(predicted - kept) / kept <= 0.10, (mode, predicted, kept, probe.bytes_by_module())


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_the_component_table_compares_under_the_runs_recompute(mode):
    """`comparison_rows` (table tp_activation_components) holds a recomputing run against the formula of
    its own mode: within 10 % per layer; against the no-recompute formula the full mode is off by far."""
    from shardlab.costs.activations import comparison_rows

    model = _model()
    recompute.apply_recompute(model, mode)
    ids = torch.randint(0, SHAPE["vocab_size"], (ROWS, SEQ))
    with ActivationProbe(model) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    dims = {"s": SEQ, "b": ROWS, "h": SHAPE["hidden_size"], "a": SHAPE["num_attention_heads"],
            "n_layers": SHAPE["num_hidden_layers"], "intermediate": SHAPE["intermediate_size"]}

    def totals(assumed: str) -> tuple[float, float]:
        rows = comparison_rows("none", probe.bytes_by_module(), dims, t=1, recompute=assumed)
        return sum(r["measured_bytes"] for r in rows), sum(r["model_formula_bytes"] for r in rows)

    measured, predicted = totals(mode)
    assert abs(predicted - measured) / measured <= 0.10
    if mode == "full":
        measured, predicted = totals("none")
        assert predicted > 5 * measured


# Under torchrun: the runner's runs with recompute, against the single-device run without it (the parity
# rule), and every rank's saved activations against the cost model's prediction for the same Plan.
RUNS = {
    "single-full": ("single", {}, "full"),
    "tp_sp-full": ("tp_sp", {}, "full"),
    "tp_sp-selective": ("tp_sp", {}, "selective"),
    "pp_1f1b-full": ("pp_1f1b", {}, "full"),
    "composed-pp2-tp2-sp-full": ("composed", {"world_size": 4, "tp": 2, "sp": True, "pp": 2, "n_microbatches": 2}, "full"),
    "composed-tp2-cp2-selective": ("composed", {"world_size": 4, "tp": 2, "cp": 2}, "selective"),
}


@pytest.mark.parity
@pytest.mark.torchrun
@pytest.mark.parametrize("case", RUNS)
def test_recompute_runs_match_single_and_their_prediction(case, run_once, reference_losses):
    import copy

    from helpers import TEST_EXPERIMENT, assert_losses_match
    from shardlab.config import deep_merge
    from shardlab.costs.plan import Workload
    from shardlab.costs.predict import rank_activations
    from shardlab.costs.shapes import ModelShape
    from shardlab.strategies import get_spec

    strategy, options, mode = RUNS[case]
    overrides = {"training": {"recompute": mode}, **({"strategy_options": {strategy: options}} if options else {})}
    summary, steps = run_once(strategy, overrides)
    assert summary["status"] == "ok", summary["reason"]
    assert_losses_match([s["loss"] for s in steps], reference_losses)
    exp = deep_merge(copy.deepcopy(TEST_EXPERIMENT), overrides)
    spec, model = get_spec(strategy), ModelShape.from_dict(TEST_EXPERIMENT["model"])
    plan, workload = spec.run_plan(exp, summary["world_size"]), Workload.from_training(exp["training"])
    assert plan.recompute == mode
    for rank in summary["ranks"]:
        measured = rank.get("pp_peak_live_activation_bytes") or rank["activation_bytes"]
        predicted = rank_activations(model, plan, workload, rank["rank"], working_set=False)
        assert measured == pytest.approx(predicted, rel=0.10), (rank["rank"], measured, predicted)
        kept_without = rank_activations(model, spec.run_plan(deep_merge(copy.deepcopy(exp), {"training": {
            "recompute": "none"}}), summary["world_size"]), workload, rank["rank"])
        if mode == "full":  # keeps a fraction of what a run without it would
            assert measured < kept_without / 2
        elif options.get("cp"):
            # Under the ring kernel selective keeps more than no recompute: the checkpoint keeps the kernel's
            # inputs as transformers passes them (the fused QKV output, rotary's new Q and K), which outweigh
            # the float32 copies the kernel saves itself. The cost model says so; this run shows it.
            assert measured > kept_without


def test_the_recompute_table_holds_each_mode_against_the_run_that_differs_only_in_it():
    """tp_recompute, from the real writers (`comparison_rows` on the probe's output, `activation_totals`): a
    recomputing run's share is of the same strategy's run in an experiment whose settings differ only in
    recompute, not of an experiment with other settings, nor of one with the same settings but no such run."""
    import pandas as pd

    from shardlab.costs.activations import comparison_rows
    from shardlab.tables.tensor_parallel import COLUMNS, activation_totals, recompute_rows

    dims = {"s": SEQ, "b": ROWS, "h": SHAPE["hidden_size"], "a": SHAPE["num_attention_heads"],
            "n_layers": SHAPE["num_hidden_layers"], "intermediate": SHAPE["intermediate_size"]}
    components = []
    for experiment, mode, rows in [("other", "none", ROWS // 2), ("tp", "none", ROWS), ("rc", "full", ROWS)]:
        model = _model()
        recompute.apply_recompute(model, mode)
        ids = torch.randint(0, SHAPE["vocab_size"], (rows, SEQ))
        with ActivationProbe(model) as probe:
            model(input_ids=ids, labels=ids).loss.backward()
        components += [{"experiment": experiment, "strategy": "single", "rank": 0, "recompute": mode, **row,
                        **dims, "activation_split": "none"}
                       for row in comparison_rows("none", probe.bytes_by_module(), dims, t=1, recompute=mode)]
    totals = activation_totals(pd.DataFrame(components, columns=COLUMNS))
    base = {"model": {"name": "m"}, "data": {"corpus": "c"}, "launch": {"world_size": 1}, "training": {"steps": 4}}
    experiments = {"other": {**base, "training": {"steps": 8}}, "no_single_run": base, "tp": base,
                   "rc": {**base, "training": {"steps": 4, "recompute": "full"}}}
    throughput = pd.DataFrame([{"experiment": "tp", "strategy": "single", "step_time_median_s": 1.0},
                               {"experiment": "rc", "strategy": "single", "step_time_median_s": 1.3}])
    table = recompute_rows(totals, throughput, experiments).set_index("recompute")
    measured = totals.set_index("experiment")["measured_bytes"]
    assert list(table["experiment"]) == ["tp", "rc"]
    assert table.loc["full", "kept_of_none"] == pytest.approx(measured["rc"] / measured["tp"])
    assert table.loc["full", "kept_of_none"] < 0.2  # a layer keeps its input only
    assert table.loc["full", "measured_over_model"] == pytest.approx(1.0, abs=0.10)
    assert table.loc["full", "step_time_ratio"] == pytest.approx(1.3)
    assert table.loc["none", "kept_of_none"] == pytest.approx(1.0)
