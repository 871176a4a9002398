"""Captions of the report's main figures, computed from the tables they draw: the first sentence is the
conclusion, so it changes when the data do (tests/test_captions.py alters a table to show it)."""

from __future__ import annotations

import pandas as pd


def truthy(column: pd.Series) -> pd.Series:
    """A boolean column as read back from a CSV (True/False, or their strings)."""
    return column.astype(str).str.lower().eq("true")


def listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def parity(parity_runs: pd.DataFrame) -> str:
    """parity.csv rows with a deviation and a tolerance, plus a `run` label."""
    within = truthy(parity_runs["within_tolerance"])
    outside = parity_runs.loc[~within, "run"]
    return (f"{int(within.sum())} of {len(parity_runs)} parallel runs reproduce their single-device reference's losses "
            "within the tolerance" + ("." if outside.empty else ": " + ", ".join(outside) + " do not.")
            + " Each run's largest loss deviation (point) against its tolerance (tick), log scale.")


def resharding(table: pd.DataFrame) -> str:
    """resharding.csv: one plan's checkpoint resumed under others, each against the uninterrupted run and the
    single-device reference."""
    plan = table[table["role"] == "uninterrupted"].iloc[0]
    where = f"{plan.strategy} on {plan.world_size:.0f} ranks"
    if plan.status != "ok":
        return f"{where} was to write the checkpoint the other plans resume, and failed: {plan.reason}."
    resumed = table[table["role"] == "resumed"]
    ok = resumed[resumed["status"] == "ok"]
    verdicts = ok["within_tolerance"].map({True: "within", False: "outside"}).fillna("undecided")
    plans = [f"{r.strategy} on {r.world_size:.0f} ranks" for r in resumed.itertuples()]
    text = (f"A checkpoint written by {where} after step {ok['from_step'].min() - 1:.0f} was loaded under "
            + " and ".join([", ".join(plans[:-1]), plans[-1]] if len(plans) > 1 else plans)
            + ", each cutting its own shards from the same whole tensors. ")
    if len(ok):
        text += (f"{int((verdicts == 'within').sum())} of {len(resumed)} continue the uninterrupted run's losses within the "
                 f"float32 rule (largest deviation {ok['max_loss_deviation'].max():.1e} against a tolerance of "
                 f"{ok['tolerance'].min():.1e})")
        judged = table.dropna(subset=["reference_deviation"])
        if len(judged):
            close = truthy(judged["within_reference_tolerance"])
            text += (f"; {int(close.sum())} of {len(judged)} curves, the uninterrupted one included, stay within their "
                     f"single-device reference's tolerance")
        text += "."
    failed = resumed[resumed["status"] != "ok"]
    if len(failed):
        text += " " + " ".join(f"{r.strategy} failed: {r.reason}." for r in failed.itertuples())
    return text


def pipeline_bubble(judged: pd.DataFrame) -> str:
    """One row per pipeline run (its bottleneck rank) with `idle_error`, `idle_tolerance`, `follows_theory`."""
    held = truthy(judged["follows_theory"])
    off = judged[~held]
    return (f"{int(held.sum())} of {len(judged)} pipeline runs keep their bottleneck stage's idle share within "
            f"±{judged['idle_tolerance'].iloc[0]:.2f} of the bubble theory (p−1)/(v·m + p−1)"
            + ("." if off.empty else "; off by most: " + ", ".join(
                f"{r.strategy} at m={r.n_microbatches:.0f} ({r.idle_error:+.2f})"
                for r in off.sort_values("idle_error", key=abs, ascending=False).head(3).itertuples()) + ".")
            + " Filled marks: each run's bottleneck rank; line: the theory.")


def dp_blocking(steps: pd.DataFrame) -> str:
    """dp_comm_steps.csv: the median time a step blocks in gradient communication, per strategy."""
    timed = steps[truthy(steps["timed"])]
    medians = timed.groupby("strategy")["comm_time_s"].median().sort_values()
    if medians.empty:
        return "No data-parallel run timed its gradient communication."
    parts = [f"{name} {seconds * 1e3:.2g} ms" for name, seconds in medians.items()]
    lead = (f"{medians.index[0]} blocks least on gradient communication per step" if len(medians) > 1 else
            f"{medians.index[0]} blocks on gradient communication")
    return f"{lead} (median over timed steps: {', '.join(parts)}). Boxes: timed steps; crosses: warm-up steps."


