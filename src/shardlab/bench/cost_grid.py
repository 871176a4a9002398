"""The memory model's measurement grid: tiny GPT-NeoX shapes x dtypes x ZeRO/FSDP2 rungs (and TP), one
optimizer step each, measured exactly as the study's runs measure (`runner.loop.measured_step` with the
probe on: `Strategy.state_bytes` for parameters, gradients and optimizer state, `ActivationProbe` for
what autograd saves), in ONE torchrun job that builds and tears down every engine in turn:

    python -m shardlab.runner.agent --standalone --nproc-per-node=2 -m shardlab.bench.cost_grid --out grid.json

`activation_points` measures the same shapes in-process (one rank): fp32, bf16 autocast (how the
torch-native strategies run bf16) and a bf16 model cast (how DeepSpeed's and FSDP2's bf16 run).
tests/test_cost_grid.py holds `costs.sharded_states` and `costs.activations` to these measurements.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
from pathlib import Path

import torch

from shardlab import cli
from shardlab.costs.activations import PRECISIONS
from shardlab.strategies import REGISTRY, Family
from shardlab.costs.plan import Plan
from shardlab.costs.shapes import ModelShape
from shardlab.runner.failures import record
from shardlab.strategies.roles import tp_pair

# Shapes chosen to break what the default shape hides: intermediate != 4h (below and above), head counts
# 3, 5 and 6, odd parameter counts (odd intermediate and layer count), odd vocabularies; and the
# study's default shape (config/config.yaml). Head dimension 16 or 8 keeps rotary dimensions even.
GRID = {
    "default": ModelShape(512, 128, 4, 4, 512),
    "h48_a3_i81_L3": ModelShape(263, 48, 3, 3, 81),  # odd parameter count, intermediate 1.7h
    "h96_a6_i203_L1": ModelShape(301, 96, 1, 6, 203),  # odd parameter count, intermediate 2.1h
    "h40_a5_i224_L2": ModelShape(257, 40, 2, 5, 224),  # intermediate 5.6h, 5 heads
}
DTYPES = ("fp32", "bf16")
RUNGS = [name for name, spec in REGISTRY.items() if spec.family == Family.ZERO]
# Hand-written TP, with and without sequence parallelism (heads, MLP width and vocabulary must divide by
# the world size: of this grid, the default shape), in both dtypes.
TP_SPLITS = {name: DTYPES for name in tp_pair()}
SEQ_LEN, ROWS_PER_RANK = 32, 2


def model_config(shape: ModelShape) -> dict:
    return {"vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
            "num_heads": shape.num_heads, "intermediate_size": shape.intermediate_size,
            "max_position_embeddings": 2 * SEQ_LEN}


def build_model(shape: ModelShape, seed: int = 0):
    """A fresh fp32 GPT-NeoX of `shape` (the study's local model, random weights)."""
    from transformers import GPTNeoXForCausalLM

    from shardlab.core.model import tiny_neox_config

    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(tiny_neox_config(model_config(shape)))
    model.config.use_cache = False
    return model


def training(dtype: str, world: int, optimizer: str = "adamw") -> dict:
    return {"global_batch_size": ROWS_PER_RANK * world, "micro_batch_size": None, "seq_len": SEQ_LEN,
            "optimizer": optimizer, "lr": 1e-3, "weight_decay": 0.0, "dtype": dtype}


def batch(shape: ModelShape, rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab_size, (rows, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


_LINEAR = torch.nn.functional.linear


def teardown(strategy) -> None:
    """Free an engine before the next: DeepSpeed's hooks and buffers, FSDP2's shards. ZeRO-3 replaces
    torch.nn.functional.linear for the whole process ("persists unless manually reset"), which changes
    what later autocast runs save; a run of the study is its own process, so restore it."""
    engine = getattr(strategy, "engine", None)
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    torch.nn.functional.linear = _LINEAR
    gc.collect()


def measure_rung(name: str, shape: ModelShape, dtype: str, topo) -> dict:
    """One optimizer step of strategy `name`, measured as a run's probe step measures it."""
    from shardlab.runner.loop import measured_step
    from shardlab.strategies import get_spec

    model = build_model(shape)
    tensors = [p.shape for p in model.parameters()]
    strategy = get_spec(name).build(model, topo, training(dtype, topo.world_size), {})
    inputs, labels = strategy.local_batch(*batch(shape, ROWS_PER_RANK * topo.world_size))
    measured: dict = {}
    loss, _, _ = measured_step(strategy, strategy.micro_batches(inputs, labels), measured, probe=True)
    steps = adam_steps(strategy)
    teardown(strategy)
    keep = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_by_module")
    return {"rung": name, "shape": shape_name(shape), "dtype": dtype, "rank": topo.rank,
            "parameters": sum(p.numel() for p in tensors), "tensor_shapes": [list(p) for p in tensors],
            "rows": inputs.shape[0], "loss": float(loss), "adam_steps": steps, **{k: measured[k] for k in keep}}


def adam_steps(strategy) -> float | None:
    """The step count AdamW holds after the measured step: 1, unless an engine stepped on its own."""
    inner = getattr(strategy.optimizer, "optimizer", strategy.optimizer)  # DeepSpeed wraps the torch optimizer
    steps = [float(state["step"]) for state in inner.state.values() if "step" in state]
    return max(steps) if steps else None


def shape_name(shape: ModelShape) -> str:
    return next(name for name, s in GRID.items() if s == shape)


def grid_points(world: int) -> list[tuple[str, ModelShape, str]]:
    points = [(rung, shape, dtype) for shape in GRID.values() for dtype in DTYPES for rung in RUNGS]
    tp = [(split, shape, dtype) for shape in GRID.values() for split, dtypes in TP_SPLITS.items() for dtype in dtypes
          if tp_divides(shape, world)]
    return points + tp


def grid_plan(strategy: str, dtype: str, world: int) -> Plan:
    """The Plan of a grid point (how its activations split and are stored: DeepSpeed and FSDP2 cast
    the module to bf16, plain PyTorch strategies use torch.autocast)."""
    exp = {"training": training(dtype, world), "strategy_options": {}}
    return REGISTRY[strategy].run_plan(exp, 1 if REGISTRY[strategy].single_process else world)


def tp_divides(shape: ModelShape, t: int) -> bool:
    """The hand-written TP cuts heads, the MLP width and the vocabulary evenly."""
    return all(n % t == 0 for n in (shape.num_heads, shape.intermediate_size, shape.vocab_size))


def activation_points() -> list[dict]:
    """Single-process activation bytes by module for every grid shape and precision."""
    from shardlab.runner.probes import ActivationProbe
    from shardlab.strategies.base import causal_lm_loss

    torch.set_num_threads(1)
    out = []
    for name, shape in GRID.items():
        for precision in PRECISIONS:
            model = build_model(shape)
            if precision == "bf16_cast":
                model = model.to(torch.bfloat16)  # DeepSpeed's bf16: the module itself in bf16
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16_autocast" \
                else contextlib.nullcontext()
            inputs, labels = batch(shape, ROWS_PER_RANK)
            with ActivationProbe(model) as probe, autocast:
                causal_lm_loss(model(input_ids=inputs).logits, labels)
            out.append({"shape": name, "precision": precision, "rows": ROWS_PER_RANK,
                        "activation_by_module": probe.bytes_by_module()})
    return out


@record  # an exception escaping a rank becomes torchrun's error file (runner.failures)
def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist

    from shardlab.core.topology import init_topology, shutdown

    parser = cli.Parser(prog="shardlab.bench.cost_grid", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="JSON: one record per grid point and rank")
    parser.add_argument("--rungs", nargs="*", help="only these strategies (default: the whole grid)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    topo = init_topology({"device": "cpu", "backend": "gloo", "threads_per_rank": 1})
    try:
        records, started = [], time.perf_counter()
        for name, shape, dtype in grid_points(topo.world_size):
            if not args.rungs or name in args.rungs:
                t0 = time.perf_counter()
                records.append(dict(measure_rung(name, shape, dtype, topo), seconds=time.perf_counter() - t0))
        gathered = [None] * topo.world_size
        dist.all_gather_object(gathered, records)
        if topo.is_main:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"world_size": topo.world_size, "seq_len": SEQ_LEN,
                                            "records": [r for rank in gathered for r in rank],
                                            "seconds": time.perf_counter() - started}))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
