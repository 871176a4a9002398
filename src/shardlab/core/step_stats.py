"""A run's step records (`metrics.jsonl`, as the worker writes them) and which of them are timed: the one
rule behind every step-time median, interval and ratio."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shardlab.core.bootstrap import bootstrap_interval

BOOTSTRAP_SAMPLES = 2000


def read_step_log(path: Path | str) -> list[dict]:
    """A run's per-step records from its `metrics.jsonl` (none when the file is missing: a run that failed
    before its first step)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def timed_steps(records: list[dict], warmup_steps: int) -> list[dict]:
    """The steps past warm-up, except those flagged `untimed` (the first step after a resume, which
    reloads and probes); every step past warm-up if that leaves none."""
    past_warmup = [r for r in records if r["step"] >= warmup_steps]
    return [r for r in past_warmup if not r.get("untimed")] or past_warmup


def timed_times(summary: dict, warmup_steps: int) -> list[float]:
    """Step times of a finished run's timed steps (its `step_log`); empty for a run without one."""
    if summary.get("status") != "ok":
        return []
    return [r["step_time_s"] for r in timed_steps(summary.get("step_log", []), warmup_steps)]


def throughput_ratio(fast_times, slow_times, seed: int = 0) -> tuple[float, float, float]:
    """tokens/s of the first run over the second's (same tokens per step: the inverse ratio of median
    step times), with a 95 % percentile bootstrap interval resampling each run's timed steps. The
    interval covers step-to-step noise within the two runs, not the drift between runs."""
    fast, slow = np.asarray(fast_times, float), np.asarray(slow_times, float)
    low, high = bootstrap_interval(lambda i, j: np.median(slow[j]) / np.median(fast[i]), (fast.size, slow.size),
                                   replicates=BOOTSTRAP_SAMPLES, seed=seed)
    return float(np.median(slow) / np.median(fast)), low, high


# Student's t, 97.5th percentile, by degrees of freedom (a 95 % interval of a mean over a few rounds).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def paired_ratio(ratios) -> tuple[float, float, float]:
    """A throughput ratio measured in rounds side by side (one ratio per round): its geometric mean and
    the 95 % t interval of the mean of the log ratios, so the interval is the rounds' own spread."""
    logs = np.log(np.asarray(ratios, float))
    mean = float(logs.mean())
    half = T_975.get(logs.size - 1, 1.96) * float(logs.std(ddof=1)) / np.sqrt(logs.size)
    return float(np.exp(mean)), float(np.exp(mean - half)), float(np.exp(mean + half))


def run_to_run_sigma(repeats) -> float:
    """The run-to-run noise of a throughput ratio: the standard deviation of log(ratio) over repeated
    runs of the same pair (a table with columns strategy, versus, ratio, one row per repeat; written by
    scripts/timing-noise.py), pooled over pairs. 0 without a table or without a pair run twice."""
    if repeats is None:
        return 0.0
    variances = [np.var(np.log(g["ratio"].to_numpy(float)), ddof=1)
                 for _, g in repeats.groupby(["strategy", "versus"]) if len(g) > 1]
    return float(np.sqrt(np.mean(variances))) if variances else 0.0


def with_run_noise(ratio: float, low: float, high: float, sigma: float) -> tuple[float, float]:
    """The interval a single run's ratio needs to speak for another run on the same machine: the wider
    of the within-run bootstrap interval and ratio * exp(±1.96 sigma) from the run-to-run noise."""
    spread = np.exp(1.96 * sigma)
    return min(low, ratio / spread), max(high, ratio * spread)