def host_offload(rungs: pd.DataFrame) -> str:
    """zero_memory.csv rows of finished rungs: measured device and host bytes per rank."""
    host = rungs["measured_host_bytes"] / (rungs["measured_host_bytes"] + rungs["measured_device_bytes"])
    offloading = rungs.assign(share=host.fillna(0))[host.fillna(0) > 0]
    return ("; ".join(f"{r.strategy} keeps {r.share:.0%} of its model states in host memory ({r.experiment})"
                      for r in offloading.itertuples()) or "No rung keeps model states in host memory"
            ) + "; every other rung keeps them all on the device."


def tp_memory(memory: pd.DataFrame, categories: dict[str, str]) -> str:
    """tp_memory_categories.csv rows of each TP experiment's own runs: per run, bytes per rank by category
    (columns renamed to `categories`' values). Which categories each tensor-parallel run holds less of than
    its experiment's single device."""
    groups: dict[tuple, list[str]] = {}
    for _, runs in memory.groupby(memory.get("tp_experiment", pd.Series("", index=memory.index)), sort=False):
        references = runs[runs["strategy"] == runs["reference"]].set_index("strategy")
        for _, row in runs[runs["family"] == "tensor parallel"].iterrows():
            if row["reference"] not in references.index:
                continue
            reference = references.loc[row["reference"]]
            cut = tuple(name for name in categories.values() if row[name] < reference[name])
            groups.setdefault(cut, []).append(row.get("run", row["strategy"]))
    if not groups:
        return "Memory per rank by category (mean over ranks)."
    parts = [f"{listed(runs)} {'holds' if len(runs) == 1 else 'hold'} less than one device in "
             + ("no category" if not cut else f"all {len(cut)} categories" if len(cut) == len(categories)
                else f"{len(cut)} of {len(categories)} categories ({', '.join(cut)})")
             for cut, runs in groups.items()]
    return "; ".join(parts) + ". Bytes per rank by category, mean over ranks, beside the single device."


def cp_activations(ratios: pd.DataFrame) -> str:
    """cp_activation_ratio.csv: each context-parallel run's activation bytes per rank over its reference's, beside
    the cost model's ratio (where the table has it) and the naive 1/c."""
    def predicted(r) -> str:
        value = getattr(r, "predicted_ratio", None)
        return "" if value is None or pd.isna(value) else f"predicted {value:.2f}, "

    parts = [f"{r.strategy} at {r.seq_len:.0f} tokens holds {r.activation_ratio:.2f}× the reference's activations per "
             f"rank ({predicted(r)}1/c = {r.expected_ratio:.2f})" for r in ratios.itertuples()]
    return ("; ".join(parts) or "No context-parallel run finished") + "."


def comm_share(shares: pd.DataFrame) -> str:
    """comm_share.csv rows of multi-process runs: the share of the median step spent communicating."""
    if shares.empty:
        return "No multi-process run to compare."
    ranked = shares.sort_values("comm_share", ascending=False)
    top, low = ranked.iloc[0], ranked.iloc[-1]
    return (f"Communication takes from {low['comm_share']:.0%} ({low['strategy']}) to {top['comm_share']:.0%} "
            f"({top['strategy']}) of a step here. Bars: the median over a strategy's runs (line: their range), measured "
            "where a strategy times its waits, else predicted; ticks: the α-β prediction.")


def mechanisms(held: pd.DataFrame, split_below: float = 0.95) -> str:
    """mechanisms.csv: per family (its `strategy`), rank and category, the share of the single-device amount
    a rank holds. A family splits a category where every rank holds less than `split_below` of it."""
    named = held.assign(family=held["family"] + " (" + held["strategy"] + ")")
    categories = list(dict.fromkeys(named["category"]))
    most = named.groupby(["family", "category"], sort=False)["share"].max()
    splits = {family: tuple(c for c in categories if most.get((family, c), 1.0) < split_below)
              for family in dict.fromkeys(named["family"])}
    groups: dict[tuple, list[str]] = {}
    for family, split in splits.items():
        groups.setdefault(split, []).append(family)

    def what(split: tuple) -> str:
        return ("nothing" if not split else f"all {len(split)} categories" if len(split) == len(categories)
                else "only the " + listed(list(split)))

    parts = [f"{listed(families)} split{'s' * (len(families) == 1)} {what(split)}"
             for split, families in sorted(groups.items(), key=lambda g: -len(g[0]))]
    text = "; ".join(parts)
    return (text[0].upper() + text[1:] + ". Each cell: the share of the single-device amount one rank holds, from the "
            "cost model on the run's layout (each family's most sharded run in this study).")


