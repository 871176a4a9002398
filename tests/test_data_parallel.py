"""Data-parallel strategies reproduce the single-device reference under real torchrun (2 ranks, gloo),
and the data-parallel tables (throughput ratios, blocked communication per step) from synthetic runs."""

import pytest

from helpers import TEST_EXPERIMENT, assert_losses_match

from shardlab.strategies import REGISTRY, strategies_of
from shardlab.tables import TableInputs
from shardlab.tables.data_parallel import build

DP_STRATEGIES = ["dp_naive", "dp_interleaved", "ddp"]


@pytest.mark.torchrun
@pytest.mark.parity
@pytest.mark.parametrize("strategy", DP_STRATEGIES)
def test_dp_losses_match_single_device(strategy, run_once, reference_losses):
    summary, steps = run_once(strategy)
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == 2
    assert_losses_match([s["loss"] for s in steps], reference_losses)
    # Every rank holds a full replica: parameters, gradients and optimizer state are not sharded.
    ranks = summary["ranks"]
    assert ranks[0]["param_bytes"] == ranks[1]["param_bytes"] == ranks[0]["grad_bytes"]


@pytest.mark.torchrun
@pytest.mark.parity
def test_dp_with_gradient_accumulation_matches(run_strategy, reference_losses):
    """Two micro-batches per rank: sync only after the last one, same global-batch gradient."""
    summary, steps = run_strategy("dp_interleaved", {"training": {"micro_batch_size": 2}})
    assert summary["status"] == "ok", summary["reason"]
    assert_losses_match([s["loss"] for s in steps], reference_losses)


@pytest.mark.torchrun
@pytest.mark.parity
def test_bucketed_interleaved_dp_matches_single_device(run_once, reference_losses):
    """Layers packed into 0.1 MiB buckets (4 buckets of this model's 5 layer groups): the same averaged
    gradient, so the losses match the reference."""
    summary, steps = run_once("dp_interleaved", {"strategy_options": {"dp_interleaved": {"bucket_mb": 0.1}}})
    assert summary["status"] == "ok", summary["reason"]
    assert_losses_match([s["loss"] for s in steps], reference_losses)


def test_buckets_pack_consecutive_layers_up_to_the_cap_as_the_plan_does():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from shardlab.costs.comm_volume import pack_buckets
    from shardlab.costs.plan import Workload
    from shardlab.costs.predict import collectives
    from shardlab.costs.shapes import ModelShape
    from shardlab.strategies import get_spec
    from shardlab.strategies.data_parallel.comms import layer_buckets, size_buckets

    assert pack_buckets([3, 1, 2, 5, 1], cap=4) == [[0, 1], [2], [3], [4]]
    assert pack_buckets([3, 1, 2], cap=None) == [[0], [1], [2]]
    model_cfg = TEST_EXPERIMENT["model"]
    model = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=model_cfg["vocab_size"], hidden_size=model_cfg["hidden_size"], num_hidden_layers=model_cfg["num_layers"],
        num_attention_heads=model_cfg["num_heads"], intermediate_size=model_cfg["intermediate_size"]))
    shape = ModelShape.from_dict(model_cfg)
    spec = get_spec("dp_interleaved")
    for bucket_mb in (None, 0.1, 0.2, 25):
        buckets = size_buckets(model, bucket_mb)
        assert [p for b in buckets for p in b.params] == [p for b in layer_buckets(model) for p in b.params]
        exp = dict(TEST_EXPERIMENT, strategy_options={"dp_interleaved": {} if bucket_mb is None else {"bucket_mb": bucket_mb}})
        planned = collectives(shape, spec.run_plan(exp, 2), Workload.from_training(exp["training"]))
        assert sum(c.count for c in planned) == len(buckets), bucket_mb
        assert sorted(c.size_bytes for c in planned for _ in range(c.count)) == sorted(
            4 * sum(p.numel() for p in b.params) for b in buckets)
    assert len(size_buckets(model, 25)) == 1 < len(size_buckets(model, None))


@pytest.mark.parametrize("bucket_mb", [0, -1, "big", True])
def test_a_bad_bucket_size_names_the_field(bucket_mb):
    from shardlab.errors import ConfigError
    from shardlab.study import check_experiment

    exp = dict(TEST_EXPERIMENT, name="t", strategies=["dp_interleaved"],
               strategy_options={"dp_interleaved": {"bucket_mb": bucket_mb}})
    with pytest.raises(ConfigError, match=r"strategy_options\.dp_interleaved\.bucket_mb"):
        check_experiment(exp)


