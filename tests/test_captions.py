"""The report's main-figure captions follow their tables: altering a row changes the conclusion."""

import pandas as pd

from shardlab.reporting import captions, science_captions


def test_the_parity_caption_names_a_run_that_leaves_the_tolerance():
    runs = pd.DataFrame({"run": ["dp · ddp", "tp · tp_sp"], "within_tolerance": [True, True]})
    assert captions.parity(runs).startswith("2 of 2 parallel runs reproduce")
    runs["within_tolerance"] = [True, "False"]  # as a CSV may read back
    assert captions.parity(runs).startswith("1 of 2 parallel runs reproduce their single-device reference's losses "
                                            "within the tolerance: tp · tp_sp do not.")


def test_the_bubble_caption_counts_runs_within_the_theory_and_names_the_worst():
    judged = pd.DataFrame({"strategy": ["pp_gpipe", "pp_1f1b"], "n_microbatches": [4, 4], "idle_error": [0.02, 0.05],
                           "idle_tolerance": [0.1, 0.1], "follows_theory": [True, True]})
    assert captions.pipeline_bubble(judged).startswith("2 of 2 pipeline runs keep")
    judged.loc[1, ["idle_error", "follows_theory"]] = [0.31, False]
    assert "1 of 2 pipeline runs" in captions.pipeline_bubble(judged)
    assert "off by most: pp_1f1b at m=4 (+0.31)" in captions.pipeline_bubble(judged)


def test_the_data_parallel_caption_leads_with_the_strategy_that_blocks_least():
    steps = pd.DataFrame({"strategy": ["dp_naive"] * 3 + ["dp_interleaved"] * 3, "timed": [False, True, True] * 2,
                          "comm_time_s": [0.5, 0.004, 0.006, 0.5, 0.001, 0.002]})
    assert captions.dp_blocking(steps).startswith("dp_interleaved blocks least")
    steps.loc[steps["strategy"] == "dp_interleaved", "comm_time_s"] = 0.009
    assert captions.dp_blocking(steps).startswith("dp_naive blocks least")


def _outcomes(**changes) -> pd.DataFrame:
    """science_outcomes rows as tables.science.outcomes writes them: one metric per row, verdicts over its runs."""
    table = pd.DataFrame({"domain": ["chemistry", "chemistry", "biology"], "metric_title": [
        "solubility error (log units)", "samples following the requested solubility (rank correlation)",
        "structural-class accuracy"], "value": [1.98, -0.09, 0.39], "baseline": [2.05, 0.0, 0.29], "baseline_name": [
        "training mean", "condition-blind sampler", "majority class"], "beats_baseline": ["every run", "no run", "every run"],
        "before": [4.0, None, 0.29], "improved": ["every run", None, "some runs"], "worse": ["no run", None, "no run"]})
    for column, values in changes.items():
        table[column] = values
    return table


def test_the_science_captions_count_the_same_rows_and_say_what_is_not_beaten():
    outcomes = _outcomes()
    assert science_captions.science_gains(outcomes).startswith(
        "The fine-tuned models beat their baseline beyond noise on 2 of 3 metrics in every run (solubility error (log "
        "units) and structural-class accuracy)")
    text = science_captions.science_outcomes(outcomes)
    assert "chemistry beats it on solubility error (log units) (1.98 against 2.05), but not on samples following the " \
           "requested solubility (rank correlation) (-0.09 against 0, condition-blind sampler)" in text
    assert text.endswith("2 of 3 metrics that have a baseline beat it beyond noise in every run.")
    assert science_captions.science_fine_tuning(outcomes).startswith(
        "Fine-tuning improved 1 of 2 metrics beyond noise in every run (solubility error (log units) 4 → 1.98)")
    changed = _outcomes(beats_baseline=["every run", "no run", "some runs"])  # one run that does not: not won
    assert "on 1 of 3 metrics" in science_captions.science_gains(changed)
    assert "1 of 3 metrics that have a baseline" in science_captions.science_outcomes(changed)