def zero_tradeoff(rungs: pd.DataFrame) -> str:
    """zero_memory.csv rows of finished rungs on rank 0 (experiments with two or more): per experiment, the
    rung holding least on the device against the fastest one."""
    parts = []
    for experiment, rows in rungs.groupby("experiment", sort=False):
        least, fastest = rows.loc[rows["measured_device_bytes"].idxmin()], rows.loc[rows["tokens_per_s"].idxmax()]
        saved = 1 - least["measured_device_bytes"] / fastest["measured_device_bytes"]
        parts.append(f"{least['strategy']} is the fastest rung and holds least on the device ({experiment})"
                     if least["strategy"] == fastest["strategy"] else
                     f"{least['strategy']} holds {least['measured_device_bytes'] / 2**20:.2g} MiB of model states on "
                     f"the device, {saved:.0%} less than the fastest rung, {fastest['strategy']}, at "
                     f"{least['tokens_per_s'] / fastest['tokens_per_s']:.2f}× its throughput ({experiment})")
    return "; ".join(parts) + ". One point per rung: model states on the device per rank against tokens per second."


def planner_runs(runs: pd.DataFrame) -> str:
    """run_predictions.csv: the planner's error per quantity on this study's runs (calibration runs left out
    of the step time)."""
    checked = runs[~truthy(runs["is_calibration_run"])]
    errors = {"model states": runs["model_states_error_pct"], "activations": runs["activations_error_pct"],
              "step time": checked["step_time_error_pct"]}
    median = {name: e.abs().median() for name, e in errors.items() if e.notna().any()}
    if not median:
        return "No run has a prediction to compare."
    best, worst = min(median, key=median.get), max(median, key=median.get)
    return (f"The planner predicts {best} best (median error {median[best]:.2g} %) and {worst} worst "
            f"({median[worst]:.2g} %). Predicted against measured per run, log scales; the diagonal is a perfect "
            "prediction.")


def composed_memory(worst: pd.DataFrame) -> str:
    """composed_worst.csv: per quantity, the worst error over every rank of every composed run and its goal."""
    if worst.empty:
        return "No composed rank to compare."
    met = truthy(worst["meets_goal"])
    parts = [f"{r.quantity} {r.worst_abs_error_pct:.2g} % (goal {r.goal_pct:g} %)" for r in worst.itertuples()]
    lead = ("The cost model predicts every rank of every composed run within its goals"
            if met.all() else "The cost model misses its goal for " + listed(list(worst.loc[~met, "quantity"])))
    return f"{lead}: worst errors {', '.join(parts)}. Each point is one rank's bytes of one category."


def planner_published(by_source: pd.DataFrame, rows: pd.DataFrame) -> str:
    """planning_published_by_source.csv and planning_published.csv: the planner's held-out error per source,
    which sources meet the goals (mean <= 10 %, worst <= 20 % where three or more rows are held out), the
    configurations predicted not to fit, and the rows that chose a model change."""
    judged = by_source[by_source["held_out_rows"] >= 3]
    parts = [f"{r.source} {r.held_out_mean_abs_pct:.1f} % mean, {r.held_out_worst_abs_pct:.0f} % worst, "
             f"{r.held_out_bias_pct:+.1f} % bias over {r.held_out_rows:.0f} rows" for r in judged.itertuples()]
    met = (judged["held_out_mean_abs_pct"] <= 10) & (judged["held_out_worst_abs_pct"] <= 20)
    lead = ("On every source with three or more held-out rows the planner is within 10 % mean and 20 % worst"
            if met.all() else "The planner misses its held-out goal on " + listed(list(judged.loc[~met, "source"])))
    failed = rows[~truthy(rows["fits"])]
    fit = ("no configuration that ran is predicted not to fit" if failed.empty else
           f"{len(failed)} configurations that ran are predicted not to fit ({listed(list(failed['row']))})")
    informed = rows[rows["split"] == "informed"]
    told = (f"; {len(informed)} rows ({listed(sorted(set(informed['source'])))}) are in-sample: their errors chose "
            "a model change" if len(informed) else "")
    return f"{lead} ({'; '.join(parts)}); {fit}{told}."


