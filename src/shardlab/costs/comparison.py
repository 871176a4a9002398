"""The planner against every published run (`costs.published`): each row predicted from its model,
plan, cluster and stack, with the error on throughput (tokens per second per GPU; error % =
100 x (predicted - published) / published, positive when the planner is optimistic), whether the
configuration that ran is predicted to fit, and summaries per source and per stack of the held-out
rows: mean and worst absolute error, the signed mean (bias), and the false "does not fit" count.

Korthikanti et al.'s memory values (Figure 1) are compared apart (`memory_results`).
"""

from __future__ import annotations

from functools import lru_cache
from statistics import mean

from shardlab.costs import predict, published, rank_memory, stacks
from shardlab.costs.hardware import by_name
from shardlab.costs.plan import Cluster, Plan, Workload, rejection
from shardlab.costs.published import Row
from shardlab.costs.search import Space, candidates, rank_key

GIB = 2**30


def _cluster(row: Row, overrides: dict | None) -> Cluster:
    return Cluster(row.cluster.accelerator, row.cluster.nodes, overrides=dict(overrides or {}))


def _space(row: Row) -> Space:
    c, f = row.choices, row.fields
    return Space(tp=(f["tp"],), pp=(f["pp"],), cp=(f["cp"],), dp=(row.cluster.gpus // (f["tp"] * f["pp"] * f["cp"]),),
                 schedule=tuple(c["schedule"]), virtual_stages=tuple(c["virtual_stages"]),
                 micro_batch=tuple(c["micro_batch"]), recompute=tuple(c["recompute"]),
                 shardings=tuple(map(tuple, c["shardings"])), sp=(True,))


@lru_cache(maxsize=16)
def _fitting(key: str) -> tuple[Plan, ...]:
    """The plans of a row with open choices that can run and fit (memory does not depend on the
    efficiencies a calibration varies, so it re-times these and nothing else)."""
    row = next(r for r in published.rows() if r.key == key)
    found = []
    for plan in candidates(row.model, row.cluster, row.workload, _space(row)):
        if rejection(row.model, plan, row.cluster, row.workload, row.stack) is None:
            p = predict.evaluate(row.model, plan, row.cluster, row.workload, row.stack, with_time=False)
            if p.fits:
                found.append(plan)
    return tuple(found)


def predict_row(row: Row, overrides: dict | None = None) -> predict.Prediction | None:
    """The prediction of a published row (its plan, or the best plan within its open choices; None when
    none of them fits); `overrides`: efficiencies to try (a calibration)."""
    cluster = _cluster(row, overrides)
    if row.plan is not None:
        result = predict.evaluate(row.model, row.plan, cluster, row.workload, row.stack)
        if isinstance(result, str):
            raise ValueError(f"{row.key}: the published configuration is rejected: {result}")
        return result
    figures = cluster.figures(row.stack)
    predictions = [predict.evaluate(row.model, p, cluster, row.workload, row.stack, figures=figures)
                   for p in _fitting(row.key)]
    return min(predictions, key=rank_key) if predictions else None


def row_result(row: Row, overrides: dict | None = None) -> dict:
    """One published row against its prediction."""
    p = predict_row(row, overrides)
    published_rate = row.tokens_per_s_per_gpu()
    predicted = p.tokens_per_s / row.cluster.gpus if p else float("nan")
    return {"source": row.source, "row": row.key, "model": row.model_name, "gpus": row.cluster.gpus,
            "accelerator": row.cluster.accelerator, "stack": row.stack, "split": row.split,
            "metric": row.metric, "published_value": row.published,
            "published": published_rate, "predicted": predicted,
            "error_pct": 100 * (predicted - published_rate) / published_rate,
            "published_mfu_pct": 100 * row.mfu(), "predicted_mfu_pct": 100 * p.mfu if p else float("nan"),
            "fits": bool(p and p.fits), "memory_gb": p.device_bytes / 1e9 if p else float("nan"),
            "plan": p.plan.label() if p else "no plan fits", "bottleneck": p.bottleneck if p else "",
            "flag": p.flag if p else ""}


def results(overrides_by_stack: dict | None = None, only: set | None = None) -> list[dict]:
    """Every published row (of the stacks `only`, if given) against its prediction; `overrides_by_stack`:
    {stack: efficiencies} to try, for its rows and those of the stacks that borrow from it."""
    overrides_by_stack = overrides_by_stack or {}
    return [row_result(r, overrides_by_stack.get(lender(r))) for r in published.rows()
            if only is None or r.stack in only]


def lender(row: Row) -> str:
    """The stack whose calibrated efficiencies the row's stack runs at (itself, or the one it borrows from)."""
    return stacks.efficiencies(row.stack, row.generation)[1] or row.stack


def summary(table: list[dict], by: str) -> list[dict]:
    """Per value of `by` ("source" or "stack"): held-out rows' count, mean and worst absolute error, signed
    mean (bias), the rows that informed a model change, calibration rows' mean, and the false "does not
    fit" count over all its rows."""
    out = []
    for key in dict.fromkeys(r[by] for r in table):
        mine = [r for r in table if r[by] == key]
        held = [r["error_pct"] for r in mine if r["split"] == "held_out" and r["fits"]]
        cal = [abs(r["error_pct"]) for r in mine if r["split"] == "calibration" and r["fits"]]
        informed = [abs(r["error_pct"]) for r in mine if r["split"] == "informed" and r["fits"]]
        out.append({by: key, "held_out_rows": sum(r["split"] == "held_out" for r in mine),
                    "informed_rows": len(informed),
                    "informed_mean_abs_pct": mean(informed) if informed else float("nan"),
                    "held_out_mean_abs_pct": mean(map(abs, held)) if held else float("nan"),
                    "held_out_worst_abs_pct": max(map(abs, held)) if held else float("nan"),
                    "held_out_bias_pct": mean(held) if held else float("nan"),
                    "calibration_rows": sum(r["split"] == "calibration" for r in mine),
                    "calibration_mean_abs_pct": mean(cal) if cal else float("nan"),
                    "false_does_not_fit": sum(not r["fits"] for r in mine)})
    return out


# --- Korthikanti et al.'s Figure 1 -----------------------------------------------------------------------
MODES = {"plain": dict(recompute="none", sp=False), "sp_selective": dict(recompute="selective", sp=True)}


def memory_results() -> list[dict]:
    """Korthikanti et al.'s memory per GPU of the first pipeline stage, predicted like for like: the
    transformer layers' parameters at the figure's 12h^2 per layer (18 bytes each), and the layers'
    activations."""
    out = []
    for m in published.memory_rows():
        shape, r, d = m["shape"], m["plan_row"], m["defaults"]
        plan = Plan(dp=r["gpus"] // (r["tp"] * r["pp"]), tp=r["tp"], pp=r["pp"], virtual_stages=r["vp"],
                    schedule="interleaved" if r["vp"] > 1 else "1f1b", micro_batch=r["micro_batch"], dtype=d["dtype"],
                    attention=d["attention"], framework=d["framework"], **MODES[m["mode"]])
        workload = Workload(r["global_batch"], d["seq_len"], d["dropout"])
        if m["quantity"] == "params_optimizer_gib":
            layers = rank_memory.rank_layers(shape.num_layers, plan.pp, plan.virtual_stages)[0]
            states = rank_memory.model_states(plan, layers * 12 * shape.hidden_size**2 / plan.tp, 0)
            predicted = (states.param_bytes + states.grad_bytes + states.optimizer_bytes) / GIB
        else:
            predicted = rank_memory.layer_activation_bytes(shape, plan, workload, 0) / GIB
        out.append({"model": m["model"], "quantity": m["quantity"], "mode": m["mode"], "published": m["published"],
                    "predicted": predicted, "error_pct": 100 * (predicted - m["published"]) / m["published"]})
    return out


@lru_cache(maxsize=1)
def _table() -> tuple[dict, ...]:
    return tuple(results())


def error_band(stack: str, generation: str) -> tuple[float, str]:
    """How far a prediction of `stack` on `generation` may be off, from the published rows: a calibrated
    stack's worst held-out error; a stack that borrows its efficiencies twice the worst held-out error of
    any calibrated stack of the generation (no row checks it); (nan, why) where nothing of the generation
    was published."""
    held = [r for r in _table() if r["split"] == "held_out" and r["fits"]
            and stacks.efficiencies(r["stack"], published_generation(r))[1] == r["stack"]
            and published_generation(r) == generation]
    own = [abs(r["error_pct"]) for r in held if r["stack"] == stack]
    if stacks.calibrated(stack, generation) and own:
        return max(own), f"worst held-out error of {stack} on {generation} ({len(own)} published rows)"
    if not held:
        return float("nan"), f"no published {generation} row is held out: the error is unknown"
    return 2 * max(abs(r["error_pct"]) for r in held), (
        f"{stack} is not calibrated on {generation}: twice the worst held-out error of the calibrated stacks")


def published_generation(result: dict) -> str:
    return by_name(result["accelerator"])["generation"]
