"""The strategy registry: one line per parallelism strategy.

A strategy module knows parallelism and nothing else (see `base.Strategy`). This registry is
importable without torch so the Snakefile can validate strategy names cheaply.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from shardlab.strategies.pipeline_parallel import options as pp_options


def _whole_world(world_size: int, options: dict) -> int:
    return world_size


def _no_checks(exp: dict, where: str) -> None:
    return None


@dataclass(frozen=True)
class StrategySpec:
    name: str
    target: str  # "module:Class", imported only when a run starts
    family: str
    summary: str
    single_process: bool = False
    # How many ranks split the global batch, from (world size, strategy options).
    data_parallel_size: Callable[[int, dict], int] = field(default=_whole_world)
    # Extra config checks (raise shardlab.config.ConfigError naming the field).
    check_options: Callable[[dict, str], None] = field(default=_no_checks)

    def load(self):
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)


def _one(world_size: int, options: dict) -> int:
    return 1


def _zero_checks(rung: str):
    def check(exp: dict, where: str) -> None:
        from shardlab.strategies.zero.settings import check_zero_options

        check_zero_options(rung, exp, where)

    return check


def _zero(name: str, cls: str, summary: str) -> StrategySpec:
    return StrategySpec(name, f"shardlab.strategies.zero.deepspeed:{cls}", "zero", summary, check_options=_zero_checks(name))


def _check_tensor_parallel(exp: dict, where: str) -> None:
    """Heads, MLP width and vocabulary split evenly over the TP ranks; SP also splits the sequence."""
    from shardlab.config import ConfigError, world_size_for

    strategy = where.rsplit(".", 1)[-1]
    allowed = {"world_size", "parallel_cross_entropy"} if strategy in ("tp", "tp_sp") else {"world_size"}
    for key in exp.get("strategy_options", {}).get(strategy, {}):
        if key not in allowed:
            raise ConfigError(f"{where}.{key}", f"unknown option (allowed: {', '.join(sorted(allowed))})")
    tp = world_size_for(exp, strategy)
    model = exp["model"]
    if tp == "auto" or model.get("source") != "local":
        return  # checked when the model is sharded
    for key in ("num_heads", "intermediate_size", "vocab_size"):
        if model[key] % tp:
            raise ConfigError(f"{where.rsplit('.strategy_options', 1)[0]}.model.{key}",
                              f"{model[key]} is not divisible by the tensor-parallel degree {tp} of '{strategy}'")
    if strategy.startswith("tp_sp") and exp["training"]["seq_len"] % tp:
        raise ConfigError(f"{where.rsplit('.strategy_options', 1)[0]}.training.seq_len",
                          f"{exp['training']['seq_len']} is not divisible by the sequence-parallel degree {tp}")


def _lazy(target: str) -> Callable[[dict, str], None]:
    """A config check that lives in its technique's (torch-free) options module, imported on first use."""
    def check(exp: dict, where: str) -> None:
        module, func = target.split(":")
        return getattr(importlib.import_module(f"shardlab.strategies.{module}"), func)(exp, where)
    return check