def test_the_science_weights_caption_names_identical_weights_failed_parity_and_metric_gaps():
    runs = pd.DataFrame({"experiment": ["science_biology"] * 2 + ["science_chemistry"] * 2,
                         "strategy": ["single", "ddp", "single", "tp"], "status": "ok",
                         "weights": ["aa", "aa", "bb", "cc"], "reference": "single"})
    parity = pd.DataFrame({"experiment": ["science_biology", "science_chemistry"], "strategy": ["ddp", "tp"],
                           "within_tolerance": [True, True], "max_loss_deviation": [0.0, 2e-7], "tolerance": [1e-3, 1e-3]})
    finals = pd.DataFrame({"experiment": ["science_chemistry"] * 2, "strategy": ["single", "tp"], "test_set": "test",
                           "metric": "logs_mae", "value": [1.90, 1.90], "low": [1.5, 1.5], "high": [2.3, 2.3]})
    text = science_captions.science_weights(runs, parity, finals)
    assert text.startswith("2 of 2 parallel fine-tuning runs passed parity with their single device (largest loss "
                           "deviation 2e-07, at most 0.02 % of its tolerance)")
    assert "identical weights to the single device's (sha256): biology ddp" in text
    assert "chemistry tp saved weights within rounding of the single device's, not identical; their domain metrics " \
           "equal the single device's" in text
    finals.loc[1, "value"] = 2.10  # half of the interval's half-width away
    assert "differ from the single device's by at most 50% of an interval's half-width" in science_captions.science_weights(
        runs, parity, finals)
    parity["within_tolerance"] = [True, "False"]  # as a CSV may read back
    parity.loc[1, "max_loss_deviation"] = 0.01
    assert science_captions.science_weights(runs, parity, finals).startswith(
        "1 of 2 parallel fine-tuning runs passed parity with their single device (largest loss deviation 0.01, at most "
        "1e+03 % of its tolerance); failed: science_chemistry tp")
    runs.loc[1, "weights"] = "dd"
    assert "identical weights" not in science_captions.science_weights(runs, parity, finals)


def test_the_published_caption_counts_metrics_with_a_reference():
    table = pd.DataFrame({"domain": "chemistry", "metric_title": ["solubility error", "valid molecules", "tracking"],
                          "test_set": ["test", "sampled", "sampled"], "value": [1.9, 0.75, -0.1],
                          "better": ["lower", "higher", "higher"], "published": [0.76, 0.97, None]})
    assert science_captions.science_published(table).startswith(
        "2 of 3 metrics beside a published figure from a real domain model; none was found for tracking. Farthest "
        "from the field: chemistry, solubility error, 1.9 against 0.76 (2.5 times worse); nearest: chemistry, valid "
        "molecules, 0.75 against 0.97 (1.3 times worse)")
    table.loc[0, "value"] = 0.5  # ahead of the field
    assert "nearest: chemistry, solubility error, 0.5 against 0.76 (0.7 times worse)" in \
        science_captions.science_published(table)


def test_the_offload_caption_says_which_rung_keeps_states_on_the_host():
    rungs = pd.DataFrame({"experiment": ["zero"] * 2, "strategy": ["zero3", "zero3_offload"],
                          "measured_device_bytes": [100, 0], "measured_host_bytes": [0, 300]})
    assert captions.host_offload(rungs).startswith("zero3_offload keeps 100% of its model states in host memory")
    rungs.loc[1, ["measured_device_bytes", "measured_host_bytes"]] = [100, 0]
    assert captions.host_offload(rungs).startswith("No rung keeps model states in host memory")


def test_the_tp_memory_caption_lists_the_categories_tp_holds_less_of():
    categories = {"param_bytes": "parameters", "activation_bytes": "activations"}
    memory = pd.DataFrame({"strategy": ["single", "tp"], "family": ["baseline", "tensor parallel"],
                           "parameters": [100, 55], "activations": [80, 40], "reference": "single"})
    assert captions.tp_memory(memory, categories).startswith("tp holds less than one device in all 2 categories")
    memory.loc[1, "activations"] = 90
    assert captions.tp_memory(memory, categories).startswith("tp holds less than one device in 1 of 2 categories "
                                                             "(parameters)")


def test_the_context_caption_gives_each_run_its_ratio_against_one_over_c():
    ratios = pd.DataFrame({"strategy": ["cp_ring"], "seq_len": [32], "activation_ratio": [0.45], "expected_ratio": [0.5]})
    assert captions.cp_activations(ratios) == "cp_ring at 32 tokens holds 0.45× the reference's activations per rank (1/c = 0.50)."
    assert captions.cp_activations(ratios.assign(activation_ratio=0.9)).startswith("cp_ring at 32 tokens holds 0.90×")
    assert captions.cp_activations(ratios.assign(predicted_ratio=0.52)).endswith(
        "activations per rank (predicted 0.52, 1/c = 0.50).")


def test_the_communication_caption_spans_the_least_and_most_communicating_runs():
    shares = pd.DataFrame({"strategy": ["ddp", "tp"], "comm_share": [0.1, 0.6]})
    assert captions.comm_share(shares).startswith("Communication takes from 10% (ddp) to 60% (tp) of a step")
    assert captions.comm_share(shares.assign(comm_share=[0.7, 0.6])).startswith("Communication takes from 60% (tp) to 70% (ddp)")


