"""Which steps of a run are timed: the one rule behind every step-time median, interval and ratio."""

from __future__ import annotations


def timed_steps(records: list[dict], warmup_steps: int) -> list[dict]:
    """The steps past warm-up, except those flagged `untimed` (the first step after a resume, which
    reloads and probes); every step past warm-up if that leaves none."""
    past_warmup = [r for r in records if r["step"] >= warmup_steps]
    return [r for r in past_warmup if not r.get("untimed")] or past_warmup
