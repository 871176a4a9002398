"""The executive summary's verdicts and strategy choices are computed from the tables: altered tables
flip them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from shardlab.core.step_stats import run_to_run_sigma, throughput_ratio, with_run_noise
from shardlab.tables.verdicts import CONTRADICTED, SUPPORTED, UNDECIDED, decide_ratio, strategy_choice, verdicts


def _steps(times: dict[str, list[float]], experiment="data_parallel") -> pd.DataFrame:
    rows = [{"experiment": experiment, "strategy": s, "status": "ok", "step": i, "step_time_s": t, "timed": i > 0}
            for s, ts in times.items() for i, t in enumerate([9.9, *ts])]  # step 0: warm-up, never counted
    return pd.DataFrame(rows)


def _runs(parameters=924416, experiment="data_parallel") -> pd.DataFrame:
    return pd.DataFrame([{"experiment": experiment, "model.parameters": parameters}])


def _noisy(median: float, n: int = 13, spread: float = 0.02, seed: int = 0) -> list[float]:
    return list(median * (1 + spread * np.random.default_rng(seed).standard_normal(n)))


def _verdict(table: pd.DataFrame, claim: str) -> str:
    return table.loc[table["claim"] == claim, "verdict"].item()


def _tp(tp_sp_activation: float) -> pd.DataFrame:
    rows = [("single", 4.0, 4.0, 8.0, 40.0), ("tp", 2.0, 2.0, 4.0, 30.0), ("tp_sp", 2.0, 2.0, 4.0, tp_sp_activation)]
    return pd.DataFrame([{"tp_experiment": "tensor_parallel", "strategy": s, "param_bytes": p, "grad_bytes": g,
                          "optimizer_bytes": o, "activation_bytes": a} for s, p, g, o, a in rows])


def _zero(zero3_bytes: float) -> pd.DataFrame:
    sizes = {"zero0": 16.0, "zero1": 10.0, "zero2": 8.0, "zero3": zero3_bytes}
    return pd.DataFrame([{"experiment": "zero", "strategy": s, "status": "ok", "rank": r,
                          "measured_model_state_bytes": b} for s, b in sizes.items() for r in (0, 1)])


def test_a_clear_speed_up_is_supported_and_its_reverse_contradicted():
    fast, slow = _noisy(0.08, seed=1), _noisy(0.10, seed=2)
    table = verdicts({"steps": _steps({"dp_naive": slow, "dp_interleaved": fast, "ddp": slow}), "runs": _runs()})
    assert _verdict(table, "1a") == SUPPORTED
    row = table[table["claim"] == "1a"].iloc[0]
    assert row["ratio_low"] < row["ratio"] < row["ratio_high"] and row["ratio_low"] > 1
    assert _verdict(table, "1b") == UNDECIDED  # the same distribution: the interval straddles 1

    flipped = verdicts({"steps": _steps({"dp_naive": fast, "dp_interleaved": slow, "ddp": slow}), "runs": _runs()})
    assert _verdict(flipped, "1a") == CONTRADICTED


@pytest.mark.parametrize("ddp_median, leaning", [(0.1005, "against"), (0.0995, "with")])
def test_an_undecided_speed_claim_says_which_way_its_point_estimate_goes(ddp_median, leaning):
    """DDP 0.5 % slower (or faster) than naive DP, within the noise: not decidable, and the evidence
    says whether the point estimate goes against the claim or with it."""
    steps = _steps({"dp_naive": _noisy(0.10, seed=1), "ddp": _noisy(ddp_median, seed=1)})
    row = verdicts({"steps": steps, "runs": _runs()}).set_index("claim").loc["1b"]
    assert row["verdict"] == UNDECIDED and f"the point estimate goes {leaning} the claim" in row["evidence"]


def test_growth_with_model_size_needs_two_sizes():
    steps = _steps({"dp_naive": _noisy(0.10), "dp_interleaved": _noisy(0.08, seed=3)})
    one_size = verdicts({"steps": steps, "runs": _runs()})
    assert _verdict(one_size, "1c") == UNDECIDED

    big = _steps({"dp_naive": _noisy(1.0, seed=4), "dp_interleaved": _noisy(0.5, seed=5)}, experiment="dp_1b")
    two_sizes = verdicts({"steps": pd.concat([steps, big]),
                          "runs": pd.concat([_runs(), _runs(1_000_000_000, "dp_1b")])})
    assert _verdict(two_sizes, "1c") == SUPPORTED


@pytest.mark.parametrize("tp_sp_activation,verdict", [(20.0, SUPPORTED), (35.0, CONTRADICTED)])
def test_sequence_parallel_activation_claim_follows_the_table(tp_sp_activation, verdict):
    table = verdicts({"steps": _steps({}), "runs": _runs(), "tp_memory_categories": _tp(tp_sp_activation)})
    assert _verdict(table, "4") == verdict
    assert _verdict(table, "3") == SUPPORTED


def test_tensor_parallel_memory_claim_is_undecided_where_single_holds_no_optimizer_state():
    tp = _tp(20.0).assign(optimizer_bytes=0.0)  # SGD: no optimizer state to reduce
    row = verdicts({"steps": _steps({}), "runs": _runs(), "tp_memory_categories": tp}).set_index("claim").loc["3"]
    assert row["verdict"] == UNDECIDED and "single holds no optimizer" in row["evidence"]


@pytest.mark.parametrize("zero3_bytes,verdict", [(5.0, SUPPORTED), (9.0, CONTRADICTED)])
def test_zero3_memory_claim_follows_the_table(zero3_bytes, verdict):
    table = verdicts({"steps": _steps({}), "runs": _runs(), "zero_memory": _zero(zero3_bytes)})
    assert _verdict(table, "2a") == verdict


def test_rungs_holding_the_same_bytes_are_named_as_tied():
    zero = _zero(5.0)
    zero.loc[zero["strategy"] == "zero2", "measured_model_state_bytes"] = 10.0  # as zero1
    row = verdicts({"steps": _steps({}), "runs": _runs(), "zero_memory": zero}).set_index("claim").loc["2a"]
    assert "zero1 = zero2 hold the same" in row["evidence"]
    assert "hold the same" not in verdicts({"steps": _steps({}), "runs": _runs(),
                                            "zero_memory": _zero(5.0)}).set_index("claim").loc["2a", "evidence"]


def test_claims_without_data_are_not_decidable_and_say_why():
    table = verdicts({"steps": _steps({}), "runs": _runs()})
    assert set(table["verdict"]) == {UNDECIDED}
    assert table["evidence"].str.len().gt(10).all()


def test_the_ratio_interval_is_a_bootstrap_of_median_step_times():
    ratio, low, high = throughput_ratio([1.0] * 5, [2.0] * 5)
    assert ratio == low == high == 2.0  # no noise: a point
    assert decide_ratio(1.01, 1.2) == SUPPORTED and decide_ratio(0.8, 0.99) == CONTRADICTED
    assert decide_ratio(0.9, 1.1) == UNDECIDED


def test_the_strategy_choice_skips_wrong_runs_and_says_when_it_cannot_separate():
    steps = _steps({"single": _noisy(0.20, seed=6), "ddp": _noisy(0.10, seed=7), "dp_naive": _noisy(0.05, seed=8),
                    "zero3": _noisy(0.101, seed=9)})
    ranks = pd.DataFrame([{"experiment": "data_parallel", "strategy": s, "param_bytes": p, "grad_bytes": p,
                           "optimizer_bytes": 2 * p} for s, p in (("single", 4), ("ddp", 4), ("dp_naive", 4), ("zero3", 1))])
    parity = pd.DataFrame([{"experiment": "data_parallel", "strategy": "dp_naive", "within_tolerance": False},
                           {"experiment": "data_parallel", "strategy": "ddp", "within_tolerance": True}])
    choice = strategy_choice({"steps": steps, "ranks": ranks, "parity": parity}).set_index("goal")
    assert choice.loc["throughput", "choice"] in ("ddp", "zero3")  # dp_naive is fastest, but wrong
    assert not choice.loc["throughput", "decided"]  # ddp and zero3 differ by 1 %: noise
    assert choice.loc["memory per rank", "choice"] == "zero3" and choice.loc["memory per rank", "decided"]


def test_the_strategy_choice_leaves_noise_floor_runs_out_and_names_unequal_compute():
    steps = _steps({"single": _noisy(0.05, seed=6), "ddp": _noisy(0.10, seed=7), "single_reordered": _noisy(0.01, seed=8)})
    runs = pd.DataFrame([{"experiment": "data_parallel", "strategy": s, "status": "ok", "compute.count": n,
                          "compute.unit": "GPU"} for s, n in (("single", 1), ("ddp", 8), ("single_reordered", 1))])
    choice = strategy_choice({"steps": steps, "runs": runs}).set_index("goal").loc["throughput"]
    assert (choice["choice"], choice["versus"]) == ("single", "ddp")  # the noise-floor run is no candidate
    assert "1 GPU against 8" in choice["evidence"]
    equal = strategy_choice({"steps": steps, "runs": runs.assign(**{"compute.count": 2, "compute.unit": "core"})})
    assert "against" not in equal.set_index("goal").loc["throughput", "evidence"]


def _repeats(ratios: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"strategy": "a", "versus": "b", "ratio": ratios})


def test_run_to_run_noise_is_the_pooled_spread_of_log_ratios_over_repeats():
    assert run_to_run_sigma(_repeats([1.0, 1.0, 1.0])) == 0.0
    assert run_to_run_sigma(_repeats([1.0])) == 0.0  # one run says nothing about repeats
    ratios = [0.9, 1.0, 1.2]
    assert run_to_run_sigma(_repeats(ratios)) == pytest.approx(np.std(np.log(ratios), ddof=1))
    two_pairs = pd.concat([_repeats([1.0, 1.1]), _repeats([2.0, 2.0]).assign(strategy="c")])
    assert run_to_run_sigma(two_pairs) == pytest.approx(np.sqrt(np.var(np.log([1.0, 1.1]), ddof=1) / 2))
    low, high = with_run_noise(1.0, 0.99, 1.01, sigma=0.1)
    assert (low, high) == pytest.approx((np.exp(-0.196), np.exp(0.196)))
    assert with_run_noise(1.0, 0.5, 2.0, sigma=0.1) == (0.5, 2.0)  # the wider of the two


def test_run_to_run_noise_turns_a_within_run_difference_into_a_tie():
    """A 10 % speed-up with tight step times is decided on within-run noise alone, and not decided once
    the measured run-to-run noise of ratios (here 10 %) says a rerun could move it by more."""
    steps = _steps({"dp_naive": _noisy(0.10, spread=0.005, seed=1), "dp_interleaved": _noisy(0.091, spread=0.005, seed=2)})
    quiet = verdicts({"steps": steps, "runs": _runs()})
    assert _verdict(quiet, "1a") == SUPPORTED
    noisy = verdicts({"steps": steps, "runs": _runs(), "timing_noise": _repeats([0.9, 1.0, 1.1, 1.0, 0.92])})
    assert _verdict(noisy, "1a") == UNDECIDED
    assert "within this run" in noisy.loc[noisy["claim"] == "1a", "evidence"].item()
    choice = strategy_choice({"steps": steps, "timing_noise": _repeats([0.9, 1.0, 1.1])})
    assert not choice.loc[choice["goal"] == "throughput", "decided"].item()


def _abstract(tables: dict[str, pd.DataFrame]) -> str:
    from shardlab.tables.abstract import abstract

    return " ".join(abstract({**tables, "verdicts": verdicts(tables)})["sentence"])


def _finished_runs(strategies: list[str], experiment="data_parallel") -> pd.DataFrame:
    return pd.DataFrame([{"experiment": experiment, "strategy": s, "family": s.split("_")[0], "status": "ok",
                          "model.parameters": 924416, "tokens_per_step": 256, "world_size": 1 if s == "single" else 2,
                          "environment.device_type": "cpu", "environment.device_name": "cpu",
                          "environment.cpu_cores": 2, "environment.cpu_model": "EPYC"} for s in strategies])


def test_the_abstract_is_computed_from_the_tables_and_follows_them():
    """What ran, parity and its sensitivity, memory against the cost model, the planner on held-out published
    runs, the science outcome, and throughput only where timed side by side, each from a table: altering a
    table alters the sentence."""
    runs = _finished_runs(["single", "dp_naive", "ddp"])
    parity = pd.DataFrame([{"experiment": "data_parallel", "strategy": s, "within_tolerance": True}
                           for s in ("dp_naive", "ddp")])
    caught = pd.DataFrame({"dtype": ["fp32"], "caught": [5], "injected": [6], "smallest_gradient_error": [0.004],
                           "smallest_case": ["scale"]})
    memory = pd.DataFrame({"quantity": ["model_states", "activations"], "runs": [72, 72],
                           "mean_abs_error_pct": [0.002, 0.59], "worst_abs_error_pct": [0.012, 13.6]})
    published = pd.DataFrame({"split": ["held_out", "held_out", "calibration"], "error_pct": [-10.0, 30.0, 1.0],
                              "source": ["a", "b", "a"], "stack": ["fsdp", "megatron-lm", "fsdp"],
                              "accelerator": ["H100-80GB SXM", "A100-80GB SXM", "H100-80GB SXM"],
                              "fits": [True, "False", True]})
    outcomes = pd.DataFrame({"domain": ["chemistry", "chemistry"], "metric_title": ["validity", "tracking"],
                             "beats_baseline": ["every run", "no run"]})
    tables = {"steps": _steps({"single": _noisy(0.10, 2), "dp_naive": _noisy(0.10, 2), "ddp": _noisy(0.08, 1)}),
              "runs": runs, "parity": parity, "parity_caught": caught, "run_prediction_summary": memory,
              "planning_published": published, "science_outcomes": outcomes, **_paired([1.3, 1.25, 1.35, 1.28])}
    text = _abstract(tables)
    assert "3 training runs of 3 strategies" in text and "920 thousand parameters" in text
    assert ("2 of 2 parallel runs reproduce their single-device reference's losses within the parity rule, a rule "
            "that caught 5 of 6 errors injected on purpose in fp32, the smallest moving the mean gradient by 0.40%") in text
    assert "Every run finished" in text and "on 2 CPU cores (EPYC, gloo)" in text
    assert "model states within 0.012 % (mean 0.002 %) and activations within 14 % (mean 0.59 %)" in text
    assert ("On 2 published training runs the planner was not fitted to (2 sources, 2 software stacks, A100, H100), it "
            "predicts throughput per GPU within 20 % on average and 30 % at worst, and says \"does not fit\" for 1 of "
            "the 3 published runs") in text
    assert "chemistry beats a trivial baseline on validity but not on tracking (1 of 2 metrics, in every run)" in text
    assert 'Timed side by side on CPU cores, "PyTorch DDP beats naive data parallelism in throughput" is supported' in text
    assert "What carries over to GPUs: memory per rank" in text

    unpaired = {k: v for k, v in tables.items() if not k.startswith("paired_timing")}
    assert "Timed side by side" not in _abstract(unpaired)  # separate runs' throughput is not in the abstract
    wrong = parity.assign(within_tolerance=[True, False])
    failed = runs.assign(status=["ok", "ok", "failed"])
    text = _abstract({**tables, "runs": failed, "parity": wrong, **_paired([0.7, 0.75, 0.72, 0.74])})
    assert "1 of 2 parallel runs reproduce" in text and "ddp do not" in text
    assert "1 run(s) did not finish (ddp)" in text
    assert 'in throughput" is contradicted' in text
    on_gpu = _abstract({**tables, "runs": runs.assign(**{"environment.device_type": "cuda",
                                                         "environment.device_name": "NVIDIA H100"})})
    assert "on NVIDIA H100" in on_gpu and "What carries over to GPUs" not in on_gpu


def _paired(ratios: list[float], experiment: str = "data_parallel") -> dict[str, pd.DataFrame]:
    """A paired-timing table: per round, ddp's tokens/s `ratio` times dp_naive's (dp_interleaved at 1.0)."""
    rows = [{"experiment": experiment, "round": r, "strategy": s, "tokens_per_s": tps, "status": "ok"}
            for r, ratio in enumerate(ratios)
            for s, tps in (("dp_naive", 1000.0), ("dp_interleaved", 1000.0), ("ddp", 1000.0 * ratio))]
    return {f"paired_timing_{experiment}": pd.DataFrame(rows)}


@pytest.mark.parametrize("ratios, verdict", [
    ([1.30, 1.28, 1.33, 1.31], SUPPORTED),  # every round the same way, by far more than the rounds' spread
    ([1.10, 0.95, 1.08, 0.97], UNDECIDED),  # a mean of 1.02 inside the rounds' own spread
    ([0.80, 0.82, 0.79, 0.81], CONTRADICTED),
])
def test_a_speed_claim_timed_side_by_side_rests_on_its_rounds(ratios, verdict):
    """The separate runs say DDP is 1.5x naive; the paired rounds of the same DAG decide, and a ratio inside
    the rounds' own noise is not decidable."""
    runs = _finished_runs(["dp_naive", "ddp"])
    tables = {"steps": _steps({"dp_naive": _noisy(0.15), "ddp": _noisy(0.10)}), "runs": runs, **_paired(ratios)}
    table = verdicts(tables)
    assert _verdict(table, "1b") == verdict
    evidence = table.loc[table["claim"] == "1b", "evidence"].item()
    assert f"side by side in {len(ratios)} rounds" in evidence
    assert "; timed on CPU, 2 cores, 2 ranks" in evidence
    crowded = runs.assign(world_size=4)
    assert "4 ranks (more ranks than cores: they time-share)" in verdicts({**tables, "runs": crowded}).loc[
        lambda t: t["claim"] == "1b", "evidence"].item()
    assert _verdict(verdicts({"steps": tables["steps"], "runs": _runs()}), "1b") == SUPPORTED  # unpaired: the fluke


def test_the_run_to_run_table_comes_from_the_paired_rounds_of_this_dag():
    from shardlab.tables.verdicts import run_to_run_noise

    noise = run_to_run_noise(_paired([1.10, 0.95, 1.08, 0.97]) | {"timing_noise": pd.DataFrame(
        [{"experiment": "x", "strategy": "a", "versus": "b", "ratio": 2.0, "cpu_model": "m", "cpu_cores": 2,
          "date": "2026-01-01"}] * 2)})
    pair = noise[(noise["strategy"] == "ddp") & (noise["versus"] == "dp_naive")]
    assert set(noise["date"]) == {"this DAG"} and pair["repeats"].item() == 4  # not the committed file's rows
    assert pair["ratio_min"].item() == pytest.approx(0.95) and pair["ratio_max"].item() == pytest.approx(1.10)
