"""The planner (costs.plan / predict / search / planner): published large-scale points as a
regression set, plan validation, the search's bookkeeping, what-ifs, the command line, and the
cross-check against DeepSpeed's estimator and Megatron's formula."""

from __future__ import annotations

import json

import pytest

from shardlab.costs import crosscheck, rank_memory
from shardlab.costs.plan import Cluster, Plan, Workload, rejection
from shardlab.costs.planner import main as plan_main
from shardlab.costs.planner import model_shape
from shardlab.costs.predict import Prediction, evaluate
from shardlab.costs.search import Space, candidates, search
from shardlab.costs.shapes import ModelShape

H100 = "H100-80GB SXM"


@pytest.mark.parametrize("plan, nodes, field", [
    (Plan(dp=8, tp=3), 3, "tp"),  # 32 heads
    (Plan(dp=4), 1, "world"),
    (Plan(dp=8, micro_batch=3), 1, "micro_batch"),
    (Plan(dp=4, pp=2, schedule="interleaved"), 1, "virtual_stages"),
    (Plan(dp=8, schedule="interleaved", virtual_stages=2), 1, "schedule"),
    (Plan(dp=8, offload="optimizer", zero=0), 1, "offload"),
    (Plan(dp=8, framework="megatron", zero=3), 1, "zero"),
    (Plan(dp=4, cp=2, ep=2), 1, "ep"),  # a dense model has no experts
    (Plan(dp=1, tp=16), 2, "tp"),  # across nodes
])
def test_rejections_name_the_field(plan, nodes, field):
    model = model_shape("pythia-6.9b")
    reason = rejection(model, plan, Cluster(H100, nodes), Workload(256, 2048))
    assert reason is not None and reason.split(":")[0] == field, reason


LLAMA_70B = ModelShape(vocab_size=128256, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       intermediate_size=28672, mlp="swiglu", residual="sequential", biases=False)


@pytest.mark.parametrize("model, plan, nodes, field", [
    ("dense-1t", Plan(dp=6, tp=8, pp=64, schedule="interleaved", virtual_stages=3), 384, "virtual_stages"),
    ("dense-1t", Plan(dp=6, tp=8, pp=64, schedule="interleaved", virtual_stages=4), 384, "virtual_stages"),
    ("dense-1t", Plan(dp=6, tp=8, pp=64, schedule="interleaved", virtual_stages=8), 384, "virtual_stages"),
    (LLAMA_70B, Plan(dp=8, tp=8, pp=16, schedule="interleaved", virtual_stages=4), 128, "virtual_stages"),
    ("dense-1t", Plan(dp=128, tp=8, pp=3), 384, "pp"),  # 128 layers over 3 stages, nor 130
])
def test_pipeline_stages_must_cut_the_layers_evenly(model, plan, nodes, field):
    shape = model_shape(model) if isinstance(model, str) else model
    reason = rejection(shape, plan, Cluster(H100, nodes), Workload(3072, 2048))
    assert reason is not None and reason.startswith(f"{field}: "), reason
    assert not any(p.pp * p.virtual_stages % 3 == 0 or p.pp * p.virtual_stages > 130
                   for p in candidates(shape, Cluster(H100, nodes), Workload(3072, 2048), Space(cp=(1,), micro_batch=(1,))))


def test_llama3_405b_cuts_126_layers_over_16_stages_as_its_paper_does():
    """The embedding and the head take one layer's slot each: the first and last stage hold 7 layers."""
    model, plan = model_shape("llama3-405b"), Plan(dp=128, tp=8, pp=16, zero=1, framework="mcore")
    assert rejection(model, plan, Cluster(H100, 2048), Workload(2048, 8192)) is None
    assert rank_memory.rank_layers(126, 16, 1) == (7, *[8] * 14, 7)
    assert rank_memory.rank_layers(126, 16, 2) == (3 + 4, *[8] * 14, 4 + 3)  # 32 chunks of 4 slots
    assert rank_memory.rank_layers(128, 16, 1) == (8,) * 16  # even layers: embedding and head on top


