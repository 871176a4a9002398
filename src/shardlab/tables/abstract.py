"""The report's abstract: one sentence per row, each computed from a table, so that the opening
paragraph changes when the data do. It says what carries over to other hardware: what ran on what
(`runs`), how many parallel runs reproduce their reference and how small an error that check catches
(`parity`, `parity_caught`), how well the cost model predicts each rank's memory
(`run_prediction_summary`), the planner's error on published runs it was not fitted to
(`planning_published`), what fine-tuning taught (`science_outcomes`); and throughput only where
strategies were timed side by side (`verdicts` rows whose basis is paired rounds).
"""

from __future__ import annotations

import pandas as pd

from shardlab.tables import TableInputs
from shardlab.tables.verdicts import CONTRADICTED, PAIRED_ROUNDS, SUPPORTED, UNDECIDED

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


def _parity_sentence(parity: pd.DataFrame | None, runs: pd.DataFrame, caught: pd.DataFrame | None) -> str:
    failed = runs[runs["status"] != "ok"] if "status" in runs else runs.iloc[:0]
    tail = (f" {len(failed)} run(s) did not finish ({', '.join(sorted(set(failed['strategy'])))}); each is a "
            f"recorded outcome with its reason." if len(failed) else " Every run finished.")
    if parity is None or parity.empty:
        return "No parallel run could be compared with a single-device reference." + tail
    judged = parity[parity["within_tolerance"].notna()]
    wrong = judged[judged["within_tolerance"] == False]  # noqa: E712
    text = (f"{len(judged) - len(wrong)} of {len(judged)} parallel runs reproduce their single-device reference's "
            f"losses within the parity rule" + (f"; {', '.join(wrong['strategy'])} do not" if len(wrong) else ""))
    sized = caught.dropna(subset=["smallest_gradient_error"]) if caught is not None and len(caught) else pd.DataFrame()
    if len(sized):
        text += (", a rule that caught " + " and ".join(
            f"{r.caught} of {r.injected} errors injected on purpose in {r.dtype}, the smallest moving the mean "
            f"gradient by {r.smallest_gradient_error:.2%}" for r in sized.itertuples()))
    return text + "." + tail


def _memory_sentence(summary: pd.DataFrame | None) -> str | None:
    """The cost model's error on each rank's bytes, per category, over every run it predicted."""
    if summary is None or summary.empty:
        return None
    rows = summary.set_index("quantity")
    parts = [f"{name} within {rows.loc[q, 'worst_abs_error_pct']:.2g} % (mean {rows.loc[q, 'mean_abs_error_pct']:.2g} %)"
             for q, name in (("model_states", "model states"), ("activations", "activations")) if q in rows.index]
    return (f"Memory per rank follows the cost model's accounting on all {int(rows['runs'].max())} runs it predicted: "
            + " and ".join(parts) + " on the worst rank; bytes held carry over to GPUs, as they do not depend on "
            "the device.")


def _speed_sentences(table: pd.DataFrame) -> list[str]:
    """The verdict counts; throughput only where strategies were timed side by side in rounds of one launch."""
    counts = table["verdict"].value_counts()
    first = (f"The reproduced study's {table['claim'].nunique()} claims, checked {len(table)} times here: "
             f"{counts.get(SUPPORTED, 0)} supported, {counts.get(CONTRADICTED, 0)} contradicted, "
             f"{counts.get(UNDECIDED, 0)} not decidable on this data.")
    paired = table[(table["basis"] == PAIRED_ROUNDS) & table["ratio"].notna()] if "basis" in table else table.iloc[:0]
    return [first, *(f"Timed side by side on CPU cores, \"{r['statement']}\" is {r['verdict']} (ratio {r['ratio']:.2f}, "
                     f"95 % interval {r['ratio_low']:.2f}-{r['ratio_high']:.2f})." for _, r in paired.iterrows())]


def _planner_sentence(published: pd.DataFrame | None) -> str | None:
    """The planner's error on the published runs it was not fitted to, and its false "does not fit"s."""
    if published is None or published.empty:
        return None
    held = published[published["split"] == "held_out"]
    if held.empty:
        return None
    errors = held["error_pct"].abs()
    refused = int((~published["fits"].astype(str).str.lower().eq("true")).sum())
    gpus = ", ".join(sorted(held["accelerator"].str.split("-").str[0].unique()))
    return (f"On {len(held)} published training runs the planner was not fitted to ({held['source'].nunique()} "
            f"sources, {held['stack'].nunique()} software stacks, {gpus}), it predicts throughput per GPU within "
            f"{errors.mean():.0f} % on average and {errors.max():.0f} % at worst, and says \"does not fit\" for "
            f"{refused} of the {len(published)} published runs, all of which ran.")


def _science_sentence(outcomes: pd.DataFrame | None) -> str | None:
    """What fine-tuning taught, per domain: the metrics that beat a trivial baseline in every run, and not."""
    if outcomes is None or outcomes.empty:
        return None
    judged = outcomes[outcomes["beats_baseline"].notna()]
    parts = []
    for domain, g in judged.groupby("domain", sort=False):
        won = g[g["beats_baseline"] == "every run"]["metric_title"].tolist()
        lost = g[g["beats_baseline"] != "every run"]["metric_title"].tolist()
        parts.append(f"{domain} beats a trivial baseline on " + (" and ".join(won) or "nothing")
                     + (f" but not on {' and '.join(lost)}" if lost else ""))
    return ("Fine-tuned from a small pretrained model, " + "; ".join(parts)
            + f" ({int(judged['beats_baseline'].eq('every run').sum())} of {len(judged)} metrics, in every run).")


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
    sentences = [_study_sentence(runs),
                 _parity_sentence(tables.get("parity"), runs, tables.get("parity_caught")),
                 _memory_sentence(tables.get("run_prediction_summary")),
                 _planner_sentence(tables.get("planning_published")),
                 _science_sentence(tables.get("science_outcomes")),
                 *_speed_sentences(tables["verdicts"]), _transfer_sentence(runs)]
    return pd.DataFrame({"sentence": [s for s in sentences if s]})


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    return {"abstract": abstract(inputs.tables)}
