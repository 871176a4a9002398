"""How each stack's efficiencies are calibrated, on its own calibration rows only.

A stack lists, per hardware generation, the factors it fits (`stacks.yaml`, `fit`); published.yaml marks
its calibration rows (at most a quarter of a source). A fit is a coordinate descent over each factor's
grid (every factor in turn, its best value kept, until a round improves nothing), starting from the
generation's prior: no free-form parameters, nothing per point, and no held-out row in the loss. The
accuracy the report states is the held-out rows' error (`costs.comparison.summary`).

`python scripts/calibrate-planner.py` runs every fit and prints the values to write into stacks.yaml.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from statistics import mean

from shardlab.costs import comparison, published, stacks

# Each factor's grid spans what is physically plausible, no further: the best dense GEMMs reach about
# 0.8-0.9 of a datasheet peak; a causal attention kernel, counted on the whole score matrix, computes
# half of it, so up to twice its hardware share (about 0.6); element-wise kernels move a few bytes per
# stored byte; a stack's collectives reach at most NCCL's own bus bandwidth.
GRIDS = {
    "gemm": [round(0.40 + 0.02 * k, 2) for k in range(26)],
    "gemm_half_width": [0, 100, 200, 300, 400, 600, 800, 1000, 1500],
    "gemm_half_tokens": [0, 256, 512, 1024, 2048, 4096],
    "flash_attention": [round(0.15 + 0.05 * k, 2) for k in range(22)],
    "flash_attention_half_keys": [0, 256, 512, 1024, 2048, 4096],
    "elementwise_passes": [0.25, 0.5, 1, 1.5, 2, 3, 4],
    "collective_efficiency": [0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0],
}
MAX_ROUNDS = 8
RESTARTS = 12


def coordinate_descent(loss: Callable[[dict], float], grid: dict[str, list], start: dict) -> tuple[float, dict]:
    """The grid values that minimise `loss`, one factor at a time from `start`."""
    best, current = dict(start), loss(start)
    for _ in range(MAX_ROUNDS):
        improved = False
        for name, values in grid.items():
            for value in values:
                trial = {**best, name: value}
                trial_loss = loss(trial)
                if trial_loss < current - 1e-9:
                    best, current, improved = trial, trial_loss, True
        if not improved:
            break
    return current, best


def calibration_rows(stack: str, generation: str) -> list[published.Row]:
    return [r for r in published.rows() if r.stack == stack and r.generation == generation and r.split == "calibration"]


def stack_loss(stack: str, generation: str) -> Callable[[dict], float]:
    """Mean absolute throughput error (%) of the stack's calibration rows on `generation` under trial factors."""
    rows = calibration_rows(stack, generation)
    if not rows:
        raise ValueError(f"{stack} has no calibration rows on {generation} in published.yaml")
    return lambda factors: mean(abs(comparison.row_result(r, factors)["error_pct"]) for r in rows)


def starts(names: list[str], prior: dict, n: int = RESTARTS) -> list[dict]:
    """Where the descent starts: the prior, and `n` points drawn from the grids (a fixed seed, so a fit
    is reproducible). One start can stall where two factors trade off: a fast GEMM and a slow
    attention kernel fit some rows as well as the reverse."""
    draw = random.Random(0)
    return [{k: prior[k] for k in names}, *({k: draw.choice(GRIDS[k]) for k in names} for _ in range(n))]


def fit(stack: str, generation: str) -> tuple[float, dict]:
    """The stack's `fit` factors on `generation` that best predict its calibration rows: the best of a
    coordinate descent from each of `starts`."""
    names = stacks.get(stack).fit[generation]
    prior = stacks.catalog()["prior"][generation]
    base, _ = stacks.efficiencies(stack, generation)
    loss = stack_loss(stack, generation)
    grid = {n: GRIDS[n] for n in names}
    return min((coordinate_descent(lambda trial: loss({**base, **trial}), grid, start) for start in starts(names, prior)),
               key=lambda fitted: fitted[0])


def fitted_pairs() -> list[tuple[str, str]]:
    """(stack, generation) pairs that fit factors, in an order where a stack whose kernels come from
    another (`kernels_from`) follows it."""
    pairs = [(name, gen) for name, s in stacks.stacks().items() for gen in s.fit]
    return sorted(pairs, key=lambda p: stacks.get(p[0]).kernels_from is not None)
