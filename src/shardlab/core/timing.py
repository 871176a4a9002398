"""Which steps of a run are timed: the one rule behind every step-time median, interval and ratio."""

from __future__ import annotations

import numpy as np

BOOTSTRAP_SAMPLES = 2000


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
    rng = np.random.default_rng(seed)
    fast_medians = np.median(rng.choice(fast, (BOOTSTRAP_SAMPLES, fast.size)), axis=1)
    slow_medians = np.median(rng.choice(slow, (BOOTSTRAP_SAMPLES, slow.size)), axis=1)
    low, high = np.percentile(slow_medians / fast_medians, [2.5, 97.5])
    return float(np.median(slow) / np.median(fast)), float(low), float(high)
