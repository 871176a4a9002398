"""What each technique keeps where: for every family that ran, the share of the single-device amount
of parameters, gradients, optimizer state and activations each rank holds, from the cost model on the
run's Plan (so the picture is the registry's and the cost model's, not drawn by hand), and the
registry's strategies in order (the report's colour of each strategy follows that order).
"""

from __future__ import annotations

import pandas as pd

from shardlab.costs.plan import Workload
from shardlab.costs.predict import rank_activations, rank_states
from shardlab.strategies import NOISE_RUNS, REGISTRY
from shardlab.tables import TableInputs

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations")
MECHANISM_COLUMNS = ["family", "strategy", "experiment", "world_size", "rank", "coordinates", "category", "share"]


def strategies() -> pd.DataFrame:
    """The registry in its order: the one list of strategies a chart's colours follow."""
    return pd.DataFrame([{"order": i, "strategy": name, "family": spec.family.value, "topic": spec.topic,
                          "summary": spec.summary} for i, (name, spec) in enumerate(REGISTRY.items())])


def _held(model, plan, workload: Workload, rank: int) -> dict[str, float]:
    states = rank_states(model, plan, rank)
    return dict(zip(CATEGORIES, (states.param_bytes, states.grad_bytes, states.optimizer_bytes,
                                 rank_activations(model, plan, workload, rank))))


def _coordinates(plan, rank: int) -> str:
    """'dp0 pp1' (the degrees above 1; 'rank 0' on one process). Experts spread over the data-parallel
    ranks, so a rank's dp coordinate also says which experts it holds."""
    at = plan.coordinates(rank)
    named = [f"{axis}{at[axis]}" for axis in ("dp", "tp", "pp", "cp") if getattr(plan, axis) > 1]
    return " ".join(named) or f"rank {rank}"


def run_mechanism(summary: dict, inputs: TableInputs) -> list[dict]:
    """Per rank and category, the share of the single-device amount a finished run holds."""
    exp = inputs.experiments.get(summary["experiment"])
    shape = inputs.model_shape(exp) if exp else None
    if shape is None:
        return []
    spec, world = REGISTRY[summary["strategy"]], int(summary["world_size"])
    plan, model, workload = spec.run_plan(exp, world), spec.run_model(shape, exp), Workload.from_training(exp["training"])
    whole = _held(model, REGISTRY["single"].run_plan(exp, 1), workload, 0)
    key = {"family": spec.family.value, "strategy": spec.name, "experiment": summary["experiment"], "world_size": world}
    # A category one device does not hold at all (no optimizer state under SGD) has no share to draw.
    return [dict(key, rank=r, coordinates=_coordinates(plan, r), category=c, share=held[c] / whole[c])
            for r in range(world) for held in [_held(model, plan, workload, r)] for c in CATEGORIES if whole[c]]


def mechanisms(inputs: TableInputs) -> pd.DataFrame:
    """One run per family: the one that holds least per rank (most sharded), ties to the registry's order; a run
    of an experiment with every category held (not SGD's, without optimizer state) before one without."""
    order = {name: i for i, name in enumerate(REGISTRY)}  # composed runs (named by their plan) come last
    ok = sorted((s for s in inputs.summaries if s.get("status") == "ok" and s["strategy"] in REGISTRY
                 and s["strategy"] not in NOISE_RUNS), key=lambda s: order.get(s["strategy"], len(order)))
    best: dict[str, tuple[tuple, list[dict]]] = {}
    for summary in ok:
        rows = run_mechanism(summary, inputs)
        if not rows:
            continue
        held = max(sum(r["share"] for r in rows if r["rank"] == rank) for rank in {r["rank"] for r in rows})
        key = (-len({r["category"] for r in rows}), held)
        family = rows[0]["family"]
        if family not in best or key < best[family][0]:
            best[family] = (key, rows)
    return pd.DataFrame([row for _, rows in best.values() for row in rows], columns=MECHANISM_COLUMNS)