@pytest.mark.torchrun
@pytest.mark.parity
def test_parity_check_fails_without_gradient_averaging(run_strategy, reference_losses):
    """The comparison can fail: if ranks step on their local gradients, losses leave the reference."""
    summary, steps = run_strategy("dp_naive", {"training": {"fault_injection": "skip_grad_average"}})
    assert summary["status"] == "ok", summary["reason"]
    with pytest.raises(AssertionError, match="max \\|loss - reference\\|"):
        assert_losses_match([s["loss"] for s in steps], reference_losses)


@pytest.mark.torchrun
def test_hand_written_dp_records_communication_time(run_strategy):
    summary, steps = run_strategy("dp_naive")
    assert summary["comm_time_median_s"] > 0
    assert all(s["comm_time_s"] is not None for s in steps)


# --- the tables, from synthetic run summaries (no torchrun) ------------------------------------
def _dp_summary(strategy: str, tokens_per_s: float | None, experiment: str = "test", status: str = "ok") -> dict:
    """A run summary with its step records; only hand-written strategies time their communication."""
    timed = REGISTRY[strategy].twin is not None
    steps = [{"step": k, "loss": 5.0, "step_time_s": 0.2, "comm_time_s": 0.05 * (k + 1) if timed else None}
             for k in range(TEST_EXPERIMENT["training"]["steps"])]
    return {"experiment": experiment, "strategy": strategy, "status": status,
            "world_size": 1 if REGISTRY[strategy].single_process else 2,
            "tokens_per_s": tokens_per_s, "step_time_median_s": 0.2, "step_log": steps}


def _build(summaries):
    return build(TableInputs(summaries, {"test": TEST_EXPERIMENT, "science": dict(TEST_EXPERIMENT, name="science")}))


def test_throughput_ratios_to_the_reference_and_the_twin():
    rates = {"single": 100.0, "dp_naive": 120.0, "dp_interleaved": 150.0, "ddp": 160.0}
    summaries = [_dp_summary(s, r) for s, r in rates.items()]
    summaries += [_dp_summary("single", 100.0, "science"), _dp_summary("ddp", 50.0, "science")]
    table = _build(summaries)["dp_throughput"].set_index(["experiment", "strategy"])
    assert len(table) == len(summaries)  # reference runs are rows too
    assert table.loc[("test", "ddp"), "ratio_to_reference"] == pytest.approx(1.6)
    assert table.loc[("test", "single"), "ratio_to_reference"] == pytest.approx(1.0)
    assert table.loc[("test", "dp_interleaved"), "ratio_to_twin"] == pytest.approx(150 / 160)
    assert table.loc[("science", "ddp"), "ratio_to_reference"] == pytest.approx(0.5)


def test_pairs_are_every_ordered_pair_of_finished_runs_in_one_experiment():
    summaries = [_dp_summary("single", 100.0), _dp_summary("dp_naive", 120.0), _dp_summary("dp_interleaved", 150.0),
                 _dp_summary("ddp", None, status="failed"), _dp_summary("ddp", 80.0, "science")]
    pairs = _build(summaries)["dp_pairs"]
    finished = [s for s in strategies_of("data_parallel") if s != "ddp"]
    assert len(pairs) == len(finished) * (len(finished) - 1)  # no pair with the failed run, none across experiments
    ratio = pairs.set_index(["strategy", "other"])["ratio"]
    assert ratio[("dp_interleaved", "dp_naive")] == pytest.approx(1.25)
    assert ratio[("dp_naive", "dp_interleaved")] == pytest.approx(0.8)
    assert "single" not in set(pairs["strategy"]) | set(pairs["other"])  # the reference is not of this topic


def test_comm_steps_hold_the_runs_that_record_communication():
    summaries = [_dp_summary(s, 100.0) for s in ["single", *strategies_of("data_parallel")]]
    comm = _build(summaries)["dp_comm_steps"]
    assert set(comm["strategy"]) == {s for s in strategies_of("data_parallel") if REGISTRY[s].twin}
    warmup = TEST_EXPERIMENT["training"]["warmup_steps"]
    assert comm["timed"].tolist() == [k >= warmup for k in comm["step"]]
    first = comm[comm["step"] == 0].iloc[0]
    assert first["comm_fraction"] == pytest.approx(0.05 / 0.2)