_SPECS = [
    StrategySpec("single", "shardlab.strategies.single:SingleDevice", "baseline",
                 "One process, the reference every parallel run is checked against.",
                 single_process=True, data_parallel_size=_one),
    StrategySpec("dp_naive", "shardlab.strategies.data_parallel.naive:NaiveDataParallel", "data parallel",
                 "Full backward, then one blocking all-reduce of all gradients (hand-written)."),
    StrategySpec("dp_interleaved", "shardlab.strategies.data_parallel.interleaved:InterleavedDataParallel", "data parallel",
                 "Per-layer async all-reduce launched from gradient hooks, overlapping backward (hand-written)."),
    StrategySpec("ddp", "shardlab.strategies.data_parallel.ddp:TorchDDP", "data parallel",
                 "torch DistributedDataParallel: bucketed all-reduce overlapped with backward."),
    StrategySpec("cp_ring", "shardlab.strategies.context_parallel.strategy:ContextParallelRing", "context parallel",
                 "Sequence sharded zig-zag over ranks; hand-written ring attention (K/V blocks rotate by send/recv).",
                 data_parallel_size=_one, check_options=_lazy("context_parallel.options:check_cp_options")),
    StrategySpec("moe_single", "shardlab.strategies.expert_parallel.strategy:MoESingle", "expert parallel",
                 "The mixture-of-experts model in one process: the reference for ep_moe.",
                 single_process=True, data_parallel_size=_one,
                 check_options=_lazy("expert_parallel.options:check_moe_options")),
    StrategySpec("ep_moe", "shardlab.strategies.expert_parallel.strategy:ExpertParallelMoE", "expert parallel",
                 "Mixture of experts with experts sharded over ranks; tokens dispatched by uneven all-to-all.",
                 check_options=_lazy("expert_parallel.options:check_moe_options")),
    _zero("zero0", "Zero0", "DeepSpeed ZeRO stage 0: plain data parallelism inside the DeepSpeed engine."),
    _zero("zero1", "Zero1", "DeepSpeed ZeRO-1: optimizer state (with fp32 master weights) sharded."),
    _zero("zero2", "Zero2", "DeepSpeed ZeRO-2: optimizer state and gradients sharded."),
    _zero("zero3", "Zero3", "DeepSpeed ZeRO-3: optimizer state, gradients and parameters sharded."),
    _zero("zero2_offload", "Zero2Offload", "DeepSpeed ZeRO-2 with the optimizer state and step on the CPU."),
    _zero("zero3_offload", "Zero3Offload", "DeepSpeed ZeRO-3 with parameters and optimizer state on the CPU."),
    StrategySpec("fsdp2_full", "shardlab.strategies.zero.fsdp2:FSDP2Full", "zero",
                 "torch FSDP2 fully_shard, reshard after forward (ZeRO-3's schedule)."),
    StrategySpec("fsdp2_grad_op", "shardlab.strategies.zero.fsdp2:FSDP2GradOp", "zero",
                 "torch FSDP2 fully_shard, weights kept gathered from forward to backward (ZeRO-2-like)."),
    StrategySpec("pp_gpipe", "shardlab.strategies.pipeline_parallel.pipeline:PipelineParallel", "pipeline parallel",
                 "Hand-cut stages, torch.distributed.pipelining GPipe: all forwards, then all backwards.",
                 data_parallel_size=pp_options.data_parallel_size(hybrid=False),
                 check_options=pp_options.checker(virtual_stages=1, needs_m_ge_stages=False)),
    StrategySpec("pp_1f1b", "shardlab.strategies.pipeline_parallel.pipeline:OneForwardOneBackward", "pipeline parallel",
                 "Hand-cut stages, 1F1B schedule: one forward, one backward; fewer micro-batches in flight.",
                 data_parallel_size=pp_options.data_parallel_size(hybrid=False),
                 check_options=pp_options.checker(virtual_stages=1, needs_m_ge_stages=True)),
    StrategySpec("pp_interleaved", "shardlab.strategies.pipeline_parallel.pipeline:InterleavedPipeline", "pipeline parallel",
                 "Interleaved 1F1B: two looped virtual stages per rank, a smaller bubble for more sends.",
                 data_parallel_size=pp_options.data_parallel_size(hybrid=False),
                 check_options=pp_options.checker(virtual_stages=2, needs_m_ge_stages=False, interleaved=True)),
    StrategySpec("hybrid_dp_pp", "shardlab.strategies.pipeline_parallel.hybrid_dp_pp:HybridDataPipeline", "hybrid",
                 "2-D mesh (dp, pp): 1F1B pipelines replicated over dp, stage gradients all-reduced over dp.",
                 data_parallel_size=pp_options.data_parallel_size(hybrid=True),
                 check_options=pp_options.checker(virtual_stages=1, needs_m_ge_stages=True, hybrid=True)),
    StrategySpec("tp", "shardlab.strategies.tensor_parallel.tensor_parallel:HandTensorParallel", "tensor parallel",
                 "Megatron-style column/row-parallel attention and MLP, vocab-parallel embedding and head (hand-written).",
                 data_parallel_size=_one, check_options=_check_tensor_parallel),
    StrategySpec("tp_sp", "shardlab.strategies.tensor_parallel.tensor_parallel:HandSequenceParallel", "tensor parallel",
                 "tp plus sequence parallelism: LayerNorms and residuals on a sequence shard (hand-written).",
                 data_parallel_size=_one, check_options=_check_tensor_parallel),
    StrategySpec("tp_dtensor", "shardlab.strategies.tensor_parallel.dtensor_tp:DTensorTensorParallel", "tensor parallel",
                 "PyTorch DTensor parallelize_module with Colwise/RowwiseParallel (comparator for tp).",
                 data_parallel_size=_one, check_options=_check_tensor_parallel),
    StrategySpec("tp_sp_dtensor", "shardlab.strategies.tensor_parallel.dtensor_tp:DTensorSequenceParallel", "tensor parallel",
                 "DTensor TP plus SequenceParallel LayerNorms (comparator for tp_sp).",
                 data_parallel_size=_one, check_options=_check_tensor_parallel),
]

REGISTRY: dict[str, StrategySpec] = {spec.name: spec for spec in _SPECS}


def get_spec(name: str) -> StrategySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown strategy '{name}' (known: {', '.join(sorted(REGISTRY))})") from None
