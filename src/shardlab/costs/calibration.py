"""How the planner's GPU efficiencies are calibrated, and how well they predict points they were not
calibrated on.

The efficiencies (`hardware.yaml`) are a few named, bounded physical factors: achieved GEMM share of
peak and its half-performance width, a fused attention kernel's share of peak, element-wise HBM
traffic per stored activation byte, achieved share of link bandwidth, and how much communication
compute hides. A fit is a coordinate descent over each factor's grid (every factor in turn, its best
value kept, until a round improves nothing): no free-form parameters, nothing per point.

- A100 (Megatron, Korthikanti et al. 2022 Table 5): the shared efficiencies are fitted on all eight
  iteration times; their accuracy is the leave-one-model-out error (fit on three models, predict
  the fourth).
- H100: the Hopper efficiencies are fitted on two sources at once, each weighing half: MosaicML's MPT
  benchmarks (PyTorch FSDP, the rows of the set's `calibration_models`) and one of Llama 3 405B's
  three reported configurations (Meta's 4D parallelism at 8K sequence on 8,192 GPUs). Their accuracy
  is the error on the rest: the other MPT models, and Llama 3 at 16,384 GPUs with 8K and 128K
  sequences. One source alone does not identify them: MPT's narrow matrices and short sequences
  cannot tell a GEMM's rate on Llama's wide shards, nor the attention kernel's on long rows.

`python scripts/calibrate-planner.py` runs both fits and prints the values to write into the catalog.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import mean

from shardlab.costs import published

A100_GRID = {
    "gemm": [round(0.70 + 0.02 * k, 2) for k in range(13)],
    "gemm_half_width": [0, 100, 200, 300, 400, 600, 800, 1000, 1500],
    "elementwise_passes": [0.5, 1, 2, 3],
    "link_intra_node": [0.4, 0.5, 0.6, 0.7, 0.8],
    "link_inter_node": [0.4, 0.5, 0.6, 0.7, 0.8],
}
H100_GRID = {
    "gemm": [round(0.40 + 0.02 * k, 2) for k in range(28)],
    "gemm_half_width": [0, 100, 200, 300, 400, 600, 800, 1000, 1500],
    "gemm_half_tokens": [0, 256, 512, 1024, 2048, 4096, 8192],
    "flash_attention": [round(0.15 + 0.05 * k, 2) for k in range(13)],
    "flash_attention_half_keys": [0, 256, 512, 1024, 2048, 4096],
    "elementwise_passes": [0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8],
    "link_intra_node": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
    "link_inter_node": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
    "overlap": [0.0, 0.25, 0.5, 0.75, 0.9, 1.0],
}
MAX_ROUNDS = 8


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


def _start(grid: dict) -> dict:
    """Every factor at the middle of its grid: a start that knows nothing of any point (starting from
    the catalog's values would leak a held-out point's fit into its own prediction)."""
    return {name: values[len(values) // 2] for name, values in grid.items()}


# --- A100: Korthikanti et al. 2022 -----------------------------------------------------------------------
def megatron_time_rows(overrides: dict | None = None, models: list[str] | None = None) -> list[dict]:
    return [r for r in published.rows(overrides)
            if r["quantity"] == "iteration_time_s" and (models is None or r["model"] in models)]


def fit_megatron(models: list[str]) -> tuple[float, dict]:
    """The A100 efficiencies that best predict these models' iteration times (mean absolute error, %)."""
    loss = lambda o: mean(abs(r["error_pct"]) for r in megatron_time_rows(o, models))  # noqa: E731
    return coordinate_descent(loss, A100_GRID, _start(A100_GRID))


def megatron_leave_one_out() -> list[dict]:
    """Each model's iteration times predicted by efficiencies fitted on the other three models."""
    models = [p["name"] for p in published.reference()["models"]]
    out = []
    for held in models:
        _, fitted = fit_megatron([m for m in models if m != held])
        for row in megatron_time_rows(fitted, [held]):
            out.append({**row, "fitted_on": ", ".join(m for m in models if m != held),
                        **{f"fitted_{k}": v for k, v in fitted.items()}})
    return out


# --- H100: MosaicML's FSDP benchmarks and Llama 3 405B ---------------------------------------------
HOPPER_SOURCES = {"fsdp_h100": published.fsdp_rows, "llama3_405b": published.llama3_rows}


def hopper_loss(overrides: dict) -> float:
    """Mean over the Hopper sources of each source's mean absolute error (%) on its calibration rows:
    each published source weighs the same, however many rows it has."""
    return mean(mean(abs(r["error_pct"]) for r in rows(overrides) if r["split"] == "calibration")
                for rows in HOPPER_SOURCES.values())


def fit_hopper() -> tuple[float, dict]:
    """The H100 efficiencies that best predict both sources' calibration rows (`hopper_loss`)."""
    return coordinate_descent(hopper_loss, H100_GRID, _start(H100_GRID))