def test_a_run_that_reduces_after_the_backward_pays_its_whole_all_reduce():
    """A plan's `grad_sync_overlap` overrides the stack's: False exposes the gradient all-reduce in full
    (a plain all-reduce after the backward, DeepSpeed without overlap_comm), True hides it behind the
    backward, None follows the stack (Megatron-Core overlaps). The registry states it for every run."""
    from shardlab.strategies import REGISTRY

    model, cluster, workload = model_shape("pythia-1b"), Cluster(H100, 2), Workload(64, 2048)
    dp_comm = {overlap: evaluate(model, Plan(dp=16, micro_batch=4, grad_sync_overlap=overlap), cluster,
                                 workload).time["dp_comm"] for overlap in (False, True, None)}
    assert dp_comm[False] > 0 and dp_comm[True] < dp_comm[False] / 2
    assert dp_comm[None] == dp_comm[True]
    overlapping = {name for name, spec in REGISTRY.items() if spec.plan_fields(4, {})["grad_sync_overlap"]}
    assert overlapping == {"dp_interleaved", "ddp", "fsdp2_full", "fsdp2_grad_op", "fsdp2_single"}


def test_evaluate_breaks_memory_and_time_down():
    model = model_shape("pythia-6.9b")
    p = evaluate(model, Plan(dp=8, zero=1, framework="mcore", micro_batch=2), Cluster(H100, 1), Workload(256, 2048))
    assert isinstance(p, Prediction) and p.fits
    assert p.device_bytes == pytest.approx(sum(p.memory[k] for k in rank_memory.MEMORY_CATEGORIES) - p.memory["host_bytes"])
    assert p.step_s == pytest.approx(sum(p.time.values()))
    assert 0 < p.mfu < 1 and p.tokens_per_s == pytest.approx(256 * 2048 / p.step_s)
    # ZeRO-1 with 8 ranks: optimizer state (fp32 master + Adam moments) is 12 bytes / 8 per parameter
    assert p.memory["optimizer"] == pytest.approx(12 * model.parameters() / 8, rel=1e-6)


