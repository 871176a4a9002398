"""How far a parallel run may be from its single-device reference: one rule, from floating-point
arithmetic, for every strategy family, the tests and the report.

A correct parallel strategy computes the same sums as the single-device run, in another order: a
rank-local partial sum then an all-reduce (data parallel, ZeRO), a hidden dimension split over
shards (tensor parallel), blocks merged by log-sum-exp (ring attention), tokens regrouped by
expert. Another CPU's kernels or another thread count reorder sums too. In floating point these
orders round differently, so the runs agree only up to rounding, and the tolerance must come from
how large that rounding can be, not from what one machine happened to show.

The rule, for values of magnitude `scale` compared after `steps` training steps:

    tolerance = CONFIDENCE * steps * sqrt(n) * u * scale

* `u` is the unit roundoff of the arithmetic (2**-24 for float32).
* `n` is the length of the reductions whose order a strategy changes. The longest are over the
  tokens of the global batch (the mean loss, every weight gradient), so n = tokens per step.
  Two orders of an n-term sum differ by about sqrt(n) * u relative to the sum of the terms'
  magnitudes when roundings behave as independent zero-mean errors (Higham & Mary, "A new
  approach to probabilistic rounding error analysis", SISC 2019); the worst case, n * u, is
  far too pessimistic for sums of thousands of terms.
* `CONFIDENCE` (lambda = 4) makes that probabilistic bound hold with probability
  >= 1 - 2 exp(-lambda^2 / 2) ~ 0.9993, and absorbs cancellation: a gradient element is a sum
  whose terms are larger than the result, so its rounding is larger relative to |result|.
* `steps`: every step adds its own rounding and later steps carry the earlier ones forward, so
  the bound grows with the number of steps compared; linear growth (not exponential) assumes a
  few steps of training that does not diverge, which is what a parity test runs.

For the test setting (8 x 32 tokens, 6 SGD steps, losses near 6): 4 * 6 * 16 * 6e-8 * 6 =
1.4e-4. Every correct strategy stays below 1.5e-6 on both of torch's CPU kernel paths (default,
avx2), while a data-parallel run that forgets to average gradients is off by 1.3, ~10^4 times the
tolerance (scripts/parity-across-cpus.sh prints these figures).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from shardlab.strategies import REGISTRY

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8}
CONFIDENCE = 4.0


def tolerance(scale: float, reduction_length: int, steps: int = 1, dtype: str = "fp32") -> float:
    """Largest difference rounding alone explains for values of magnitude `scale`, see the module doc."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff known for dtype {dtype!r}; known: {sorted(UNIT_ROUNDOFF)}")
    return CONFIDENCE * max(steps, 1) * math.sqrt(max(reduction_length, 1)) * UNIT_ROUNDOFF[dtype] * abs(scale)


def loss_tolerance(reference: Sequence[float], tokens_per_step: int, dtype: str = "fp32") -> float:
    """Tolerance for per-step losses compared over all the reference's steps."""
    return tolerance(max(abs(x) for x in reference), tokens_per_step, steps=len(reference), dtype=dtype)


def max_deviation(values: Sequence[float], reference: Sequence[float]) -> float:
    if len(values) != len(reference):
        raise ValueError(f"{len(values)} values against {len(reference)} reference values")
    return max((abs(a - b) for a, b in zip(values, reference)), default=0.0)


PARITY_COLUMNS = ["experiment", "strategy", "topic", "family", "reference", "status", "dtype", "steps_compared",
                  "max_loss_deviation", "tolerance", "within_tolerance", "val_loss_deviation"]


def parity_rows(summaries: list[dict], experiments: dict[str, dict]) -> pd.DataFrame:
    """One row per run that has a reference (its registry `reference`, same experiment): the largest
    per-step loss deviation, the rounding tolerance for its dtype and size, and the verdict."""
    by_run = {(s["experiment"], s["strategy"]): s for s in summaries}
    rows = []
    for s in summaries:
        spec = REGISTRY[s["strategy"]]
        reference = by_run.get((s["experiment"], spec.reference))
        if spec.reference == s["strategy"] or reference is None:
            continue
        training = experiments[s["experiment"]]["training"] if s["experiment"] in experiments else {}
        row = {"experiment": s["experiment"], "strategy": s["strategy"], "topic": spec.topic, "family": spec.family,
               "reference": spec.reference, "status": s["status"], "dtype": training.get("dtype")}
        mine = {r["step"]: r["loss"] for r in s.get("step_log", [])}
        ref = {r["step"]: r["loss"] for r in reference.get("step_log", [])}
        common = sorted(set(mine) & set(ref))
        if s["status"] == "ok" and reference["status"] == "ok" and common and training:
            losses = [ref[k] for k in common]
            tol = loss_tolerance(losses, training["global_batch_size"] * training["seq_len"], training["dtype"])
            deviation = max_deviation([mine[k] for k in common], losses)
            val = (abs(s["final_val_loss"] - reference["final_val_loss"])
                   if s.get("final_val_loss") is not None and reference.get("final_val_loss") is not None else None)
            row.update(steps_compared=len(common), max_loss_deviation=deviation, tolerance=tol,
                       within_tolerance=deviation <= tol, val_loss_deviation=val)
        rows.append(row)
    return pd.DataFrame(rows, columns=PARITY_COLUMNS)
