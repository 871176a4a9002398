"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) and the dp x pp hybrid.

Correctness: under real torchrun (gloo) every schedule reproduces the single-device losses within
the fp32 rounding tolerance of shardlab.tables.parity (the model is cut by hand, micro-batch losses are means and the schedule
divides gradients by m, so the gradients are the whole-batch mean). Measurement: per-stage live
activations follow the schedule (GPipe holds all m micro-batches, 1F1B at most p on stage 0) and
the bubble measured from op timestamps is near the theory (p-1)/(m+p-1) of the step's span.
"""

import json

import pytest
import torch

from helpers import TEST_EXPERIMENT, assert_losses_match
from shardlab.config import deep_merge
from shardlab.costs.bubble import theory_bubble_ratio, theory_idle_fraction
from shardlab.errors import ConfigError
from shardlab.strategies import get_spec
from shardlab.strategies.pipeline_parallel.probe import LiveSavedBytes
from shardlab.costs.shapes import stage_units
from shardlab.strategies.pipeline_parallel.stages import NeoXStage
from shardlab.tables import TableInputs
from shardlab.tables.pipeline import build


# --- no processes: the cut and the memory accounting -------------------------------------------
def _tiny_model():
    from transformers import GPTNeoXForCausalLM

    from shardlab.core.model import tiny_neox_config

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(tiny_neox_config(TEST_EXPERIMENT["model"]))


def test_stage_units_puts_embedding_first_and_head_last():
    assert stage_units(4, 2) == [["embed", 0, 1], [2, 3, "head"]]
    assert stage_units(2, 4) == [["embed"], [0], [1], ["head"]]  # more stages than layers
    with pytest.raises(ValueError, match="cannot be cut"):
        stage_units(2, 5)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_stages_chained_equal_the_full_model(n_stages):
    model = _tiny_model()
    tokens = torch.randint(0, 256, (3, 32))
    hidden = tokens
    for units in stage_units(2, n_stages):
        hidden = NeoXStage(model, units)(hidden)
    torch.testing.assert_close(hidden, model(input_ids=tokens).logits, rtol=0, atol=0)


def test_live_saved_bytes_follow_the_schedule():
    """Two micro-batches: forward-forward-backward-backward (GPipe) holds twice what alternating (1F1B) holds."""
    stage = NeoXStage(_tiny_model(), ["embed", 0, 1, "head"])
    batches = [torch.randint(0, 256, (2, 32)) for _ in range(2)]

    def run(order):
        tracker, pending = LiveSavedBytes(stage), {}
        with tracker:
            for op, i in order:
                if op == "F":
                    pending[i] = stage(batches[i]).float().logsumexp(-1).mean()
                else:
                    pending.pop(i).backward()
        return tracker

    gpipe = run([("F", 0), ("F", 1), ("B", 0), ("B", 1)])
    one_f_one_b = run([("F", 0), ("B", 0), ("F", 1), ("B", 1)])
    assert gpipe.live == one_f_one_b.live == 0  # everything released after backward
    assert one_f_one_b.peak > 0
    assert gpipe.peak == pytest.approx(2 * one_f_one_b.peak, rel=0.01)
    # both schedules save the same tensors in all: twice one micro-batch's peak
    assert gpipe.total == one_f_one_b.total == pytest.approx(2 * one_f_one_b.peak, rel=0.01)


@pytest.mark.parametrize("strategy, options, problem", [
    ("pp_1f1b", {"n_microbatches": 1}, "at least pp=2 micro-batches"),
    ("pp_gpipe", {"n_microbatches": 3}, "does not divide"),
    ("pp_gpipe", {"n_microbatches": 0}, "positive integer"),
    ("pp_gpipe", {"chunks": 2}, "unknown pipeline option"),
    ("hybrid_dp_pp", {"world_size": 4, "pp_size": 3}, "dp\\*tp\\*pp\\*cp = 3 is not the cluster's 4"),
    ("hybrid_dp_pp", {"world_size": 4, "pp_size": 1}, "at least 2"),
    ("pp_interleaved", {"world_size": 4}, "8 pipeline stages .* cannot be cut from 2 layers"),
])
def test_bad_pipeline_options_are_rejected(strategy, options, problem):
    exp = deep_merge(TEST_EXPERIMENT, {"strategy_options": {strategy: options}})
    spec = get_spec(strategy)
    with pytest.raises(ConfigError, match=problem) as err:
        spec.check(exp, "experiments.test")
    assert err.value.field.startswith(f"experiments.test.strategy_options.{strategy}")


def test_pipeline_tables_add_theory_and_flag_the_bottleneck():
    assert theory_idle_fraction(2, 4) == pytest.approx(1 / 5)
    assert theory_idle_fraction(2, 4, v=2) == pytest.approx(1 / 9)
    assert theory_bubble_ratio(2, 4, v=2) == pytest.approx(1 / 8)
    rank = {"pp_size": 2, "pp_virtual_stages": 1, "pp_n_microbatches": 4, "pp_step_span_s": 1.0,
            "pp_timeline": [["forward", 0, 0, 0.0, 0.1]]}
    ok = {"experiment": "e", "strategy": "pp_1f1b", "status": "ok", "ranks": [
        dict(rank, rank=0, pp_busy_s=0.6, pp_idle_fraction=0.4), dict(rank, rank=1, pp_busy_s=0.8, pp_idle_fraction=0.2)]}
    failed = {"experiment": "e", "strategy": "pp_gpipe", "status": "oom", "reason": "killed", "ranks": []}
    ignored = {"experiment": "e", "strategy": "ddp", "status": "ok", "ranks": [{"rank": 0}]}  # another topic
    tables = build(TableInputs(summaries=[ok, failed, ignored]))
    pipe = tables["pipeline"]
    assert list(pipe["strategy"]) == ["pp_1f1b", "pp_1f1b", "pp_gpipe"]
    assert list(pipe["bottleneck"][:2]) == [False, True]
    assert pipe["theory_idle_fraction"][0] == pytest.approx(0.2)
    assert pipe["status"][2] == "oom" and pipe["reason"][2] == "killed"
    assert len(tables["pipeline_timeline"]) == 2


# --- real torchrun -------------------------------------------------------------------------------
pp_runs = pytest.mark.torchrun


@pytest.mark.parity
@pp_runs
@pytest.mark.parametrize("strategy", ["pp_gpipe", "pp_1f1b", "pp_interleaved"])
def test_pipeline_losses_match_single_device(strategy, run_once, reference_losses):
    summary, steps = run_once(strategy)
    assert summary["status"] == "ok", summary["reason"]
    assert_losses_match([s["loss"] for s in steps], reference_losses)
    # validation loss runs through the schedule's forward-only path and reaches every rank
    assert steps[-1]["val_loss"] > 0
    first, last = summary["ranks"]
    # each rank holds only its stages: together they are the whole model
    stage_params = first["param_bytes"] + last["param_bytes"]
    assert stage_params == summary["model"]["parameters"] * 4
    assert first["pp_peak_live_activation_bytes"] > 0 and last["pp_peak_live_activation_bytes"] > 0
    if strategy == "pp_1f1b":
        # m=4, p=2: stage 0 holds 2 micro-batches in flight, stage 1 one; the stages are similar in size
        assert first["pp_peak_live_activation_bytes"] > 1.3 * last["pp_peak_live_activation_bytes"]
    if strategy == "pp_interleaved":
        assert first["pp_stage_ids"] == [0, 2] and last["pp_stage_ids"] == [1, 3]


@pytest.mark.parity
@pp_runs
def test_hybrid_dp_pp_matches_single_device(run_once, reference_losses):
    summary, steps = run_once("hybrid_dp_pp", {"strategy_options": {"hybrid_dp_pp": {"world_size": 4, "n_microbatches": 2}}})
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == 4
    assert_losses_match([s["loss"] for s in steps], reference_losses)
    ranks = summary["ranks"]
    assert sorted((r["dp_rank"], r["pp_rank"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s["comm_time_s"] is not None for s in steps)  # the dp all-reduce is timed


@pytest.mark.parity
@pp_runs
def test_hybrid_fails_parity_without_dp_all_reduce(run_strategy, reference_losses):
    """The check can fail: replicas that step on their own half-batch gradients leave the reference."""
    summary, steps = run_strategy("hybrid_dp_pp", {"strategy_options": {"hybrid_dp_pp": {"world_size": 4, "n_microbatches": 2}},
                                                   "training": {"fault_injection": "skip_grad_average"}})
    assert summary["status"] == "ok", summary["reason"]
    with pytest.raises(AssertionError, match="max \\|loss - reference\\|"):
        assert_losses_match([s["loss"] for s in steps], reference_losses)


# Bubble: more work per micro-batch than the parity runs, so per-op overheads (send/recv, Python)
# stay small next to compute. Theory for p stages and m micro-batches: the idle share of a step is
# (p-1)/(m+p-1) [bubble/compute = (p-1)/m]. We compare the bottleneck stage (most compute): lighter
# stages also wait for it, which is stage imbalance, not bubble. Margin: 0.25 absolute, generous
# because 2 shared CPU cores add noise to every timestamp.
BUBBLE_MARGIN = 0.25


@pp_runs
@pytest.mark.parametrize("strategy", ["pp_gpipe", "pp_1f1b"])
def test_bubble_near_theory_at_two_micro_batch_counts(strategy, run_strategy, capsys):
    measured = {}
    for m in (2, 8):
        summary, _ = run_strategy(strategy, {"training": {"seq_len": 128, "global_batch_size": 64},
                                             "strategy_options": {strategy: {"n_microbatches": m}}})
        assert summary["status"] == "ok", summary["reason"]
        bottleneck = max(summary["ranks"], key=lambda r: r["pp_busy_s"])
        p = bottleneck["pp_size"]
        theory = theory_idle_fraction(p, m)
        measured[m] = bottleneck["pp_idle_fraction"]
        with capsys.disabled():
            print(f"\n{strategy} m={m}: idle fraction per rank "
                  f"{json.dumps({r['rank']: round(r['pp_idle_fraction'], 3) for r in summary['ranks']})}, "
                  f"bottleneck {measured[m]:.3f}, theory {theory:.3f}")
        assert abs(measured[m] - theory) <= BUBBLE_MARGIN, (m, measured[m], theory)
    assert measured[8] < measured[2] + 0.05  # more micro-batches, smaller bubble (noise allowance)
