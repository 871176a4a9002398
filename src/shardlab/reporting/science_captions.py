"""Captions of the science section, computed from its tables (`science_outcomes`: one row per metric with its
verdicts over the runs, so that every count in the section is a count of the same rows)."""

from __future__ import annotations

import pandas as pd

from shardlab.reporting.captions import listed, truthy


def _metric_value(r, value: str = "value") -> str:
    return f"{getattr(r, value):.3g}"


def science_outcomes(outcomes: pd.DataFrame) -> str:
    """science_outcomes.csv: per domain, the metrics whose fine-tuned models beat the trivial baseline beyond noise
    in every run, and those that do not; then the count, computed from the same rows as every other count."""
    judged = outcomes[outcomes["beats_baseline"].notna()]
    if judged.empty:
        return "No metric could be compared with a trivial baseline."
    parts = []
    for domain, g in judged.groupby("domain", sort=False):
        won = [f"{r.metric_title} ({_metric_value(r)} against {_metric_value(r, 'baseline')})"
               for r in g.itertuples() if r.beats_baseline == "every run"]
        lost = [f"{r.metric_title} ({_metric_value(r)} against {_metric_value(r, 'baseline')}, {r.baseline_name})"
                for r in g.itertuples() if r.beats_baseline != "every run"]
        text = f"{domain} beats it on {listed(won)}" if won else f"{domain} beats it on nothing"
        parts.append(text + (f", but not on {listed(lost)}" if lost else ""))
    return (f"Against trivial baselines, in every run: {'; '.join(parts)}. In all, "
            f"{int(judged['beats_baseline'].eq('every run').sum())} of {len(judged)} metrics that have a baseline beat "
            "it beyond noise in every run.")


def science_gains(outcomes: pd.DataFrame) -> str:
    """Figure caption over science_outcomes: the count of metrics beating their baseline in every run."""
    judged = outcomes[outcomes["beats_baseline"].notna()]
    won = judged[judged["beats_baseline"] == "every run"]
    return (f"The fine-tuned models beat their baseline beyond noise on {len(won)} of {len(judged)} metrics in every run"
            + (f" ({listed(list(won['metric_title']))})" if len(won) else "")
            + "; a paired interval that crosses zero decides nothing.")


def science_fine_tuning(outcomes: pd.DataFrame) -> str:
    """Figure caption over science_outcomes: the metrics fine-tuning improved (or worsened) against the base model
    beyond noise in every run, on the same held-out rows."""
    compared = outcomes[outcomes["improved"].notna()]
    improved, worse = compared[compared["improved"] == "every run"], compared[compared["worse"] == "every run"]
    parts = [f"{r.metric_title} {r.before:.3g} → {r.value:.3g}" for r in improved.itertuples()]
    return (f"Fine-tuning improved {len(improved)} of {len(compared)} metrics beyond noise in every run"
            + (f" ({'; '.join(parts)})" if parts else "")
            + (f"; {len(worse)} got worse beyond noise" if len(worse) else "")
            + ". Before: the base model, pretrained on the sequences without their conditions; intervals are "
            "paired bootstraps over the same held-out rows.")


def science_weights(runs: pd.DataFrame, parity_rows: pd.DataFrame, finals: pd.DataFrame) -> str:
    """science_runs (with `weights`), the science experiments' parity rows and science_metrics' final rows:
    whether every strategy that fine-tuned passed parity, which saved the single device's weights byte for
    byte, and how far the others' domain metrics are from the single device's (against the intervals)."""
    if parity_rows.empty:
        return "No strategy besides the single device fine-tuned a case, so parity is not tested here."
    passed = truthy(parity_rows["within_tolerance"])
    head = (f"{int(passed.sum())} of {len(parity_rows)} parallel fine-tuning runs passed parity with their single "
            f"device (largest loss deviation {parity_rows['max_loss_deviation'].max():.2g}, at most "
            f"{100 * (parity_rows['max_loss_deviation'] / parity_rows['tolerance']).max():.2g} % of its tolerance)")
    if not passed.all():
        head += "; failed: " + listed([f"{r.experiment} {r.strategy}" for r in parity_rows[~passed].itertuples()])
    same, other = [], []
    ok = runs[runs["status"] == "ok"]
    is_reference = ok["strategy"] == ok["reference"]  # the run the others are checked against
    for experiment, g in ok.groupby("experiment", sort=False):
        single = g[g["strategy"] == g["reference"]]["weights"]
        for r in g[g["strategy"] != g["reference"]].itertuples():
            (same if len(single) and r.weights == single.iloc[0] else other).append((experiment, r.strategy))
    parts = [head]
    if same:
        parts.append("identical weights to the single device's (sha256): "
                     + listed([f"{e.removeprefix('science_')} {s}" for e, s in same]))
    if other:
        references = set(zip(ok["experiment"][is_reference], ok["strategy"][is_reference]))
        of_reference = [(e, s) in references for e, s in zip(finals["experiment"], finals["strategy"])]
        single = finals[of_reference][["experiment", "test_set", "metric", "value", "low", "high"]]
        pairs = finals.merge(single, on=["experiment", "test_set", "metric"], suffixes=("", "_single"))
        pairs = pairs[[(e, s) in other for e, s in zip(pairs["experiment"], pairs["strategy"])]]
        gap = (pairs["value"] - pairs["value_single"]).abs()
        half_width = (pairs["high_single"] - pairs["low_single"]) / 2
        parts.append(listed([f"{e.removeprefix('science_')} {s}" for e, s in other])
                     + " saved weights within rounding of the single device's, not identical; their domain metrics "
                     + ("equal the single device's" if not (gap > 0).any() else
                        f"differ from the single device's by at most {(gap / half_width).max():.0%} of an interval's "
                        "half-width"))
    return "; ".join(parts) + "."


def science_published(table: pd.DataFrame) -> str:
    """science_published rows: how many metrics have a published figure, and the farthest from the field and
    the nearest (how many times worse, in the metric's direction)."""
    found = table[table["published"].notna()]
    missing = table[table["published"].isna()]
    text = (f"{len(found)} of {len(table)} metrics beside a published figure from a real domain model"
            + (f"; none was found for {listed(list(missing['metric_title']))}" if len(missing) else ""))
    # How many times worse than the field (1: level with it; below 1: ahead of it), where a direction is known.
    judged = found[found["better"].isin(["higher", "lower"])]
    if len(judged):
        behind = judged["value"].where(judged["better"] == "lower", judged["published"]) / \
            judged["published"].where(judged["better"] == "lower", judged["value"])
        label = judged["domain"] + ", " + judged["metric_title"]
        far, near = behind.idxmax(), behind.idxmin()
        text += (f". Farthest from the field: {label[far]}, {judged['value'][far]:.3g} against {judged['published'][far]:.3g}"
                 f" ({behind[far]:.1f} times worse); nearest: {label[near]}, {judged['value'][near]:.3g} against "
                 f"{judged['published'][near]:.3g} ({behind[near]:.1f} times worse)")
    return text + ". The rows say how each setting differs (data, split, model size, features)."
