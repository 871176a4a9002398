"""`parallelize(model, mesh, plan)`: a composed Plan's techniques applied to a model, one function each,
in one visible order on the named mesh `(pp, dp, cp, tp)`:

1. tensor parallelism (+ sequence parallelism) inside each `tp` group (`tensor_parallel.parallelize_neox`),
   and a mixture of experts' MLPs split the same way (Megatron's expert tensor parallelism);
2. context parallelism: ring attention over each `cp` group, on a zig-zag shard of every sequence;
3. with pp > 1, pipeline stages: the TP/CP model cut into pp x v stages, run by a schedule over `pp`;
4. with FSDP2 asked for, the model (or each of this rank's stages, as torchtitan composes them) sharded
   over the ranks that replicate it (dp x cp); torch's pipeline stages hold back an FSDP2 stage's
   reduce-scatter until its last micro-batch's backward.

Data-parallel replicas need nothing applied: each dp rank trains on its own rows of the batch, and the
strategy averages the replicas' gradients. Measurement is no part of this: a probe wraps what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AttentionInterface

from shardlab.strategies.context_parallel import zigzag
from shardlab.strategies.context_parallel.comms import Ring
from shardlab.strategies.context_parallel.strategy import ATTENTION_NAME, make_ring_attention_forward
from shardlab.strategies.expert_parallel.moe import MoEMLP
from shardlab.strategies.pipeline_parallel.pipeline import Pipeline, build_pipeline
from shardlab.strategies.pipeline_parallel.stages import NeoXStage
from shardlab.strategies.tensor_parallel.comms import gather_sequence, split_sequence
from shardlab.strategies.tensor_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, parallelize_neox
from shardlab.strategies.zero.fsdp2 import transformer_blocks


@dataclass
class Parallelized:
    """What the composed step needs from the parallelized model."""

    module: nn.Module  # what the optimizer steps: the whole (TP/CP/FSDP2) model, or this rank's stage modules
    pipeline: Pipeline | None  # with pp > 1: the stages and their schedule
    fsdp: bool  # FSDP2 shards the model and averages its gradients over the replicas itself
    shard_positions: torch.Tensor | None  # with cp: the global positions of this rank's zig-zag tokens
    tp_shard_dims: dict[str, int]  # parameter name -> the dimension TP split it along
    partial_sum_params: list  # SP: parameters applied to one sequence shard (gradients summed over tp)


def parallelize(model: nn.Module, mesh, plan: dict, *, replicas, seq_len: int, dtype: str, device,
                comm) -> Parallelized:
    """Apply `plan`'s techniques to `model` on `mesh`, in order. `replicas` is the 1-D mesh of the ranks
    that hold the same parameters (dp x cp); `comm` times the ring's sends."""
    apply_tensor_parallel(model, mesh, plan)
    positions = apply_context_parallel(model, mesh, plan, seq_len, device, comm)
    tp_shard_dims = {n: p.tp_shard_dim for n, p in model.named_parameters() if hasattr(p, "tp_shard_dim")}
    partial_sum_names = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
    fsdp = plan.get("framework") == "fsdp2"
    if plan["pp"] > 1:
        pipeline = apply_pipeline(model, mesh, plan, positions, device)
        module = pipeline.modules
        partial_sum_names = {n for n, p in module.named_parameters() if getattr(p, "sequence_parallel", False)}
        if fsdp:
            hf_name = {n: pipeline.hf_names[id(p)] for n, p in module.named_parameters()}
            for stage in module:
                apply_fsdp(stage, transformer_blocks_of_stage(stage), replicas, reshard=plan["zero"] == 3, dtype=dtype)
            pipeline.hf_names = {id(p): hf_name[n] for n, p in module.named_parameters()}  # FSDP2's new parameters
    else:
        pipeline, module = None, model
        if fsdp:
            apply_fsdp(model, transformer_blocks(model), replicas, reshard=plan["zero"] == 3, dtype=dtype)
    # By name: FSDP2 has replaced the parameters, and its DTensors do not carry TP's marks.
    partial = [p for n, p in module.named_parameters() if n in partial_sum_names]
    return Parallelized(module, pipeline, fsdp, positions, tp_shard_dims, partial)


def apply_tensor_parallel(model: nn.Module, mesh, plan: dict) -> None:
    """Megatron's column/row split inside each `tp` group (+ SP), the logits gathered for a plain loss."""
    if plan["tp"] > 1:
        group = mesh["tp"].get_group()
        parallelize_neox(model, group, plan["sp"], gather_logits=True)
        for layer in model.gpt_neox.layers:
            if isinstance(layer.mlp, MoEMLP):
                split_experts(layer.mlp, group, plan["sp"])


def split_experts(moe: MoEMLP, group, sequence_parallel: bool) -> None:
    """Each expert's MLP column/row split inside the tp group, on tokens whole on every tp rank (so routing,
    capacity and the all-to-all are the same on each); under SP they are gathered from the sequence shards
    and the output cut back to this rank's shard."""
    for expert in moe.experts:
        expert.dense_h_to_4h = ColumnParallelLinear(expert.dense_h_to_4h, group, input_mode="copy")
        expert.dense_4h_to_h = RowParallelLinear(expert.dense_4h_to_h, group)
    if sequence_parallel:
        moe.register_forward_pre_hook(lambda module, args: (gather_sequence(args[0], group), *args[1:]))
        moe.register_forward_hook(lambda module, args, out: split_sequence(out, group))


def apply_context_parallel(model: nn.Module, mesh, plan: dict, seq_len: int, device, comm) -> torch.Tensor | None:
    """Ring attention over each `cp` group; returns this rank's zig-zag tokens' global positions (None
    without cp)."""
    if plan["cp"] == 1:
        return None
    ring = Ring(mesh["cp"].get_group(), timer=comm)
    AttentionInterface.register(ATTENTION_NAME, make_ring_attention_forward(ring))
    model.set_attn_implementation(ATTENTION_NAME)
    return zigzag.positions(seq_len, ring.rank, ring.size).to(device).unsqueeze(0)


def apply_pipeline(model: nn.Module, mesh, plan: dict, positions, device) -> Pipeline:
    """The TP/CP model cut into pp x v stages over `pp`: a stage past the first receives one of tp sequence
    shards under SP, and its tokens sit at the zig-zag `positions` under CP."""
    pp = mesh["pp"]
    shards = plan["tp"] if plan["sp"] else 1

    def make_stage(whole, units):
        return NeoXStage(whole, units, sequence_shards=shards, position_ids=positions)

    return build_pipeline(model, pp.get_group(), pp.get_local_rank(), pp.size(), plan["schedule"],
                          plan["virtual_stages"], plan["micro_batches"], device, make_stage=make_stage)


def transformer_blocks_of_stage(stage: NeoXStage) -> list:
    return list(stage.layers.values())


def apply_fsdp(model: nn.Module, blocks: list, replicas, reshard: bool, dtype: str) -> None:
    """FSDP2 over every rank that holds the same parameters, dp x cp (as the Plan's ZeRO group): each keeps
    1/(dp·cp) of its tp shard, and FSDP2's reduce-scatter averages the gradients over them. Each of
    `blocks` is its own unit (one all-gather each), the rest of `model` the root's."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype == "bf16" else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=replicas, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=replicas, reshard_after_forward=reshard, mp_policy=mp)
