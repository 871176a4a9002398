"""The report's decision guide, from what carries over to other hardware: per technique what each rank
holds (measured bytes on this study's runs, as shares of one device's), what it communicates a step
(the collectives' payload), and the registry's facts on overlap, placement and need
(`strategies.spec.GUIDE`); and the planner's best plan for each scenario at scale beside the run
published for that model, with the stack's held-out error band and a flag where the prediction
exceeds the best published MFU.

Tables `guide_techniques` and `guide_plans`; the report's section "Choosing a parallelism" draws them.
"""

from __future__ import annotations

import pandas as pd

from shardlab.strategies import REGISTRY
from shardlab.strategies.spec import GUIDE
from shardlab.tables import TableInputs

TOPIC = "guide"
HELD = {"parameters": "param_bytes", "gradients": "grad_bytes", "optimizer": "optimizer_bytes",
        "activations": "activation_bytes"}
# Plan degrees (planning_top's plan_* columns) that put a technique in a plan.
USES = {"data parallel": lambda p: p["plan_dp"] > 1 and not p["plan_zero"],
        "zero": lambda p: p["plan_dp"] * p["plan_cp"] > 1 and p["plan_zero"] > 0,
        "tensor parallel": lambda p: p["plan_tp"] > 1, "pipeline parallel": lambda p: p["plan_pp"] > 1,
        "context parallel": lambda p: p["plan_cp"] > 1, "expert parallel": lambda p: p["plan_ep"] > 1}
MIB = 2**20


def measured_shares(ranks: pd.DataFrame, experiment: str, strategy: str) -> dict[str, float]:
    """Bytes the run's fullest rank holds per category over its reference's (same experiment), as measured."""
    mine = ranks[(ranks["experiment"] == experiment) & (ranks["strategy"] == strategy)]
    reference = ranks[(ranks["experiment"] == experiment) & (ranks["strategy"] == REGISTRY[strategy].reference)]
    if mine.empty or reference.empty:
        return {}
    return {name: mine[column].max() / reference[column].max() for name, column in HELD.items()
            if reference[column].max() > 0}


COLLECTIVES = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
               "sendrecv": "send/receive", "all_to_all": "all-to-all"}


def communicated(volume: pd.DataFrame, experiment: str, strategy: str, weights_bytes: float) -> tuple[str, float]:
    """What a run's collectives move a step per rank: the total payload, as a multiple of the weights' bytes, and
    the collectives that move it, largest first."""
    mine = volume[(volume["experiment"] == experiment) & (volume["strategy"] == strategy)]
    if mine.empty:
        return "nothing", 0.0
    payload = (mine["size_bytes"] * mine["count"]).groupby(mine["collective"]).sum().sort_values(ascending=False)
    total = float(payload.sum())
    scale = f", {total / weights_bytes:.2g}× the weights" if weights_bytes else ""
    kinds = " and ".join(COLLECTIVES.get(c, c) for c in payload.index)
    return f"{total / MIB:.2g} MiB a step{scale}, by {kinds}", total


def scale_label(scenario: pd.Series) -> str:
    """'405B on 16,384 H100' (a mixture of experts: '1T MoE ...') from a planning_scenarios row."""
    size = scenario["parameters_b"]
    moe = " MoE" if scenario["active_parameters_b"] < 0.9 * size else ""
    size_text = f"{size / 1000:.2g}T" if size >= 1000 else f"{size:.3g}B"
    return f"{size_text}{moe} on {int(scenario['gpus']):,} {str(scenario['hardware']).split('-')[0]}"


def used_at_scale(family: str, top: pd.DataFrame | None, scenarios: pd.DataFrame | None) -> str:
    """The scenarios whose best plan uses the technique, by scale."""
    if top is None or scenarios is None or top.empty or family not in USES:
        return ""
    best = top[top["rank"] == 1].set_index("scenario")
    labels = scenarios.set_index("scenario").apply(scale_label, axis=1)
    return ", ".join(labels[s] for s, plan in best.iterrows() if s in labels and USES[family](plan))


def techniques(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per technique that ran: its most sharded run (the one `mechanisms` draws) and what it holds,
    moves, overlaps, where it goes and when it is needed."""
    mechanisms, ranks, volume = tables["mechanisms"], tables["ranks"], tables["comm_volume"]
    runs = mechanisms.drop_duplicates(["family", "strategy", "experiment"]).set_index("family")
    rows = []
    for family, guide in GUIDE.items():
        if family.value not in runs.index:
            continue
        run = runs.loc[family.value]
        shares = measured_shares(ranks, run["experiment"], run["strategy"])
        reference = ranks[(ranks["experiment"] == run["experiment"])
                          & (ranks["strategy"] == REGISTRY[run["strategy"]].reference)]
        moves, total = communicated(volume, run["experiment"], run["strategy"],
                                    float(reference["param_bytes"].max()) if len(reference) else 0.0)
        rows.append({"family": family.value, "technique": guide.title, "strategy": run["strategy"],
                     "experiment": run["experiment"], "world_size": int(run["world_size"]),
                     **{f"{name}_share": share for name, share in shares.items()},
                     "holds": " · ".join(f"{share:.2f}" for share in shares.values()),
                     "communicates": moves, "bytes_per_step": total, "overlap": guide.overlap,
                     "placement": guide.placement, "needed_when": guide.needed_when,
                     "best_plan_at": used_at_scale(family.value, tables.get("planning_top"),
                                                   tables.get("planning_scenarios"))})
    return pd.DataFrame(rows)


def plans(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Each scenario's best plan beside the published run named for it (`planning.scenarios[].published`)."""
    scenarios = tables.get("planning_scenarios")
    if scenarios is None or scenarios.empty:
        return pd.DataFrame()
    published = tables.get("planning_published", pd.DataFrame())
    by_row = published.set_index("row") if "row" in published else pd.DataFrame()
    rows = []
    for _, s in scenarios.iterrows():
        row = {"scenario": s["scenario"], "scale": scale_label(s), "stack": s["stack"], "plan": s["best_plan"],
               "predicted_mfu_pct": 100 * s["mfu"] if pd.notna(s["mfu"]) else None,
               "error_band_pct": s["error_band_pct"], "error_band_basis": s["error_band_basis"],
               "above_published_mfu": s["implausible"] if isinstance(s["implausible"], str) else ""}
        key = s.get("published_row")
        if isinstance(key, str) and key in by_row.index:
            p = by_row.loc[key]
            row.update(published_row=key, published_scale=f"{p['model']} on {int(p['gpus']):,} {p['accelerator'].split('-')[0]}",
                       published_plan=p["plan"], published_mfu_pct=p["published_mfu_pct"],
                       planner_error_on_published_pct=p["error_pct"], published_split=p["split"])
        rows.append(row)
    return pd.DataFrame(rows)


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    return {"guide_techniques": techniques(inputs.tables), "guide_plans": plans(inputs.tables)}
