"""The pipeline bubble in theory: how much of a step a pipeline stage waits.

With p stages per pipeline, v virtual stages per rank (interleaved schedules loop the model v
times over the ranks) and m micro-batches, balanced stages and free communication, every rank
computes v*m chunk-steps and waits p-1 of them while the pipeline fills and drains:

    bubble / compute = (p-1) / (v*m)          idle share of a step = (p-1) / (v*m + p-1)

GPipe and 1F1B have the same bubble (v = 1); 1F1B only holds fewer micro-batches' activations.
Measurements sit above these values when stages are unbalanced or sends cost time.

`TOLERANCE` is how far the bottleneck stage's measured idle share may sit from the theory and still
count as following it: the time a stage spends per micro-batch in point-to-point sends and the
schedule's Python (about 1 ms on gloo here) against 10-20 ms of compute per micro-batch and stage in
the default study at m <= 4, i.e. about 0.1 of a step. With more micro-batches of less work each
(m = 8 there), the overhead share doubles and the theory no longer describes the measurement.
"""

from __future__ import annotations

TOLERANCE = 0.10  # absolute, on the idle share of a step


def theory_bubble_ratio(p: int, m: int, v: int = 1) -> float:
    """Idle time over compute time per stage: (p-1)/(v*m)."""
    return (p - 1) / (v * m)


def theory_idle_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of a step's span per stage: (p-1)/(v*m + p-1)."""
    return (p - 1) / (v * m + p - 1)
