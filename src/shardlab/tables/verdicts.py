"""The study's claims (the seed paper's, listed in `SPEED_CLAIMS` and the rows below) each with this
study's verdict, computed from the other tables so that it changes when the data do.

- verdicts: one row per claim and experiment: the measure, its ratio with an interval where it is a
  timing, and a verdict: "supported", "contradicted" or "not decidable" (with the reason).
- run_to_run_noise: the measured run-to-run noise the intervals include: per strategy pair, the
  ratio's range over repeated whole runs and the standard deviation of its log, with where and when.
- strategy_choice: per experiment, which finished strategy that reproduces its reference to do what:
  the fastest (and whether it beats the runner-up beyond noise) and the least memory per rank.

Throughput ratios come, where the experiment times its strategies side by side (`paired_timing`, rule
paired_timing: rounds of blocks in rotated order in one launch, so that background load hits both),
from those rounds: the geometric mean of the per-round ratios with the 95 % t interval of their mean,
and the run-to-run noise is their spread, measured in this DAG. Elsewhere a ratio of two separate runs
carries the wider of the bootstrap interval over the timed steps of both runs (`core.step_stats`:
step-to-step noise within the two runs) and the run-to-run noise measured by repeating whole runs on
this machine (`timing_noise`, written by scripts/timing-noise.py). A ratio decides a claim only when
its whole interval lies on one side of 1. Memory comparisons use measured bytes, which are
deterministic: they decide by comparison alone.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

from shardlab.core.step_stats import paired_ratio, run_to_run_sigma, throughput_ratio, with_run_noise
from shardlab.strategies import NOISE_RUNS
from shardlab.strategies.roles import hand_written_data_parallel, the_reference, tp_pair, zero_ladder
from shardlab.tables import TableInputs
from shardlab.tables.runs import compute_units, timed_on, unequal_compute

TOPIC = "verdicts"
COLUMNS = ["claim", "statement", "experiment", "measure", "ratio", "ratio_low", "ratio_high", "verdict", "evidence",
           "basis"]
# What a verdict rests on: bytes held (carry over to any device), throughput timed side by side in rounds of one
# launch, or throughput of separate runs widened by the run-to-run noise (weakest: background load hits one side).
BYTES, PAIRED_ROUNDS, SEPARATE_RUNS = "bytes held", "paired rounds", "separate runs"
NOISE_COLUMNS = ["experiment", "strategy", "versus", "repeats", "ratio_min", "ratio_max", "sigma", "pooled_sigma",
                 "pooled_factor", "cpu_model", "cpu_cores", "date"]
CHOICE_COLUMNS = ["experiment", "goal", "choice", "versus", "ratio", "ratio_low", "ratio_high", "decided", "evidence"]
SUPPORTED, CONTRADICTED, UNDECIDED = "supported", "contradicted", "not decidable"
STATE_CATEGORIES = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")
PAIRED = "paired_timing_"  # the paired-timing tables, one per experiment that times side by side



LADDER = zero_ladder()
NAIVE, PRODUCTION = hand_written_data_parallel(bucketed=False)
INTERLEAVED, _ = hand_written_data_parallel(bucketed=True)
TP, TP_SP = tp_pair()
# (claim, statement, faster strategy, slower strategy): "faster beats slower in tokens/s".
SPEED_CLAIMS = [
    ("1a", "Interleaved data parallelism beats naive data parallelism in throughput", INTERLEAVED, NAIVE),
    ("1b", "PyTorch DDP beats naive data parallelism in throughput", PRODUCTION, NAIVE),
    # The paper's reason (ZeRO-3's extra communication) is not what a throughput ratio measures: the
    # claim is worded as the ratio can decide it.
    ("2b", "The least sharded ZeRO rung is faster than the most sharded", LADDER[0], LADDER[-1]),
]


def decide_ratio(low: float, high: float) -> str:
    """Above 1 over the whole interval: supported; below 1 over all of it: contradicted."""
    return SUPPORTED if low > 1 else CONTRADICTED if high < 1 else UNDECIDED


def _row(claim, statement, experiment, measure, value, verdict, evidence, low=None, high=None, basis=BYTES) -> dict:
    return dict(zip(COLUMNS, (claim, statement, experiment, measure, value, low, high, verdict, evidence, basis)))


def noisy_ratio(fast_times, slow_times, sigma: float) -> tuple[float, float, float, str]:
    """A tokens/s ratio, its interval with the run-to-run noise, and how the interval was made."""
    ratio, low, high = throughput_ratio(fast_times, slow_times)
    wide_low, wide_high = with_run_noise(ratio, low, high, sigma)
    how = f"95 % interval {wide_low:.2f}-{wide_high:.2f}"
    if (wide_low, wide_high) != (low, high):
        how += f"; {low:.2f}-{high:.2f} within this run"
    return ratio, wide_low, wide_high, how


def paired_rounds(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Every finished round of every paired timing: experiment, round, strategy, tokens_per_s."""
    frames = [t for name, t in tables.items() if name.startswith(PAIRED) and "status" in t and len(t)]
    done = pd.concat(frames) if frames else pd.DataFrame(columns=["experiment", "round", "strategy", "tokens_per_s",
                                                                  "status"])
    return done[done["status"] == "ok"]


