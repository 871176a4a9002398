"""The pipeline bubble in theory: how much of a step a pipeline stage waits.

With p stages per pipeline, v virtual stages per rank (interleaved schedules loop the model v
times over the ranks) and m micro-batches, balanced stages and free communication, every rank
computes v*m chunk-steps and waits p-1 of them while the pipeline fills and drains:

    bubble / compute = (p-1) / (v*m)          idle share of a step = (p-1) / (v*m + p-1)

GPipe and 1F1B have the same bubble (v = 1); 1F1B only holds fewer micro-batches' activations.
Measurements sit above these values when stages are unbalanced or sends cost time.
"""

from __future__ import annotations


def theory_bubble_ratio(p: int, m: int, v: int = 1) -> float:
    """Idle time over compute time per stage: (p-1)/(v*m)."""
    return (p - 1) / (v * m)


def theory_idle_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of a step's span per stage: (p-1)/(v*m + p-1)."""
    return (p - 1) / (v * m + p - 1)
