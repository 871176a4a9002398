"""A checkpoint resumed under other plans (config `resharding`, run by `bench.resharding`): the block's check,
before anything runs, and its table, `resharding`: each resumed plan's own steps against the same steps of
the uninterrupted plan, and every curve against the experiment's single-device reference, by the parity rule
of `tables.parity`. Torch-free: the study checks the block when it loads the config."""

from __future__ import annotations

import pandas as pd

from shardlab.config import block_experiment
from shardlab.errors import ConfigError
from shardlab.strategies import REGISTRY
from shardlab.tables.parity import loss_tolerance, max_deviation, tokens_per_step, within


def check_resharding(config: dict, experiments: dict[str, dict]) -> None:
    """The `resharding` block: an experiment of the study, a checkpoint step inside its steps, plans that exist,
    train the same model (a mixture of experts is another model) and pass their own checks with the experiment's
    settings; raises ConfigError naming the field."""
    named = block_experiment(config, "resharding", experiments)
    if named is None:
        return
    block, exp = named
    if block["at_step"] >= exp["training"]["steps"]:
        raise ConfigError("resharding.at_step", f"{block['at_step']}: {block['experiment']!r} trains "
                                                f"{exp['training']['steps']} steps, so the resumed plans would train none")
    plans = {"plan": block["plan"], **{f"resume_under[{i}]": s for i, s in enumerate(block["resume_under"])}}
    for field, strategy in plans.items():
        if strategy not in REGISTRY:
            raise ConfigError(f"resharding.{field}", f"unknown strategy '{strategy}' (known: {', '.join(sorted(REGISTRY))})")
        if REGISTRY[strategy].model is not REGISTRY[block["plan"]].model:
            raise ConfigError(f"resharding.{field}", f"{strategy} trains another model than {block['plan']} (a mixture "
                                                     "of experts or not): it cannot hold its checkpoint")
        options = block["strategy_options"].get(strategy, {})
        REGISTRY[strategy].check({**exp, "strategies": [strategy], "strategy_options": {strategy: options}}, "resharding")
    for strategy in block["strategy_options"]:
        if strategy not in plans.values():
            raise ConfigError(f"resharding.strategy_options.{strategy}", "options for a plan this block does not run")


RESHARDING_COLUMNS = ["experiment", "role", "strategy", "world_size", "written_by", "written_on", "from_step", "status",
                      "reason", "steps_compared", "max_loss_deviation", "tolerance", "within_tolerance", "reference",
                      "reference_deviation", "reference_tolerance", "within_reference_tolerance"]


def resharding_rows(losses: pd.DataFrame, experiments: dict[str, dict], summaries: list[dict]) -> pd.DataFrame:
    """A checkpoint resumed under other plans (`bench.resharding`'s per-step losses): each resumed plan's own
    steps against the uninterrupted plan's same steps, and every run's whole curve against the experiment's
    single-device reference, each by the parity rule (an undecided tolerance leaves the verdict empty)."""
    rows = []
    for experiment, part in losses.groupby("experiment", sort=False):
        training = experiments[experiment]["training"]
        tokens, dtype = tokens_per_step(training), training["dtype"]
        whole = {strategy: curve.sort_values("step") for strategy, curve in part.groupby("strategy", sort=False)}
        plan = part.loc[part["role"] == "uninterrupted", "strategy"].iloc[0]
        uninterrupted = whole[plan]
        reference_name = REGISTRY[plan].reference
        reference = next((s for s in summaries if (s["experiment"], s["strategy"]) == (experiment, reference_name)
                          and s["status"] == "ok"), None)
        for strategy, curve in whole.items():
            first = curve.iloc[0]
            row = {key: first[key] for key in ("experiment", "role", "strategy", "world_size", "written_by", "written_on",
                                               "from_step", "status", "reason")}
            if first["status"] != "ok" or uninterrupted.iloc[0]["status"] != "ok":
                rows.append(row)
                continue
            if first["role"] == "resumed":
                start = int(first["from_step"])
                own, base = (c.loc[c["step"] >= start, "loss"].tolist() for c in (curve, uninterrupted))
                allowed = loss_tolerance(base, tokens, dtype)
                deviation = max_deviation(own, base)
                row.update(steps_compared=len(own), max_loss_deviation=deviation, tolerance=allowed.value,
                           within_tolerance=within(deviation, allowed))
            if reference is not None:
                ref = [r["loss"] for r in reference["step_log"]]
                allowed = loss_tolerance(ref, tokens, dtype)
                deviation = max_deviation(curve["loss"].tolist(), ref)
                row.update(reference=reference_name, reference_deviation=deviation, reference_tolerance=allowed.value,
                           within_reference_tolerance=within(deviation, allowed))
            rows.append(row)
    return pd.DataFrame(rows, columns=RESHARDING_COLUMNS)