def round_ratios(rounds: pd.DataFrame, exp: str, fast: str, slow: str) -> np.ndarray:
    """tokens/s of `fast` over `slow` in each round of `exp` that timed both."""
    mine = rounds[rounds["experiment"] == exp]
    if mine.empty:
        return np.array([])
    mine = mine.pivot_table(index="round", columns="strategy", values="tokens_per_s")
    if fast not in mine or slow not in mine:
        return np.array([])
    return (mine[fast] / mine[slow]).dropna().to_numpy(float)


def speed_rows(steps: pd.DataFrame, sigma: float = 0.0, rounds: pd.DataFrame | None = None,
               runs: pd.DataFrame | None = None) -> list[dict]:
    rows = []
    times = _times(steps)
    rounds = rounds if rounds is not None else paired_rounds({})
    for claim, statement, fast, slow in SPEED_CLAIMS:
        experiments = sorted({e for e, s in times if s == fast} & {e for e, s in times if s == slow}
                             | {e for e in set(rounds["experiment"]) if len(round_ratios(rounds, e, fast, slow)) > 1})
        for exp in experiments:
            paired = round_ratios(rounds, exp, fast, slow)
            if len(paired) > 1:
                ratio, low, high = paired_ratio(paired)
                evidence = (f"{fast} / {slow} tokens/s = {ratio:.2f} (timed side by side in {len(paired)} rounds of "
                            f"this DAG, order rotated: 95 % interval {low:.2f}-{high:.2f}; per round "
                            f"{paired.min():.2f}-{paired.max():.2f})")
            else:
                ratio, low, high, how = noisy_ratio(times[exp, fast], times[exp, slow], sigma)
                evidence = (f"{fast} / {slow} tokens/s = {ratio:.2f} ({how}; "
                            f"{len(times[exp, fast])} and {len(times[exp, slow])} timed steps)")
            verdict = decide_ratio(low, high)
            if where := timed_on(runs, exp, (fast, slow)):
                evidence += f"; timed {where}"
            if verdict == UNDECIDED:  # say which way the point estimate goes, not only that it cannot decide
                evidence += f"; the point estimate goes {'with' if ratio > 1 else 'against'} the claim"
            rows.append(_row(claim, statement, exp, f"tokens/s {fast} / {slow}", ratio, verdict, evidence, low, high,
                             PAIRED_ROUNDS if len(paired) > 1 else SEPARATE_RUNS))
        if not experiments:
            rows.append(_row(claim, statement, None, f"tokens/s {fast} / {slow}", None, UNDECIDED,
                             f"no experiment ran both {fast} and {slow} to the end", basis=SEPARATE_RUNS))
    return rows


def growth_row(speed: list[dict], runs: pd.DataFrame) -> dict:
    """Claim 1c: the overlap benefit grows with model size, read across experiments of different sizes."""
    statement = "The overlap benefit of interleaved data parallelism grows with model size"
    measured = [r for r in speed if r["claim"] == "1a" and r["ratio"] is not None]
    if "model.parameters" not in runs:
        runs = runs.assign(**{"model.parameters": None})  # no run finished: no model size is known
    size = runs.drop_duplicates("experiment").set_index("experiment")["model.parameters"]
    sized = sorted(((size.get(r["experiment"]), r) for r in measured if pd.notna(size.get(r["experiment"]))),
                   key=lambda pair: pair[0])
    if len({s for s, _ in sized}) < 2:
        return _row("1c", statement, None, "ratio 1a vs model size", None, UNDECIDED,
                    "needs the 1a comparison on at least two model sizes (the multi-GPU pod study runs Pythia-160m and 1B)",
                    basis=SEPARATE_RUNS)
    (small, a), (large, b) = sized[0], sized[-1]
    verdict = SUPPORTED if b["ratio_low"] > a["ratio_high"] else CONTRADICTED if b["ratio_high"] < a["ratio_low"] else UNDECIDED
    evidence = (f"{a['ratio']:.2f} ({a['ratio_low']:.2f}-{a['ratio_high']:.2f}) at {small:,.0f} parameters, "
                f"{b['ratio']:.2f} ({b['ratio_low']:.2f}-{b['ratio_high']:.2f}) at {large:,.0f}")
    weakest = PAIRED_ROUNDS if a["basis"] == b["basis"] == PAIRED_ROUNDS else SEPARATE_RUNS
    return _row("1c", statement, f"{a['experiment']}, {b['experiment']}", "ratio 1a, largest / smallest model",
                b["ratio"] / a["ratio"], verdict, evidence, basis=weakest)