def test_search_accounts_for_every_candidate_and_ranks_by_throughput():
    model, cluster, workload = model_shape("pythia-1.4b"), Cluster(H100, 1), Workload(64, 2048)
    result = search(model, cluster, workload, top=20)
    assert result.candidates == result.fitting + sum(result.rejected.values())
    assert result.ranked and all(p.fits for p in result.ranked)
    speeds = [p.tokens_per_s for p in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    best = evaluate(model, result.ranked[0].plan, cluster, workload)
    assert best.tokens_per_s == pytest.approx(result.ranked[0].tokens_per_s)


def test_a_model_too_large_for_the_cluster_has_no_plan():
    """1T parameters on one node: 16 TB of model states fit neither 8 x 80 GB nor 2 TB of host memory
    (with unlimited host memory, ZeRO-3 offloading everything would be a plan)."""
    space = Space(cp=(1,), micro_batch=(1,))
    node = Cluster(H100, 1, host_memory_gb=2048)
    result = search(model_shape("dense-1t"), node, Workload(64, 2048), top=5, space=space, stack="deepspeed")
    assert not result.ranked and result.rejected["out of memory"] > 0 and result.rejected["host memory"] > 0
    unlimited = search(model_shape("dense-1t"), Cluster(H100, 1), Workload(64, 2048), top=5, space=space,
                       stack="deepspeed")
    assert unlimited.ranked and all(p.plan.offload == "optimizer+params" for p in unlimited.ranked)


def test_the_search_space_at_scale_exceeds_100k_plans():
    """The scale the search is timed at (tests/test_planner_cli.py; the time itself is a benchmark, not a test)."""
    space = Space(virtual_stages=(2, 4, 8))
    n = sum(1 for _ in candidates(model_shape("llama3-405b"), Cluster(H100, 2048), Workload(2048, 8192), space))
    assert n >= 100_000


def test_what_ifs_move_the_prediction_the_right_way():
    model, workload = model_shape("llama3-405b"), Workload(2048, 8192)
    plan = Plan(dp=64, tp=8, pp=32, schedule="interleaved", virtual_stages=2, zero=1, framework="mcore")
    base = Cluster(H100, 2048)
    slow = evaluate(model, plan, base, workload)
    fast = evaluate(model, plan, base.scaled(network_gbps=2, intra_node_gbps=2), workload)
    assert fast.step_s < slow.step_s
    assert evaluate(model, plan, base.scaled(hbm_gb=1.5), workload).capacity_bytes == pytest.approx(1.5 * slow.capacity_bytes)


def test_cli_evaluate_and_search(capsys):
    args = ["--model", "pythia-1b", "--hardware", H100, "--nodes", "1", "--global-batch", "64", "--seq-len", "2048"]
    assert plan_main(["evaluate", *args, "--stack", "deepspeed", "--plan", "dp=8,framework=deepspeed,zero=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["plan"]["zero"] == 2 and set(out["time"]) >= {"compute", "dp_comm"}
    assert plan_main(["search", *args, "--top", "3"]) == 0
    assert "candidate plans" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2"):
        plan_main(["evaluate", *args, "--plan", "dp=8,zeroo=2"])
    assert "'zeroo' is not a plan field" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        plan_main(["evaluate", "--model", "pythia-1b", "--hardware", "TPU", "--nodes", "1", "--global-batch", "8",
                   "--seq-len", "128"])
    assert "argument --hardware: unknown accelerator 'TPU'" in capsys.readouterr().err


def test_deepspeed_estimator_differs_by_what_the_crosscheck_says():
    """DeepSpeed counts 2 + 18/N bytes per parameter at ZeRO-2; the planner 2 + 14/N plus a reduce bucket:
    the difference must be exactly the fp32 gradient partition less the bucket."""
    pytest.importorskip("deepspeed")
    model = model_shape("pythia-6.9b")
    psi, n = model.parameters(), 2
    row = next(r for r in crosscheck.deepspeed_rows("pythia-6.9b", model, n) if "ZeRO-2" in r["config"])
    bucket = rank_memory.model_states(Plan(dp=n, zero=2, framework="deepspeed"), psi, 0).grad_peak_bytes - 2 * psi / n
    assert (row["tool_gb"] - row["planner_gb"]) * 1e9 == pytest.approx(4 * psi / n - bucket, rel=1e-3)


def test_megatron_formula_agrees_on_weights_and_optimizer():
    """Where the layers split evenly (126 over 14 stages), as the formula assumes. Over 16 stages the
    planner cuts as Llama 3 did (the first stage: the embedding and 7 layers), which is the formula's
    stage of 7 layers (126 over 18), not its 126 / 16."""
    model, workload = model_shape("llama3-405b"), Workload(2048, 8192)

    def weights(pp: int) -> list[dict]:
        plan = Plan(dp=64, tp=8, pp=pp)
        return [r for r in crosscheck.megatron_rows("llama3-405b", model, plan, workload) if "weights" in r["quantity"]]

    even = weights(14)
    assert len(even) == 2 and all(abs(r["planner_vs_tool_pct"]) < 3 for r in even), even
    assert [r["planner_gb"] for r in weights(16)] == pytest.approx([r["tool_gb"] for r in weights(18)], rel=1e-3)


def test_core_sharing_is_measured_where_it_can_be_and_time_shared_beyond_the_cores():
    from shardlab.tables.predictions import concurrency_at

    factors = {2: 0.7}
    assert concurrency_at(1, factors, cores=2) == 1.0
    assert concurrency_at(2, factors, cores=2) == 0.7
    assert concurrency_at(4, factors, cores=2) == pytest.approx(0.35)  # 4 ranks on 2 cores: half each
    assert concurrency_at(4, {}, cores=8) == 1.0  # nothing measured, cores to spare


def test_a_pipeline_run_maps_onto_its_plan():
    from shardlab.strategies import REGISTRY
    from shardlab.tables import TableInputs
    from shardlab.tables.predictions import run_setting

    exp = {"name": "p", "model": {"name": "m", "source": "local", "vocab_size": 512, "hidden_size": 128, "num_layers": 4,
                                  "num_heads": 4, "intermediate_size": 512},
           "training": {"global_batch_size": 16, "seq_len": 64, "dtype": "fp32", "optimizer": "adamw"},
           "strategy_options": {"pp_interleaved": {"n_microbatches": 4}}}
    summary = {"experiment": "p", "strategy": "pp_interleaved", "world_size": 2}
    model, plan, workload = run_setting(summary, exp, TableInputs(experiments={"p": exp}))
    assert (plan.pp, plan.dp, plan.schedule, plan.virtual_stages, plan.micro_batch) == (2, 1, "interleaved", 2, 4)
    assert plan.framework == "torch" and REGISTRY["pp_interleaved"].plan_fields(2, {})["pp"] == 2
    assert workload == Workload(16, 64) and model.num_layers == 4


def test_prediction_tables_keep_their_columns_without_rows(tmp_path):
    """A study with no experiment of three runs has nothing to rank: the table is empty, not unreadable."""
    import pandas as pd

    from shardlab.tables import TableInputs, write_tables
    from shardlab.tables.predictions import build

    write_tables({k: v for k, v in build(TableInputs()).items() if k != "run_predictions"}, tmp_path)
    for name in ("run_prediction_ranking", "run_prediction_summary"):
        frame = pd.read_csv(tmp_path / f"{name}.csv")
        assert frame.empty and len(frame.columns) > 3


def test_fsdp2_gathers_in_the_compute_dtype_and_reduces_in_fp32():
    from shardlab.costs.comm_volume import gradient_bytes, parameter_bytes

    plan = Plan(dp=8, zero=3, framework="fsdp2", dtype="bf16")
    assert (parameter_bytes(plan), gradient_bytes(plan)) == (2, 4)


def test_zero3_step_time_changes_with_recompute():
    """A recomputed forward lengthens a ZeRO-3 step by what it recomputes: all of the forward (full), the
    matrix products and element-wise ops per-op checkpointing does not save (op), nothing (none)."""
    model, cluster, workload = model_shape("gpt3-175b"), Cluster(H100, 8), Workload(256, 2048)
    steps = {rc: evaluate(model, Plan(dp=64, zero=3, framework="fsdp2", micro_batch=1, recompute=rc), cluster, workload,
                          "torchtitan").step_s for rc in ("none", "op", "full")}
    assert steps["none"] < steps["op"] < steps["full"], steps


def test_zero3_holds_what_each_framework_gathers():
    """FSDP2 holds two transformer blocks gathered; DeepSpeed stops at its live-parameter limit plus a
    prefetch bucket (2 GB in bf16 at a 175B shape, where two blocks are 7 GB)."""
    from shardlab.costs.rank_memory import (DEEPSPEED_MAX_LIVE_PARAMETERS, DEEPSPEED_PREFETCH_BUCKET_PARAMETERS,
                                            ZERO3_PREFETCH_LAYERS, zero3_gathered_parameters)

    model = model_shape("gpt3-175b")
    layer = model.layer_parameters()
    fsdp2, deepspeed = (zero3_gathered_parameters(model, Plan(dp=64, zero=3, framework=f), layer)
                        for f in ("fsdp2", "deepspeed"))
    assert fsdp2 == ZERO3_PREFETCH_LAYERS * layer
    assert deepspeed == DEEPSPEED_MAX_LIVE_PARAMETERS + DEEPSPEED_PREFETCH_BUCKET_PARAMETERS < fsdp2 / 3
    tiny = ModelShape(512, 64, 2, 4, 256)  # a model smaller than the limit: both hold two blocks
    assert zero3_gathered_parameters(tiny, Plan(dp=2, zero=3, framework="deepspeed"), tiny.layer_parameters()) == \
        ZERO3_PREFETCH_LAYERS * tiny.layer_parameters()


def test_eager_attention_under_context_parallelism_scores_its_queries_against_every_key():
    """Half the queries per rank under cp=2, all the keys: the attention core's saved bytes halve (its Q, K, V
    rows and its score rows alike), where squaring the rank's share of the sequence would quarter the scores."""
    model, workload = model_shape("pythia-1b"), Workload(8, 4096)
    whole = rank_memory.activation_layer_parts(model, Plan(dp=8, attention="eager"), workload)["attention_core"]
    half = rank_memory.activation_layer_parts(model, Plan(dp=4, cp=2, attention="eager"), workload)["attention_core"]
    assert half == pytest.approx(whole / 2)


def test_dropout_keeps_a_mask_byte_per_hidden_value():
    """Two hidden dropouts a layer (after attention and after the MLP), a one-byte mask per value each."""
    model, plan = model_shape("pythia-1b"), Plan(dp=8)
    plain, dropped = (rank_memory.activation_layer_bytes(model, plan, Workload(8, 2048, p)) for p in (0.0, 0.1))
    assert dropped - plain == pytest.approx(2 * 2048 * 1 * model.hidden_size)
    assert rejection(model, plan, Cluster(H100, 1), Workload(8, 2048, 1.0)).startswith("dropout:")


@pytest.mark.parametrize("stack, plan, field", [
    ("megatron-core", Plan(dp=8, framework="deepspeed", zero=3), "framework"),
    ("fsdp", Plan(dp=8, framework="fsdp2", zero=3, recompute="selective"), "recompute"),
    ("megatron-lm", Plan(dp=4, tp=2, tp_overlap=True, framework="megatron"), "tp_overlap"),
])
def test_a_stack_rejects_what_it_cannot_run_naming_the_field(stack, plan, field):
    reason = rejection(model_shape("pythia-1b"), plan, Cluster(H100, 1), Workload(64, 2048), stack)
    assert reason is not None and reason.startswith(f"{field}: {stack}"), reason
