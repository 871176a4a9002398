"""How far a prediction is from its measurement: the one convention of every table and summary.

The error is signed and relative to the measurement: (predicted - measured) / measured. Positive when
the model predicts more than was measured (over-prediction), negative when less; undefined (NaN) when
nothing was measured, since no relative error exists then.
"""

from __future__ import annotations

import math


def relative_error(measured: float, predicted: float) -> float:
    """(predicted - measured) / measured, NaN when `measured` is zero."""
    return (predicted - measured) / measured if measured else math.nan


def error_pct(measured: float, predicted: float) -> float:
    """The relative error in percent."""
    return 100 * relative_error(measured, predicted)