def zero_memory_rows(zero: pd.DataFrame | None) -> list[dict]:
    statement = "The most sharded ZeRO rung holds the least model-state memory per rank of the ladder"
    if zero is None or zero.empty:
        return [_row("2a", statement, None, "model-state bytes per rank", None, UNDECIDED, "no ZeRO experiment ran")]
    rows = []
    ok = zero[(zero["status"] == "ok") & zero["strategy"].isin(LADDER)]
    for exp, g in ok.groupby("experiment"):
        per_rung = g.groupby("strategy")["measured_model_state_bytes"].max()
        if LADDER[-1] not in per_rung or len(per_rung) < 2:
            continue
        others = per_rung.drop(LADDER[-1])
        least = per_rung[LADDER[-1]] < others.min()
        evidence = ", ".join(f"{s} {b / 2**20:.2f} MiB" for s, b in per_rung.items())
        tied = [" = ".join(g.index) for _, g in per_rung.groupby(per_rung) if len(g) > 1]
        evidence += "".join(f"; {names} hold the same" for names in tied)
        rows.append(_row("2a", statement, exp, f"model-state bytes per rank, {LADDER[-1]} / least of the others",
                         per_rung[LADDER[-1]] / others.min(), SUPPORTED if least else CONTRADICTED, evidence))
    return rows or [_row("2a", statement, None, "model-state bytes per rank", None, UNDECIDED,
                         f"no experiment finished {LADDER[-1]} and another plain rung")]


def tp_memory_rows(tp: pd.DataFrame | None) -> list[dict]:
    tp_all = "Tensor parallelism reduces all four: parameter, gradient, optimizer-state and activation memory"
    sp_less = "TP + sequence parallelism reduces activation memory further than TP alone"
    if tp is None or tp.empty:
        return [_row(c, s, None, "bytes per rank", None, UNDECIDED, "no tensor-parallel experiment ran")
                for c, s in (("3", tp_all), ("4", sp_less))]
    rows = []
    single = the_reference()
    for exp, g in tp.groupby("tp_experiment"):
        by = g.groupby("strategy")[list(STATE_CATEGORIES)].max()
        if {single, TP} <= set(by.index):
            held = by.loc[single] > 0  # e.g. SGD keeps no optimizer state: nothing there to reduce
            ratios = by.loc[TP, held] / by.loc[single, held]
            evidence = ", ".join(f"{c.removesuffix('_bytes')} {r:.2f}" for c, r in ratios.items())
            verdict = UNDECIDED if not held.all() else SUPPORTED if (ratios < 1).all() else CONTRADICTED
            if not held.all():
                evidence += f"; {single} holds no " + " or ".join(c.removesuffix("_bytes") for c in held.index[~held])
            rows.append(_row("3", tp_all, exp, f"{TP} / {single} bytes per rank, largest category", ratios.max(),
                             verdict, f"{TP} / {single}: {evidence}"))
        if {TP, TP_SP} <= set(by.index):
            ratio = by.loc[TP_SP, "activation_bytes"] / by.loc[TP, "activation_bytes"]
            rows.append(_row("4", sp_less, exp, f"activation bytes {TP_SP} / {TP}", ratio,
                             SUPPORTED if ratio < 1 else CONTRADICTED, f"{TP_SP} / {TP} activation bytes = {ratio:.2f}"))
    return rows


def _times(steps: pd.DataFrame) -> dict[tuple[str, str], np.ndarray]:
    """Timed step times of every finished run, by (experiment, strategy)."""
    if steps.empty:  # a study whose runs all failed has no step times
        return {}
    ok = steps[(steps["status"] == "ok") & steps["timed"].astype(bool)]
    return {key: g["step_time_s"].to_numpy() for key, g in ok.groupby(["experiment", "strategy"])}


def paired_noise(tables: dict[str, pd.DataFrame]) -> pd.DataFrame | None:
    """The paired timings as repeats of every pair of an experiment's strategies, one ratio per round (the
    timing-noise table's columns), or None where no experiment timed side by side."""
    rounds = paired_rounds(tables)
    if rounds.empty:
        return None
    rows = [{"experiment": exp, "strategy": a, "versus": b, "ratio": r, "cpu_model": "this DAG's machine",
             "cpu_cores": None, "date": "this DAG"}
            for exp in sorted(set(rounds["experiment"]))
            for a, b in itertools.combinations(sorted(set(rounds[rounds["experiment"] == exp]["strategy"])), 2)
            for r in round_ratios(rounds, exp, a, b)]
    return pd.DataFrame(rows)


