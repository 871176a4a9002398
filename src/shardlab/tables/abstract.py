"""The report's abstract: one sentence per row, each computed from a table, so that the opening
paragraph changes when the data do: what ran on what (`runs`), how many parallel runs reproduce
their reference (`parity`), the verdict counts and the first decided claims (`verdicts`), where
one strategy is fastest beyond the run-to-run noise (`strategy_choice`), and what carries over to
GPUs.
"""

from __future__ import annotations

import pandas as pd

from shardlab.strategies import REGISTRY
from shardlab.tables import TableInputs
from shardlab.tables.verdicts import CONTRADICTED, SUPPORTED, UNDECIDED

TOPIC = "abstract"


def _count(n: float) -> str:
    """2.8e4 -> '28 thousand', 1.3e8 -> '130 million'."""
    for scale, word in ((1e9, "billion"), (1e6, "million"), (1e3, "thousand")):
        if n >= scale:
            return f"{float(f'{n / scale:.2g}'):g} {word}"
    return f"{n:.0f}"


def _span(values: list) -> str:
    """[2] -> '2', [1, 2] -> '1 or 2', [1, 2, 4, 8] -> '1 to 8'."""
    return (" or ".join(map(str, values)) if len(values) <= 2 else f"{values[0]} to {values[-1]}") or "unknown"


def _study_sentence(runs: pd.DataFrame) -> str:
    """What ran, on what: runs, strategies and families, model sizes, tokens per step, processes, machine."""
    sizes = sorted(runs["model.parameters"].dropna().unique()) if "model.parameters" in runs else []
    size = " to ".join(dict.fromkeys(map(_count, (sizes[0], sizes[-1])))) if sizes else "an unknown number of"
    tokens = sorted(runs["tokens_per_step"].dropna().astype(int).unique()) if "tokens_per_step" in runs else []
    worlds = sorted(runs["world_size"].dropna().astype(int).unique()) if "world_size" in runs else []
    known = runs.dropna(subset=["environment.device_type"]) if "environment.device_type" in runs else runs.iloc[:0]
    env = known.iloc[0] if len(known) else None
    where = ("" if env is None else f" on {env['environment.device_name']}" if env["environment.device_type"] == "cuda"
             else f" on {int(env['environment.cpu_cores'])} CPU cores ({env['environment.cpu_model']}, gloo)")
    return (f"{len(runs)} training runs of {runs['strategy'].nunique()} strategies from "
            f"{runs['family'].nunique()} families of parallelism, on GPT-NeoX models of {size} parameters, "
            f"{_span(tokens)} tokens per step, with "
            f"{_span(worlds)} processes{where}.")


def _parity_sentence(parity: pd.DataFrame | None, runs: pd.DataFrame) -> str:
    failed = runs[runs["status"] != "ok"] if "status" in runs else runs.iloc[:0]
    tail = (f" {len(failed)} run(s) did not finish ({', '.join(sorted(set(failed['strategy'])))}); each is a "
            f"recorded outcome with its reason." if len(failed) else " Every run finished.")
    if parity is None or parity.empty:
        return "No parallel run could be compared with a single-device reference." + tail
    judged = parity[parity["within_tolerance"].notna()]
    wrong = judged[judged["within_tolerance"] == False]  # noqa: E712
    return (f"{len(judged) - len(wrong)} of {len(judged)} parallel runs reproduce their single-device reference's "
            f"losses within the parity rule" + (f"; {', '.join(wrong['strategy'])} do not." if len(wrong) else ".")
            + tail)


def _verdict_sentences(table: pd.DataFrame) -> list[str]:
    counts = table["verdict"].value_counts()
    first = (f"The reproduced study's {table['claim'].nunique()} claims, checked {len(table)} times here: "
             f"{counts.get(SUPPORTED, 0)} supported, {counts.get(CONTRADICTED, 0)} contradicted, "
             f"{counts.get(UNDECIDED, 0)} not decidable on this data.")
    decided = table[(table["verdict"] != UNDECIDED) & table["ratio"].notna()]
    return [first, *(f"{r['statement']}: {r['verdict']} ({r['measure']} = {r['ratio']:.2f})."
                     for _, r in decided.head(2).iterrows())]


def _choice_sentence(choice: pd.DataFrame) -> str | None:
    """Where one strategy is fastest beyond noise: how often that is a single process, and the others."""
    fastest = choice[(choice["goal"] == "throughput") & choice["decided"].astype(bool)] if len(choice) else choice
    if choice.empty:
        return None
    if fastest.empty:
        return "In no experiment is one strategy faster than its runner-up beyond the run-to-run noise."
    alone = fastest["choice"].map(lambda s: REGISTRY[s].single_process if s in REGISTRY else False)
    parts = []
    if alone.any():
        ahead = fastest.loc[alone, "ratio"]
        parts.append(f"one process is fastest in {int(alone.sum())} of {choice['experiment'].nunique()} experiments "
                     f"({ahead.min():.2f}x to {ahead.max():.2f}x the runner-up's tokens/s)")
    others = fastest[~alone]
    parts += [f"{r['choice']} is fastest in {r['experiment']} ({r['ratio']:.2f}x {r['versus']})"
              for _, r in others.head(2).iterrows()]
    more = len(others) - 2
    parts += [f"in {more} more experiment{'s' if more > 1 else ''} a parallel strategy is fastest"] if more > 0 else []
    return "Beyond the run-to-run noise, " + "; ".join(parts) + "."


def _transfer_sentence(runs: pd.DataFrame) -> str:
    on_gpu = "environment.device_type" in runs and (runs["environment.device_type"] == "cuda").any()
    if on_gpu:
        return ("Memory per rank and the parity results carry over to other GPUs of this kind; throughput ratios "
                "depend on the interconnect and the model size.")
    return ("What carries over to GPUs: memory per rank (the same accounting of bytes) and parity; what does not: "
            "throughput and communication ratios, measured with gloo on shared CPU cores where ranks compete for "
            "the same memory bandwidth.")


def abstract(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The report's opening paragraph, one sentence per row, computed from the tables it summarises."""
    runs = tables.get("runs", pd.DataFrame())
    if runs.empty:
        return pd.DataFrame({"sentence": ["This study has no finished or failed run to summarise."]})
    sentences = [_study_sentence(runs), _parity_sentence(tables.get("parity"), runs),
                 *_verdict_sentences(tables["verdicts"]), _choice_sentence(tables["strategy_choice"]),
                 _transfer_sentence(runs)]
    return pd.DataFrame({"sentence": [s for s in sentences if s]})


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    return {"abstract": abstract(inputs.tables)}