def test_the_mechanism_caption_groups_the_families_by_what_they_split():
    held = pd.DataFrame([{"family": f, "strategy": name, "rank": r, "category": c, "share": s}
                         for f, name, shares in (("data parallel", "ddp", (1, 1, 0.5)), ("zero", "zero3", (0.5, 0.5, 0.5)),
                                                 ("context parallel", "cp_ring", (1, 1, 0.45)))
                         for r in (0, 1) for c, s in zip(("parameters", "optimizer state", "activations"), shares)])
    assert captions.mechanisms(held).startswith("Zero (zero3) splits all 3 categories; data parallel (ddp) and context "
                                                "parallel (cp_ring) split only the activations.")
    held.loc[(held["family"] == "zero") & (held["category"] == "parameters"), "share"] = 1.0  # as ZeRO-2 would
    assert captions.mechanisms(held).startswith("Zero (zero3) splits only the optimizer state and activations;")


def test_the_zero_caption_weighs_the_memory_saved_against_the_throughput_lost():
    rungs = pd.DataFrame({"experiment": ["zero"] * 2, "strategy": ["zero0", "zero3"],
                          "measured_device_bytes": [4e6, 1e6], "tokens_per_s": [100.0, 50.0]})
    assert captions.zero_tradeoff(rungs).startswith("zero3 holds 0.95 MiB of model states on the device, 75% less than "
                                                    "the fastest rung, zero0, at 0.50× its throughput (zero)")
    rungs.loc[1, "tokens_per_s"] = 120.0
    assert captions.zero_tradeoff(rungs).startswith("zero3 is the fastest rung and holds least on the device (zero)")


def test_the_planner_caption_names_the_quantity_it_predicts_worst():
    runs = pd.DataFrame({"model_states_error_pct": [0.01, -0.02], "activations_error_pct": [1.0, -3.0],
                         "step_time_error_pct": [400.0, 20.0], "is_calibration_run": [True, False]})
    assert captions.planner_runs(runs).startswith("The planner predicts model states best (median error 0.015 %) and "
                                                  "step time worst (20 %)")
    runs["activations_error_pct"] = [50.0, 60.0]
    assert "and activations worst (55 %)" in captions.planner_runs(runs)


def test_each_tp_run_is_compared_with_the_single_device_of_its_own_experiment():
    categories = {"param_bytes": "parameters"}
    memory = pd.DataFrame({"tp_experiment": ["a", "a", "b", "b"], "strategy": ["single", "tp", "single", "tp"],
                           "run": ["single (a)", "tp (a)", "single (b)", "tp (b)"],
                           "family": ["baseline", "tensor parallel"] * 2, "parameters": [100, 55, 40, 30],
                           "reference": "single"})
    assert captions.tp_memory(memory, categories).startswith("tp (a) and tp (b) hold less than one device in all 1")
    memory.loc[3, "parameters"] = 50  # less than a's single device, more than its own
    assert captions.tp_memory(memory, categories).startswith("tp (a) holds less than one device in all 1 categories; "
                                                             "tp (b) holds less than one device in no category")


def test_the_composed_caption_says_which_goal_the_cost_model_misses():
    worst = pd.DataFrame({"quantity": ["model states", "activations"], "worst_abs_error_pct": [0.01, 4.7],
                          "goal_pct": [1.0, 10.0], "meets_goal": [True, True]})
    assert captions.composed_memory(worst).startswith("The cost model predicts every rank of every composed run "
                                                      "within its goals: worst errors model states 0.01 % (goal 1 %)")
    worst = worst.astype({"meets_goal": object})
    worst.loc[1, ["worst_abs_error_pct", "meets_goal"]] = [14.0, "False"]  # as a CSV may read back
    assert captions.composed_memory(worst).startswith("The cost model misses its goal for activations:")


def test_the_published_caption_names_a_missed_source_a_configuration_that_does_not_fit_and_informed_rows():
    by_source = pd.DataFrame([
        {"source": "a", "held_out_rows": 5, "held_out_mean_abs_pct": 4.0, "held_out_worst_abs_pct": 9.0, "held_out_bias_pct": 1.0},
        {"source": "b", "held_out_rows": 4, "held_out_mean_abs_pct": 12.0, "held_out_worst_abs_pct": 15.0, "held_out_bias_pct": -12.0},
        {"source": "c", "held_out_rows": 2, "held_out_mean_abs_pct": 50.0, "held_out_worst_abs_pct": 60.0, "held_out_bias_pct": 50.0}])
    rows = pd.DataFrame([{"row": "a[0]", "source": "a", "split": "held_out", "fits": True},
                         {"row": "b[1]", "source": "b", "split": "held_out", "fits": False},
                         {"row": "c[0]", "source": "c", "split": "informed", "fits": True}])
    text = captions.planner_published(by_source, rows)
    assert text.startswith("The planner misses its held-out goal on b") and "c 50" not in text  # c has 2 rows
    assert "1 configurations that ran are predicted not to fit (b[1])" in text and "1 rows (c) are in-sample" in text
    fine = captions.planner_published(by_source.iloc[:1], rows.iloc[:1])
    assert fine.startswith("On every source with three or more held-out rows") and "no configuration" in fine
