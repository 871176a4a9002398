"""Calibrate the planner's shared GPU efficiencies (costs/hardware.yaml `efficiencies`) on the
published iteration times (costs/published.yaml), all points at once, and report how well each
model is predicted when it is left out of the calibration.

    python scripts/calibrate-planner.py          # prints the best set, its errors, leave-one-model-out

A grid search, on purpose: five named, bounded physical factors, not a free-form fit.
"""

from __future__ import annotations

import itertools

import numpy as np

from shardlab.costs import published

GRID = {"gemm": [round(float(g), 2) for g in np.arange(0.70, 0.95, 0.02)], "gemm_half_width": [0, 100, 200, 300, 400, 600],
        "hbm": [0.6, 0.7, 0.8], "elementwise_passes": [0.5, 1, 2, 3], "link": [0.4, 0.5, 0.6, 0.7, 0.8]}


def time_errors(overrides: dict) -> dict[str, list[float]]:
    """Absolute % error of each iteration time, by model."""
    out: dict[str, list[float]] = {}
    for row in published.rows(overrides):
        if row["quantity"] == "iteration_time_s":
            out.setdefault(row["model"], []).append(abs(row["error_pct"]))
    return out


def best(candidates: list[dict], models: list[str]) -> tuple[float, dict]:
    scored = []
    for overrides in candidates:
        errors = time_errors(overrides)
        scored.append((float(np.mean([e for m in models for e in errors[m]])), overrides))
    return min(scored, key=lambda s: s[0])


def main() -> None:
    candidates = [dict(zip(GRID, values)) for values in itertools.product(*GRID.values())]
    models = [p["name"] for p in published.reference()["models"]]
    mean, chosen = best(candidates, models)
    errors = time_errors(chosen)
    print(f"all points: mean {mean:.2f} %, worst {max(max(e) for e in errors.values()):.2f} % with {chosen}")
    for held in models:
        _, fitted = best(candidates, [m for m in models if m != held])
        print(f"leave out {held}: its errors {', '.join(f'{e:.1f} %' for e in time_errors(fitted)[held])} with {fitted}")


if __name__ == "__main__":
    main()