def guide_plans(plans: pd.DataFrame) -> str:
    """guide_plans.csv: the planner's best plan per scenario, beside the published run named for it."""
    beside = plans.dropna(subset=["planner_error_on_published_pct"]) if "planner_error_on_published_pct" in plans \
        else plans.iloc[:0]
    flagged = plans[plans["above_published_mfu"].fillna("").astype(str).str.len() > 0]
    text = (f"The planner's best plan for {len(plans)} models and clusters at scale. Notation: degrees of `dp`, `tp` "
            "(`+sp`: with sequence parallelism; `+ov`: its communication overlapped), `pp` (its schedule; `v`: chunks "
            "a stage), `cp` and `ep`; `zK`: ZeRO stage K; `mb`: micro-batch; `rc`: recomputation. ± is the stack's "
            "worst error on published runs the planner was not fitted to.")
    if len(beside):
        text += " Beside it, the run published for that model: " + "; ".join(
            f"{r.published_scale} ran {r.published_plan} at {r.published_mfu_pct:.0f} % MFU, and the planner's "
            f"prediction for that run is off by {r.planner_error_on_published_pct:+.0f} %" for r in beside.itertuples()) + "."
    if len(flagged):
        text += (f" {len(flagged)} prediction(s) exceed the best MFU ever published for that stack and GPU "
                 "generation: read them as upper bounds.")
    return text


def device_note(environments: pd.DataFrame, runs: pd.DataFrame) -> str:
    """'Timed on CPU: 2 cores (AMD EPYC), gloo; runs of 4 and 8 ranks time-share the cores.' from the tables."""
    if environments.empty:
        return ""
    env = environments.iloc[0]
    if env.get("device_type") == "cuda":
        return f"Timed on {env.get('device_name', 'GPUs')}."
    cores = int(env["cpu_cores"])
    crowded = sorted({int(w) for w in runs.get("world_size", []) if w > cores})
    return (f"Timed on CPU: {cores} cores ({env.get('cpu_model', 'unknown model')}), gloo"
            + (f"; runs of {' and '.join(map(str, crowded))} ranks time-share the {cores} cores" if crowded else "")
            + ".")


def gpu_measured(gpu: pd.DataFrame) -> str:
    """gpu_measured.csv: the newest GPU check kept in the repository, or none."""
    if gpu.empty:
        return ("No run of this study on a GPU is recorded yet: every GPU figure in this report is a datasheet "
                "figure or a published one.")
    env = gpu.iloc[0]
    ok = gpu[gpu["status"] == "ok"]
    compared = ok.dropna(subset=["max_loss_deviation"])
    parts = [f"{len(ok)} of {len(gpu)} runs finished"]
    if len(compared):
        parts.append(f"{int(truthy(compared['within_tolerance']).sum())} of {len(compared)} parallel runs reproduce "
                     f"the single-device losses within the parity rule in {env['dtype']}")
    single = ok[truthy(ok["calibration_run"])]  # the single-device run the planner is calibrated on
    if len(single) and pd.notna(single["mfu"].iloc[0]):
        parts.append(f"single device ran {single['tokens_per_s'].iloc[0]:,.0f} tokens/s, "
                     f"{single['mfu'].iloc[0]:.0%} MFU")
    states = ok[["param_error", "grad_error", "optimizer_error"]].abs().max().max()
    if pd.notna(states):
        parts.append(f"the memory model is within {100 * states:.2g} % on model states and "
                     f"{100 * ok['activation_error'].abs().max():.2g} % on activations at worst")
    device = ok["planner_device_bytes_error"].dropna().abs()
    if len(device):
        parts.append(f"the planner puts the fullest rank's device memory within {100 * device.max():.0f} % of the "
                     "allocator's peak")
    before = ok["planner_before_error"].dropna().abs()
    if len(before):
        held = ok[~truthy(ok["calibration_run"])]["planner_after_error"].dropna().abs()
        parts.append(f"the planner's step time, before any calibration on this GPU, is off by {100 * before.mean():.0f} % "
                     f"on average (worst {100 * before.max():.0f} %)"
                     + (f"; calibrated on the single-device run (one factor, {ok['calibrated_speed'].iloc[0]:.2f} × "
                        f"the catalogue's compute and memory rates), by {100 * held.mean():.0f} % on the {len(held)} "
                        f"run{'s' * (len(held) > 1)} held out" if len(held) else ""))
    return (f"On {env['device_name']}, {env['date']} (torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}): "
            + "; ".join(parts) + ".")
