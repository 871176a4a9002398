"""The memory model held to real runs on a grid of model shapes and both dtypes (shardlab.bench.cost_grid):
model states per rank and category within 1 % for every ZeRO/FSDP2 rung, activations per layer within
10 %, under one torchrun launch (2 ranks, gloo) plus in-process activation probes; the formulas'
closed forms (Korthikanti et al. 2022); and checks that these assertions can fail."""

from __future__ import annotations

import json
import os
from statistics import mean

import pytest

from shardlab.bench import cost_grid as cg
from shardlab.costs.activations import COMPONENTS, PRECISIONS, layer_bytes, measured_per_layer
from helpers import rung_states
from shardlab.costs.sharded_states import Held, parameter_shapes

STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")
# Model states: the only bytes left out are optimizer `step` scalars (4 bytes per stepped tensor, at most
# 0.06 % on this grid), so 1 % (the planner's target) holds with margin; a missed tensor or a wrong split
# costs far more (an unpadded split misses by up to 27 %, a forgotten master copy by 33 %).
STATE_TOL = 0.01
# Activations: the only tensors left out are the rotary cos/sin tables (2 x seq x rotary dims, < 1.5 % of
# the attention core here); 10 % is the planner's target.
ACTIVATION_TOL = 0.10


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """Every grid point measured under one torchrun launch (2 ranks)."""
    pytest.importorskip("deepspeed")
    from shardlab.runner.launch import launch_module

    run_dir = tmp_path_factory.mktemp("cost_grid")
    out = run_dir / "grid.json"
    reason = launch_module(2, "shardlab.bench.cost_grid", ["--out", str(out)], run_dir, out, 600, "the grid's deadline",
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert reason is None, reason
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def activations():
    return cg.activation_points()


def _states_error(record: dict, padded: bool = True) -> dict[str, float]:
    tensors = record["tensor_shapes"] if padded else None
    want = rung_states(record["rung"], record["parameters"], 2, record["dtype"], "adamw", tensors=tensors,
                   rank=record["rank"] if padded else None)
    return {key: record[key] / getattr(want, key) - 1 for key in STATES}


def _ladder(grid: dict) -> list[dict]:
    return [r for r in grid["records"] if r["rung"] in set(cg.RUNGS)]


def _print_table(title: str, rows: dict[str, list[float]]) -> None:
    print(f"\n{title}\n{'':32s} {'mean |err|':>10s} {'worst':>8s}")
    for key, errors in rows.items():
        worst = max(errors, key=abs)
        print(f"{key:32s} {100 * mean(map(abs, errors)):9.3f}% {100 * worst:+7.3f}%")


@pytest.mark.torchrun
def test_model_states_within_one_percent_on_every_grid_point(grid):
    rows: dict[str, list[float]] = {}
    failures = []
    for record in _ladder(grid):
        for key, error in _states_error(record).items():
            rows.setdefault(f"{record['rung']} {record['dtype']} {key.split('_')[0]}", []).append(error)
            if abs(error) > STATE_TOL:
                failures.append((record["shape"], record["dtype"], record["rung"], record["rank"], key, error))
    _print_table("model states: measured / predicted - 1 (shapes x ranks)", rows)
    assert {r["shape"] for r in grid["records"]} == set(cg.GRID)
    assert len(_ladder(grid)) == len(cg.GRID) * len(cg.DTYPES) * len(cg.RUNGS) * 2
    assert failures == []


@pytest.mark.torchrun
def test_the_even_split_misses_where_deepspeed_pads_and_straddles(grid):
    """The check can fail: without the tensors (the even split Ψ/N) stages 1-2 miss the gradients of the
    tensors that straddle a partition boundary by far more than 1 % on some shape."""
    worst = max(abs(_states_error(r, padded=False)["grad_bytes"]) for r in _ladder(grid))
    assert worst > 5 * STATE_TOL


@pytest.mark.torchrun
def test_zero0_in_bf16_takes_an_extra_adam_step_at_construction(grid):
    """Why zero0 ends bf16 training at another loss: DeepSpeed's FP16_UnfusedOptimizer (its stage-0 bf16
    path) steps the optimizer once on zero gradients when it is built, so after one training step AdamW
    counts 2 (every other rung 1) and uses the next step's bias corrections ever after."""
    steps = {(r["rung"], r["dtype"]): r["adam_steps"] for r in _ladder(grid)}
    assert steps.pop(("zero0", "bf16")) == 2
    assert set(steps.values()) == {1}


def _activation_error(shape_name: str, rows: int, by_module: dict, precision: str, split: str = "none",
                      t: int = 1, intermediate: int | None = None) -> tuple[float, dict[str, float]]:
    shape = cg.GRID[shape_name]
    measured = measured_per_layer(by_module, shape.num_layers)
    predicted = layer_bytes(cg.SEQ_LEN, rows, shape.hidden_size, shape.num_heads,
                            intermediate or shape.intermediate_size, t, split, **PRECISIONS[precision])
    per_component = {c: measured[c] / predicted[c] - 1 for c in COMPONENTS if predicted[c]}
    return sum(measured.values()) / sum(predicted.values()) - 1, per_component


def _activation_cases(grid: dict, activations: list[dict]):
    """(label, shape, rows, by_module, precision, split, t): in-process probes and every rank of the grid."""
    for r in activations:
        yield f"single {r['precision']}", r["shape"], r["rows"], r["activation_by_module"], r["precision"], "none", 1
    for r in grid["records"]:
        plan = cg.grid_plan(r["rung"], r["dtype"], grid["world_size"])
        yield (f"{r['rung']} {r['dtype']}", r["shape"], r["rows"], r["activation_by_module"],
               plan.activation_precision, plan.activation_split, plan.tp)


@pytest.mark.torchrun
def test_activations_per_layer_within_ten_percent(grid, activations):
    rows: dict[str, list[float]] = {}
    components: dict[str, list[float]] = {}
    failures = []
    for label, shape, n, by_module, precision, split, t in _activation_cases(grid, activations):
        total, parts = _activation_error(shape, n, by_module, precision, split, t)
        rows.setdefault(label, []).append(total)
        for component, error in parts.items():
            components.setdefault(f"{component} ({precision})", []).append(error)
        if abs(total) > ACTIVATION_TOL:
            failures.append((label, shape, total, parts))
    _print_table("activations per layer: measured / predicted - 1", rows)
    _print_table("by component", components)
    assert {r["precision"] for r in activations} == set(PRECISIONS)
    assert failures == []


def test_the_4h_mlp_formula_misses_other_widths(activations):
    """The check can fail: with the MLP width taken as 4h (the paper's assumption) the per-layer total
    misses by more than the tolerance on shapes whose intermediate size is not 4h."""
    worst = max(abs(_activation_error(r["shape"], r["rows"], r["activation_by_module"], r["precision"],
                                      intermediate=4 * cg.GRID[r["shape"]].hidden_size)[0]) for r in activations)
    assert worst > ACTIVATION_TOL


@pytest.mark.torchrun
def test_parameter_shapes_follow_the_model(grid):
    for record in _ladder(grid):
        assert [list(s) for s in parameter_shapes(cg.GRID[record["shape"]])] == record["tensor_shapes"]


# --- the formulas in closed form ---------------------------------------------------------------------
KORTHIKANTI = {"residual": "sequential", "attention": "eager", "dropout": True, "value_bytes": 2}


@pytest.mark.parametrize("s, b, h, a, t", [(2048, 1, 12288, 96, 8), (128, 2, 256, 8, 4), (512, 3, 640, 10, 2)])
def test_layer_bytes_reproduces_korthikanti(s, b, h, a, t):
    sbh = s * b * h

    def total(**kw):
        return sum(layer_bytes(s, b, h, a, 4 * h, **KORTHIKANTI, **kw).values())

    assert total() == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    assert total(t=t, split="tensor") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert total(t=t, split="tensor_sequence") == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert total(t=t, split="tensor_sequence", recompute="selective") == pytest.approx(sbh * 34 / t, rel=1e-12)
    assert total(recompute="full") == pytest.approx(2 * sbh, rel=1e-12)
    assert total(t=t, split="tensor_sequence", recompute="full") == pytest.approx(2 * sbh / t, rel=1e-12)


def test_layer_bytes_options():
    s, b, h, a, i = 64, 2, 128, 8, 344
    base = layer_bytes(s, b, h, a, i)
    # GQA: K and V (and the fused output V views) shrink, the paper's Q and the output do not.
    gqa = layer_bytes(s, b, h, a, i, kv_heads=2)
    assert gqa["attention_core"] == base["attention_core"] - 4 * s * b * (h - h * 2 / a) * (2 + 1)
    # SwiGLU saves three width-i tensors instead of two.
    assert layer_bytes(s, b, h, a, i, mlp="swiglu")["mlp"] - base["mlp"] == 4 * s * b * i
    # Autocast: fp32 LayerNorm input, bf16 values and weight copies.
    auto = layer_bytes(s, b, h, a, i, value_bytes=2, autocast=True)
    assert auto["qkv"] == 2 * s * b * h + 2 * h * 3 * h and auto["layernorm"] == 4 * s * b * h
    with pytest.raises(ValueError, match="unknown recompute"):
        layer_bytes(s, b, h, a, i, recompute="some")


def test_deepspeed_partition_rules_by_hand():
    # Tensors of 5 and 3 elements on 2 ranks: the flat buffer pads 8 to a multiple of 4 (= 8), each rank
    # owns 4 elements; rank 0's partition [0, 4) touches only the first tensor, rank 1's [4, 8) both.
    rank0, rank1 = Held.exact([(5,), (3,)], 2, 0), Held.exact([(5,), (3,)], 2, 1)
    assert (rank0.flat_buffer, rank0.flat_partition) == (8, 4)
    assert (rank0.boundary_gradient, rank1.boundary_gradient) == (5, 8)
    assert rank0.tensor_partition == 3 + 2  # ceil(5/2) + ceil(3/2)
    # FSDP2: dim-0 chunks of a (3, 4) matrix: 2 rows then 1.
    assert (Held.exact([(3, 4)], 2, 0).fsdp2_shard, Held.exact([(3, 4)], 2, 1).fsdp2_shard) == (8, 4)
    # Without tensors, predict is the even split; with them, the default rank is the fullest one.
    psi = 77859
    shapes = parameter_shapes(cg.GRID["h48_a3_i81_L3"])
    assert rung_states("zero2", psi, 2, "fp32").grad_bytes == 4 * psi / 2
    assert rung_states("zero2", psi, 2, "fp32", tensors=shapes) == max(
        (rung_states("zero2", psi, 2, "fp32", tensors=shapes, rank=r) for r in (0, 1)), key=lambda m: m.total_bytes)
