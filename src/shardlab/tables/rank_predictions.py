"""The cost model's prediction for every rank of every run: the one place the tables ask `costs.predict`
about a run's memory, written once by the runs step as `rank_predictions` and read by every other table.

- rank_predictions: per run (any outcome) and rank, where the rank sits on the mesh and what it holds,
  and the predicted bytes of its parameters, gradients, optimizer state (their sum, and the part
  offloaded to the host) and of its activations at their peak (saved for backward); beside them, what one device would hold
  of the same model under the run's reference plan (`one_device_*`), the yardstick of a share.

`run_setting` is the one rebuild of a run's (model, plan, workload) from its summary and experiment, for
the tables that must ask the planner something the table does not hold (a step time on a calibrated
machine, a fit on a smaller device).
"""

from __future__ import annotations

import pandas as pd

from shardlab.costs.plan import Plan, Workload
from shardlab.costs.predict import rank_activations, rank_states
from shardlab.costs.shapes import ModelShape, stage_units
from shardlab.strategies import REGISTRY
from shardlab.tables import TableInputs

STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")
HELD = (*STATES, "activation_bytes")
AXES = ("tp", "cp", "dp", "pp")  # the mesh's axes, tensor innermost (`Plan.coordinates`)
COLUMNS = ["experiment", "strategy", "world_size", "rank", "plan", "framework", "offload",
           *(f"{axis}_rank" for axis in AXES), "coordinates", "holds",
           *(f"predicted_{key}" for key in STATES), "predicted_model_state_bytes", "predicted_host_bytes",
           "predicted_activation_bytes", *(f"one_device_{key}" for key in HELD)]


def run_setting(summary: dict, exp: dict, inputs: TableInputs) -> tuple[ModelShape, Plan, Workload]:
    """(model, plan, workload) of a run as the cost model sees it: the registry's model and Plan for the
    run's strategy in its experiment, on the ranks it ran with."""
    spec = REGISTRY[summary["strategy"]]
    return (spec.run_model(inputs.model_shape(exp), exp), spec.run_plan(exp, int(summary["world_size"])),
            Workload.from_training(exp["training"]))


def coordinates(plan: Plan, rank: int) -> str:
    """'dp0 pp1' (the degrees above 1; 'rank 0' on one process). Experts spread over the data-parallel
    ranks, so a rank's dp coordinate also says which experts it holds."""
    at = plan.coordinates(rank)
    named = [f"{axis}{at[axis]}" for axis in ("dp", "tp", "pp", "cp") if getattr(plan, axis) > 1]
    return " ".join(named) or f"rank {rank}"


def holdings(plan: Plan, coords: dict, layers: int) -> str:
    """What a rank holds, in words: its stages' units, its TP shard, its context chunks."""
    parts = []
    if plan.pp > 1:
        units = stage_units(layers, plan.pp * plan.virtual_stages)
        stages = [coords["pp"] + k * plan.pp for k in range(plan.virtual_stages)]
        parts += [f"stage {s}: {' '.join(map(str, units[s]))}" for s in stages]
    else:
        parts.append("all layers")
    if plan.tp > 1:
        parts.append(f"TP shard {coords['tp'] + 1}/{plan.tp}" + (" (+SP sequence shard)" if plan.sp else ""))
    if plan.cp > 1:
        parts.append(f"sequence chunks {coords['cp']} and {2 * plan.cp - 1 - coords['cp']} of {2 * plan.cp}")
    if plan.framework == "fsdp2":  # sharded over every rank holding the same parameters: dp x cp
        parts.append(f"FSDP2 shard {coords['dp'] * plan.cp + coords['cp'] + 1}/{plan.dp * plan.cp}")
    if plan.dp > 1:
        parts.append(f"batch rows {coords['dp'] + 1}/{plan.dp}")
    return "; ".join(parts)


def held_bytes(model: ModelShape, plan: Plan, workload: Workload, rank: int) -> dict[str, float]:
    """Predicted bytes of world rank `rank` by category (HELD), with the model-state sum and its host part."""
    states = rank_states(model, plan, rank)
    return {**{key: getattr(states, key) for key in STATES}, "model_state_bytes": states.total_bytes,
            "host_bytes": states.offloaded_bytes,
            # What the forward leaves saved, as the probe counts it: under full recompute the layer that backward
            # recomputes saves its tensors again for a moment (the planner's peak), which no probe sees.
            "activation_bytes": rank_activations(model, plan, workload, rank, working_set=False)}


def run_rows(summary: dict, exp: dict, inputs: TableInputs) -> list[dict]:
    """One row per rank of a run (see the module docstring)."""
    model, plan, workload = run_setting(summary, exp, inputs)
    reference = REGISTRY[REGISTRY[summary["strategy"]].reference]
    alone = held_bytes(model, reference.run_plan(exp, 1), workload, 0)
    run = {"experiment": summary["experiment"], "strategy": summary["strategy"], "world_size": plan.world,
           "plan": plan.label(), "framework": plan.framework, "offload": plan.offload,
           **{f"one_device_{key}": alone[key] for key in HELD}}
    rows = []
    for rank in range(plan.world):
        at = plan.coordinates(rank)
        held = held_bytes(model, plan, workload, rank)
        rows.append(dict(run, rank=rank, **{f"{axis}_rank": at[axis] for axis in AXES},
                         coordinates=coordinates(plan, rank), holds=holdings(plan, at, model.num_layers),
                         **{f"predicted_{key}": value for key, value in held.items()}))
    return rows


def rank_predictions(inputs: TableInputs) -> pd.DataFrame:
    """The table, for every run whose experiment, model shape and number of ranks are known."""
    rows = []
    for summary in inputs.summaries:
        exp = inputs.experiments.get(summary.get("experiment"))
        shape = inputs.model_shape(exp) if exp else None
        if shape is not None and summary.get("world_size") and summary.get("strategy") in REGISTRY:
            rows += run_rows(summary, exp, inputs)
    return pd.DataFrame(rows, columns=COLUMNS)


def given(inputs: TableInputs) -> pd.DataFrame:
    """The table as the rule passed it; empty where none was (a topic built outside the workflow)."""
    return inputs.tables.get("rank_predictions", pd.DataFrame(columns=COLUMNS))


def read(inputs: TableInputs) -> pd.DataFrame:
    """The table as the rule passed it (`--tables .../rank_predictions.csv`); built from the same runs where
    a caller gave none (a topic built outside the workflow, a test)."""
    given = inputs.tables.get("rank_predictions")
    return given if given is not None else rank_predictions(inputs)


def of_run(predictions: pd.DataFrame, experiment: str, strategy: str) -> pd.DataFrame:
    """A run's rows, by rank."""
    mine = predictions[(predictions["experiment"] == experiment) & (predictions["strategy"] == strategy)]
    return mine.set_index("rank", drop=False)
