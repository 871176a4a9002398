"""What each technique keeps where: for every family that ran, the share of the single-device amount
of parameters, gradients, optimizer state and activations each rank holds, from the cost model on the
run's Plan (`rank_predictions`: the picture is the registry's and the cost model's, not drawn by hand), and the
registry's strategies in order (the report's colour of each strategy follows that order).
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from shardlab.strategies import NOISE_RUNS, REGISTRY
from shardlab.tables.rank_predictions import of_run

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations")
MECHANISM_COLUMNS = ["family", "strategy", "experiment", "world_size", "rank", "coordinates", "category", "share"]


def strategies(run: Iterable[str] = ()) -> pd.DataFrame:
    """The registry in its order, then the variants the study ran (composed plans named by their plan, in
    sorted order): the one list of strategies, with their families, that a chart's colours follow."""
    names = [*REGISTRY, *sorted(set(run) - set(REGISTRY))]
    return pd.DataFrame([{"order": i, "strategy": name, "title": REGISTRY[name].title,
                          "family": REGISTRY[name].family.value, "topic": REGISTRY[name].topic,
                          "summary": REGISTRY[name].summary} for i, name in enumerate(names)])


# The table's categories and the prediction columns they read (`tables.rank_predictions`).
HELD = dict(zip(CATEGORIES, ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")))


def run_mechanism(summary: dict, predictions: pd.DataFrame) -> list[dict]:
    """Per rank and category, the share of the single-device amount a finished run holds."""
    mine = of_run(predictions, summary["experiment"], summary["strategy"])
    if mine.empty:
        return []
    spec, alone = REGISTRY[summary["strategy"]], mine.iloc[0]
    key = {"family": spec.family.value, "strategy": spec.name, "experiment": summary["experiment"],
           "world_size": int(summary["world_size"])}
    # A category one device does not hold at all (no optimizer state under SGD) has no share to draw.
    return [dict(key, rank=int(r["rank"]), coordinates=r["coordinates"], category=c,
                 share=r[f"predicted_{held}"] / alone[f"one_device_{held}"])
            for r in mine.to_dict("records") for c, held in HELD.items() if alone[f"one_device_{held}"]]


def mechanisms(summaries: list[dict], predictions: pd.DataFrame) -> pd.DataFrame:
    """One run per family: the one that holds least per rank (most sharded), ties to the registry's order; a run
    of an experiment with every category held (not SGD's, without optimizer state) before one without."""
    order = {name: i for i, name in enumerate(REGISTRY)}  # composed runs (named by their plan) come last
    ok = sorted((s for s in summaries if s.get("status") == "ok" and s["strategy"] in REGISTRY
                 and s["strategy"] not in NOISE_RUNS), key=lambda s: order.get(s["strategy"], len(order)))
    best: dict[str, tuple[tuple, list[dict]]] = {}
    for summary in ok:
        rows = run_mechanism(summary, predictions)
        if not rows:
            continue
        held = max(sum(r["share"] for r in rows if r["rank"] == rank) for rank in {r["rank"] for r in rows})
        key = (-len({r["category"] for r in rows}), held)
        family = rows[0]["family"]
        if family not in best or key < best[family][0]:
            best[family] = (key, rows)
    return pd.DataFrame([row for _, rows in best.values() for row in rows], columns=MECHANISM_COLUMNS)
