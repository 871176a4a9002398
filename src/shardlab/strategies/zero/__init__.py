"""The ZeRO ladder: DeepSpeed stages 0-3 and offload (`deepspeed`, its JSON from `settings`), and
PyTorch FSDP2 (`fsdp2`) beside it. The rungs' facts are `shardlab.costs.memory.ZERO_LADDER`."""

from __future__ import annotations

from shardlab.costs.comm_volume import data_parallel, zero_sharded_optimizer, zero_sharded_parameters
from shardlab.costs.memory import FSDP2_RUNGS, ZERO_LADDER, ZeroRung, parameter_shapes, predict
from shardlab.strategies.spec import StrategySpec, one
from shardlab.strategies.zero.settings import check_zero_options

TOPIC = "zero"
SUMMARIES = {
    "zero0": ("Zero0", "DeepSpeed ZeRO stage 0: plain data parallelism inside the DeepSpeed engine."),
    "zero1": ("Zero1", "DeepSpeed ZeRO-1: optimizer state (with fp32 master weights) sharded."),
    "zero2": ("Zero2", "DeepSpeed ZeRO-2: optimizer state and gradients sharded."),
    "zero3": ("Zero3", "DeepSpeed ZeRO-3: optimizer state, gradients and parameters sharded."),
    "zero2_offload": ("Zero2Offload", "DeepSpeed ZeRO-2 with the optimizer state and step on the CPU."),
    "zero3_offload": ("Zero3Offload", "DeepSpeed ZeRO-3 with parameters and optimizer state on the CPU."),
    "fsdp2_full": ("FSDP2Full", "torch FSDP2 fully_shard, reshard after forward (ZeRO-3's schedule)."),
    "fsdp2_grad_op": ("FSDP2GradOp", "torch FSDP2 fully_shard, weights kept gathered from forward to backward "
                                     "(ZeRO-2-like)."),
}


def _comm(name: str, rung: ZeroRung):
    # Stage 0 all-reduces; 1-2 (and FSDP2 keeping weights gathered) reduce-scatter gradients and gather
    # updated weights; 3 gathers weights for forward and again for backward.
    regathers = rung.stage == 3 and name != "fsdp2_grad_op"
    plan = data_parallel if rung.stage == 0 else zero_sharded_parameters if regathers else zero_sharded_optimizer
    return lambda model, step, world, options: plan(model, step, world)


def _states(name: str):
    def states(model, world, options, dtype, optimizer):
        # Per rank from the parameter tensors: DeepSpeed's padding and partition boundaries, FSDP2's chunks.
        tensors = parameter_shapes(model)
        return [predict(name, model.parameters(), world, dtype, optimizer, tensors=tensors, rank=r)
                for r in range(world)]

    return states


# In bf16 DeepSpeed and FSDP2 keep the module's weights in bf16 (FSDP2: param_dtype), where `single` runs
# autocast over fp32 weights: another rounding of the same training, whose distance from `single` is
# measured by the library's own recipe on one process (DeepSpeed at ZeRO-1: stage 0's bf16 path starts
# AdamW one step ahead, see deepspeed.py) and allowed for by the parity rule (tables.parity).
BF16_TWINS = {"deepspeed": ("deepspeed_single", "Zero1", "zero1"), "fsdp2": ("fsdp2_single", "FSDP2Full", "fsdp2_full")}


def _twin(framework: str) -> StrategySpec:
    name, cls, rung = BF16_TWINS[framework]
    return StrategySpec(name, f"shardlab.strategies.zero.{framework}:{cls}", "baseline", "runs",
                        f"{framework} on one process: its own bf16 recipe, compared with `single` to measure that "
                        f"recipe's rounding noise (tables.parity).", lambda model, step, world, options: [],
                        _states(rung), single_process=True, data_parallel_size=one)


def _spec(name: str, rung: ZeroRung) -> StrategySpec:
    cls, summary = SUMMARIES[name]
    module = "fsdp2" if rung.framework == "fsdp2" else "deepspeed"
    return StrategySpec(name, f"shardlab.strategies.zero.{module}:{cls}", "zero", TOPIC, summary, _comm(name, rung),
                        _states(name), zero=rung, bf16_twin=BF16_TWINS[rung.framework][0],
                        check_options=check_zero_options if rung.framework == "deepspeed" else _no_fsdp2_options)


def _no_fsdp2_options(exp: dict, where: str, world) -> None:
    from shardlab.errors import ConfigError

    unknown = set(exp.get("strategy_options", {}).get(where.rsplit(".", 1)[-1], {})) - {"world_size"}
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown FSDP2 option (known: world_size)")


SPECS = [*(_spec(name, rung) for name, rung in {**ZERO_LADDER, **FSDP2_RUNGS}.items()), *map(_twin, BF16_TWINS)]
