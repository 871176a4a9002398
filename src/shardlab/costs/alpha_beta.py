"""The alpha-beta (latency-bandwidth) cost model of a collective, fitted to benchmark timings.

    t(size) = alpha + bus_bytes(size) / beta,    bus_bytes = size * bus_factor(collective, n)

alpha is the fixed cost of one call (latency, launch, synchronisation); beta is the bus
bandwidth in bytes/s, so one fitted beta also predicts the collective at other rank counts
(ring algorithms; alpha is kept as measured, although a ring's latency grows with n).

The fit minimises RELATIVE residuals ((t_i - model_i) / t_i): ordinary least squares on raw
times would fit the largest messages only and leave alpha to noise, while timings span several
orders of magnitude and small messages are where alpha shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardlab.costs.collectives import bus_factor

FIT_COLUMNS = ["collective", "world_size", "backend", "device", "device_name", "bus_factor", "alpha_s", "beta_GBps", "r2",
               "rel_err_median", "rel_err_max", "n_points", "min_bytes", "max_bytes", "status"]


@dataclass(frozen=True)
class AlphaBeta:
    alpha_s: float
    beta_Bps: float  # bus bandwidth, bytes/s

    def seconds(self, bus_bytes: float) -> float:
        return self.alpha_s + bus_bytes / self.beta_Bps

    def seconds_for(self, collective: str, size_bytes: float, n_ranks: int) -> float:
        """Predicted time of one call on a message of `size_bytes` (nccl-tests convention) over `n_ranks`."""
        if n_ranks < 2:
            return 0.0
        return self.seconds(size_bytes * bus_factor(collective, n_ranks))


@dataclass(frozen=True)
class FitQuality:
    r2: float  # of the times themselves
    rel_err_median: float
    rel_err_max: float
    n_points: int


def fit_alpha_beta(bus_bytes, seconds) -> tuple[AlphaBeta, FitQuality]:
    """Least-squares fit of t = alpha + x / beta minimising relative residuals; alpha >= 0."""
    x, t = np.asarray(bus_bytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(x) < 2 or np.any(t <= 0):
        raise ValueError("need at least two positive timings")
    # Divide each equation alpha + x/beta = t by t: the residuals become relative errors.
    design = np.column_stack([1.0 / t, x / t])
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:  # latency below resolution: refit through the origin
        alpha, inv_beta = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if inv_beta <= 0:  # no size dependence measurable in this range
        inv_beta = 0.0
    model = AlphaBeta(float(alpha), math.inf if inv_beta == 0 else 1.0 / float(inv_beta))
    predicted = alpha + x * inv_beta
    rel = np.abs(predicted - t) / t
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum((t - predicted) ** 2)) / ss_tot if ss_tot > 0 else math.nan
    return model, FitQuality(r2, float(np.median(rel)), float(rel.max()), len(t))


def fit_table(bench) -> "pd.DataFrame":  # noqa: F821
    """One fit per (collective, world size, backend, device) of a comm_bench table's ok rows."""
    import pandas as pd

    rows = []
    keys = ["collective", "world_size", "backend", "device", "device_name"]
    bench = bench.copy()
    for key in keys:
        if key not in bench:
            bench[key] = None
    for collective, group in bench.groupby("collective", sort=False):
        ok = group[group["status"] == "ok"]
        first = (ok if len(ok) else group).iloc[0]
        base = {k: first[k] for k in keys}
        if len(ok) < 2:
            status = group["status"].iloc[0] if len(ok) == 0 else "failed: fewer than two timings"
            rows.append(dict(base, n_points=len(ok), status=status))
            continue
        n = int(first["world_size"])
        bus = ok["size_bytes"].astype(float) * bus_factor(collective, n)
        model, quality = fit_alpha_beta(bus, ok["time_s"].astype(float))
        rows.append(dict(base, bus_factor=bus_factor(collective, n), alpha_s=model.alpha_s, beta_GBps=model.beta_Bps / 1e9, r2=quality.r2,
                         rel_err_median=quality.rel_err_median, rel_err_max=quality.rel_err_max,
                         n_points=quality.n_points, min_bytes=int(ok["size_bytes"].min()),
                         max_bytes=int(ok["size_bytes"].max()), status="ok"))
    return pd.DataFrame(rows, columns=FIT_COLUMNS)


def models_from_table(fits) -> dict[str, AlphaBeta]:
    """{collective: AlphaBeta} from a comm_fit table's ok rows."""
    ok = fits[fits["status"] == "ok"]
    return {row.collective: AlphaBeta(float(row.alpha_s), float(row.beta_GBps) * 1e9) for row in ok.itertuples()}