def timing_noise(tables: dict[str, pd.DataFrame]) -> pd.DataFrame | None:
    """The run-to-run noise's repeats: the paired rounds of this DAG where there are any, else the committed
    measurement of this machine (`timing_noise`)."""
    paired = paired_noise(tables)
    return paired if paired is not None else tables.get("timing_noise")


def run_to_run_noise(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    noise = timing_noise(tables)
    if noise is None or noise.empty:
        return pd.DataFrame(columns=NOISE_COLUMNS)
    keys = ["experiment", "strategy", "versus", "cpu_model", "cpu_cores", "date"]
    rows = [{**dict(zip(keys, key)), "repeats": len(g), "ratio_min": g["ratio"].min(), "ratio_max": g["ratio"].max(),
             "sigma": run_to_run_sigma(g)} for key, g in noise.groupby(keys, dropna=False)]
    pooled = run_to_run_sigma(noise)
    # pooled_factor: a single run's ratio spans ratio / factor .. ratio * factor from run-to-run noise alone
    return pd.DataFrame(rows).assign(pooled_sigma=pooled, pooled_factor=np.exp(1.96 * pooled))[NOISE_COLUMNS]


def strategy_choice(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """For each experiment with two or more eligible runs (finished; parallel ones within the parity
    tolerance of their reference): the fastest, against the runner-up with its interval, and the one
    holding the least model state (parameters, gradients, optimizer) on its fullest rank."""
    times, parity, ranks = _times(tables["steps"]), tables.get("parity"), tables.get("ranks")
    units = compute_units(tables["runs"]) if "runs" in tables else {}
    wrong = set()
    if parity is not None and not parity.empty:  # outside the tolerance; an undecided check excludes nothing
        wrong = set(map(tuple, parity.loc[parity["within_tolerance"] == False, ["experiment", "strategy"]].values))  # noqa: E712
    rows = []
    for exp in sorted({e for e, _ in times}):
        eligible = {s: t for (e, s), t in times.items() if e == exp and (e, s) not in wrong and s not in NOISE_RUNS}
        if len(eligible) < 2:
            continue
        ranked = sorted(eligible, key=lambda s: np.median(eligible[s]))
        best, second = ranked[:2]
        ratio, low, high, how = noisy_ratio(eligible[best], eligible[second], run_to_run_sigma(timing_noise(tables)))
        clear = low > 1
        rows.append({"experiment": exp, "goal": "throughput", "choice": best, "versus": second, "ratio": ratio,
                     "ratio_low": low, "ratio_high": high, "decided": clear,
                     "evidence": f"{ratio:.2f}x {second}'s tokens/s ({how}"
                                 + (f"; {cores}" if (cores := unequal_compute(units, exp, best, second)) else "") + ")"
                                 + ("" if clear else ": tied within the noise")})
        if ranks is not None and not ranks.empty:
            held = ranks[(ranks["experiment"] == exp) & ranks["strategy"].isin(list(eligible))]
            states = held.assign(state=held[["param_bytes", "grad_bytes", "optimizer_bytes"]].sum(axis=1))
            fullest = states.groupby("strategy")["state"].max().sort_values()
            if len(fullest) >= 2:
                tied = [s for s, b in fullest.items() if b == fullest.iloc[0]]
                evidence = f"{fullest.iloc[0] / 2**20:.2f} MiB of model state on its fullest rank"
                evidence += (f", as {', '.join(tied[1:])}" if len(tied) > 1
                             else f"; next {fullest.index[1]} {fullest.iloc[1] / 2**20:.2f} MiB")
                rows.append({"experiment": exp, "goal": "memory per rank", "choice": fullest.index[0],
                             "versus": fullest.index[1], "ratio": fullest.iloc[0] / fullest.iloc[1],
                             "ratio_low": None, "ratio_high": None, "decided": len(tied) == 1, "evidence": evidence})
    return pd.DataFrame(rows, columns=CHOICE_COLUMNS)


def verdicts(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    speed = speed_rows(tables["steps"], run_to_run_sigma(timing_noise(tables)), paired_rounds(tables), tables["runs"])
    rows = [*speed, growth_row(speed, tables["runs"]), *zero_memory_rows(tables.get("zero_memory")),
            *tp_memory_rows(tables.get("tp_memory_categories"))]
    return pd.DataFrame(rows, columns=COLUMNS).sort_values("claim", kind="stable").reset_index(drop=True)


def build(inputs: TableInputs) -> dict[str, pd.DataFrame]:
    return {"verdicts": verdicts(inputs.tables), "strategy_choice": strategy_choice(inputs.tables),
            "run_to_run_noise": run_to_run_noise(inputs.tables)}
