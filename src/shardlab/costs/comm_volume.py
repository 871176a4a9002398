"""The communication of a plan (`costs.plan.Plan`): which collectives one rank issues, how large,
how often, over how many ranks. The one home of these formulas: the run tables count bytes with
them, the step-time model (`costs.step_time`) turns the same calls into seconds.

A call's size follows nccl-tests' convention (the whole buffer: see `collectives`); `bus_bytes` =
size x bus factor is what each rank's link carries (ring algorithms).

Counted: the traffic of each technique of the plan, composed on one mesh (tensor innermost, then
context, data, pipeline):
- per micro-batch, per layer of the rank's pipeline stage: TP's four all-reduces (SP: all-gather +
  reduce-scatter in their place; a recomputed forward repeats its two), ring attention's K/V hops,
  expert dispatch and combine;
- per micro-batch: the pipeline's activation and gradient transfers, one of each per model chunk;
  ZeRO-2/3's gradient reduce-scatter (FSDP2 and ZeRO-3 also gather the parameters: once for forward,
  ZeRO-3 and FSDP2's full resharding again for backward);
- per step: the gradient reduction over the ranks that replicate a parameter (data x context
  parallel; experts over the data x context ranks that hold the same experts): an all-reduce
  (replicas, ZeRO-0; bucketed by hand when the plan says so), a reduce-scatter (ZeRO-1), and the
  updated parameters all-gathered (ZeRO-1/2).
Not counted: scalar all-reduces (loss, norms), TP's one-off gathers at the embedding and head, and
anything an implementation adds beyond the textbook algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlab.costs.collectives import bus_factor
from shardlab.costs.plan import Plan, Workload, micro_batches
from shardlab.costs.rank_memory import rank_layers, rank_parameters
from shardlab.costs.shapes import ModelShape

TP_COLLECTIVES_PER_LAYER = 4  # after attention and after the MLP (all-reduce, or all-gather + reduce-scatter), fwd and bwd
TP_COLLECTIVES_PER_RECOMPUTE = 2  # a recomputed forward repeats its two
CP_RING_PASSES_PER_LAYER = 3  # K/V around the ring in forward; K/V and their gradients in backward
EP_ALL_TO_ALLS_PER_LAYER = 4  # dispatch and combine, forward and backward


@dataclass(frozen=True)
class Call:
    collective: str
    size_bytes: float  # nccl-tests convention
    count: int  # per step (or per micro-batch, in `micro_batch_calls`), as issued by the busiest rank
    group_size: int
    purpose: str

    @property
    def bus_bytes(self) -> float:
        return self.count * self.size_bytes * bus_factor(self.collective, self.group_size) if self.group_size > 1 else 0.0


def gradient_bytes(plan: Plan) -> int:
    """Bytes a gradient value travels in: DeepSpeed's bf16 reduces bf16 gradients; replicas under
    autocast and Megatron's main gradients are fp32, and so is FSDP2's reduction under the mixed
    precision this project and torchtitan configure (MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32); FSDP1's "DEFAULT" policy in llm-foundry is the same)."""
    return 2 if plan.dtype != "fp32" and plan.framework in ("deepspeed", "mcore") else 4


def parameter_bytes(plan: Plan) -> int:
    """Bytes a gathered parameter travels in: the compute dtype (FSDP2 casts its fp32 shards to
    `param_dtype` before the all-gather)."""
    return plan.value_bytes


def activation_message(model: ModelShape, plan: Plan, workload: Workload) -> float:
    """Bytes of one micro-batch's hidden states on one rank (its context shard, whole over TP)."""
    return plan.micro_batch * workload.seq_len / plan.cp * model.hidden_size * plan.value_bytes


def kv_message(model: ModelShape, plan: Plan, workload: Workload) -> float:
    """Bytes of one ring-attention hop: the K and V of a rank's tokens and heads."""
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    return 2 * tokens * model.kv_width / plan.tp * plan.value_bytes


def tp_calls(model: ModelShape, plan: Plan, workload: Workload, layers: int) -> list[Call]:
    """TP's collectives of `layers` layers for one micro-batch: four all-reduces a layer (SP: an
    all-gather and a reduce-scatter in place of each), two more for a recomputed forward."""
    if plan.tp == 1:
        return []
    act = activation_message(model, plan, workload)
    n = TP_COLLECTIVES_PER_LAYER // 2 * layers
    again = {"full": TP_COLLECTIVES_PER_RECOMPUTE, "op": 1}.get(plan.recompute, 0) * layers  # op saves the reduce-scatters
    if plan.sp:
        return [Call(c, act, count, plan.tp, f"SP {when} {c.replace('_', '-')}")
                for when, count in (("forward", n), ("backward", n), ("recomputed", again))
                for c in ("all_gather", "reduce_scatter")]
    return [Call("all_reduce", act, count, plan.tp, f"TP {when} all-reduce")
            for when, count in (("forward", n), ("backward", n), ("recomputed", again))]


def cp_calls(model: ModelShape, plan: Plan, workload: Workload, layers: int) -> list[Call]:
    """Ring attention's K/V hops of `layers` layers for one micro-batch: cp - 1 a layer in forward,
    twice as many in backward (K/V and their gradients)."""
    if plan.cp == 1:
        return []
    hops, kv = (plan.cp - 1) * layers, kv_message(model, plan, workload)
    return [Call("sendrecv", kv, hops, plan.cp, "CP K/V ring (forward)"),
            Call("sendrecv", kv, (CP_RING_PASSES_PER_LAYER - 1) * hops, plan.cp, "CP K/V and dK/dV ring (backward)")]


def ep_calls(model: ModelShape, plan: Plan, workload: Workload, layers: int) -> list[Call]:
    """Expert dispatch and combine of `layers` layers for one micro-batch, forward and backward: each
    token's top_k copies (under SP, of the rank's sequence shard)."""
    if plan.ep == 1 or not model.num_experts:
        return []
    routed = activation_message(model, plan, workload) * model.top_k / (plan.tp if plan.sp else 1)
    n = EP_ALL_TO_ALLS_PER_LAYER // 2 * layers
    return [Call("all_to_all", routed, n, plan.ep, f"EP dispatch + combine ({when})") for when in ("forward", "backward")]


def pipeline_calls(model: ModelShape, plan: Plan, workload: Workload) -> list[Call]:
    """Per micro-batch, each of a rank's model chunks receives (or sends) one activation forward and
    one gradient backward; each TP rank moves its 1/tp slice (Narayanan et al. 2021's scatter/gather,
    under SP the slice is what the rank holds)."""
    if plan.pp == 1:
        return []
    msg = activation_message(model, plan, workload) / plan.tp
    return [Call("sendrecv", msg, plan.virtual_stages, plan.pp, "PP activation (forward)"),
            Call("sendrecv", msg, plan.virtual_stages, plan.pp, "PP activation gradient (backward)")]


def sharded_per_micro_batch(plan: Plan) -> bool:
    """Whether gradients are reduce-scattered every micro-batch (ZeRO-2/3, FSDP2), not once per step
    (ZeRO-1 and Megatron's distributed optimizer, which accumulate locally first)."""
    return plan.zero >= 2


def parameter_gathers(plan: Plan) -> int:
    """How often per micro-batch the plan all-gathers its sharded parameters: ZeRO-3 and FSDP2's full
    resharding for forward and again for backward, FSDP2 keeping them from forward to backward once."""
    return 2 if plan.zero == 3 else 1 if plan.framework == "fsdp2" else 0


def micro_batch_sync(plan: Plan, params: float, group: int) -> list[Call]:
    """Per micro-batch, ZeRO-2/3 and FSDP2 reduce-scatter the gradients of `params` as backward makes
    them, and gather the sharded parameters (`parameter_gathers`)."""
    if group < 2 or not params or not sharded_per_micro_batch(plan):
        return []
    gathers = parameter_gathers(plan)
    when = "(forward, backward)" if gathers == 2 else "(forward)"
    return [*([Call("all_gather", params * parameter_bytes(plan), gathers, group, f"parameter all-gather {when}")]
              if gathers else []),
            Call("reduce_scatter", params * gradient_bytes(plan), 1, group, "gradient reduce-scatter")]


def step_sync(plan: Plan, params: float, group: int, model: ModelShape | None = None) -> list[Call]:
    """Once per step: the gradient all-reduce (replicas, ZeRO-0; per bucket with `model`) or
    reduce-scatter (ZeRO-1), and DeepSpeed ZeRO-1/2's gather of the updated parameters."""
    if group < 2 or not params:
        return []
    if plan.zero == 0:
        return all_reduce_calls(plan, params, group, model)
    once = not sharded_per_micro_batch(plan)
    calls = [Call("reduce_scatter", params * gradient_bytes(plan), 1, group, "gradient reduce-scatter")] if once else []
    if plan.zero in (1, 2) and not parameter_gathers(plan):
        calls.append(Call("all_gather", params * parameter_bytes(plan), 1, group, "parameter all-gather"))
    return calls


def gradient_groups(model: ModelShape) -> list[int]:
    """Parameters of each per-layer gradient group in the order backward finishes them: LM head,
    final LayerNorm, the layers from last to first, the embedding (strategies.data_parallel.comms)."""
    return [model.hidden_size * model.vocab_size, 2 * model.hidden_size,
            *[model.layer_parameters()] * model.num_layers, model.embedding_parameters()]


def pack_buckets(sizes: list[int], cap: float | None) -> list[list[int]]:
    """Consecutive groups merged while a bucket stays within `cap` (same unit as `sizes`; a group larger
    than the cap stays alone); None: one bucket per group. Returns the group indices of each bucket."""
    buckets: list[list[int]] = []
    for i, size in enumerate(sizes):
        if cap is not None and buckets and sum(sizes[j] for j in buckets[-1]) + size <= cap:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def all_reduce_calls(plan: Plan, params: float, group: int, model: ModelShape | None = None) -> list[Call]:
    """One all-reduce of every gradient (DDP's buckets sum to it), or, with `grad_bucket_mb` and the
    whole model on the rank, one per bucket of layers (0: one per layer group): the same bytes, one
    latency per bucket."""
    size = gradient_bytes(plan)
    if plan.grad_bucket_mb is None or model is None:
        return [Call("all_reduce", params * size, 1, group, "gradient all-reduce")]
    sizes = [n * size for n in gradient_groups(model)]
    buckets = [sum(sizes[i] for i in b) for b in pack_buckets(sizes, plan.grad_bucket_mb * 2**20 or None)]
    return [Call("all_reduce", b, buckets.count(b), group, "gradient all-reduce, one per bucket")
            for b in dict.fromkeys(buckets)]


def busiest_stage(model: ModelShape, plan: Plan) -> int:
    """The pipeline rank holding the most parameters (ties: the first)."""
    return max(range(plan.pp), key=lambda r: sum(rank_parameters(model, plan, r)))


def micro_batch_calls(model: ModelShape, plan: Plan, workload: Workload, stage: int) -> list[Call]:
    """Everything pipeline rank `stage` issues per micro-batch."""
    dense, experts = rank_parameters(model, plan, stage)
    layers = rank_layers(model.num_layers, plan.pp, plan.virtual_stages)[stage]
    return [*tp_calls(model, plan, workload, layers), *cp_calls(model, plan, workload, layers),
            *ep_calls(model, plan, workload, layers), *pipeline_calls(model, plan, workload),
            *micro_batch_sync(plan, dense, plan.dp * plan.cp),
            *micro_batch_sync(plan, experts, plan.dp * plan.cp // plan.ep)]


def step_sync_calls(model: ModelShape, plan: Plan, stage: int) -> list[Call]:
    """The once-per-step gradient reduction (and ZeRO-1/2 parameter gather) of pipeline rank `stage`."""
    dense, experts = rank_parameters(model, plan, stage)
    group = plan.dp * plan.cp
    whole = model if plan.tp == plan.pp == plan.ep == 1 and not model.num_experts else None  # for buckets
    return [*step_sync(plan, dense, group, whole), *step_sync(plan, experts, group // plan.ep)]


def step_calls(model: ModelShape, plan: Plan, workload: Workload) -> list[Call]:
    """The collectives the busiest rank issues in one optimizer step of `plan`."""
    stage = busiest_stage(model, plan)
    m = micro_batches(plan, workload)
    per_micro = [replace(c, count=c.count * m) for c in micro_batch_calls(model, plan, workload, stage)]
    return [c for c in [*per_micro, *step_sync_calls(model, plan, stage)] if c.count and c.group_size > 1]


def bytes_per_rank(plan: list[Call] | None) -> float | None:
    """Bytes each rank's link carries per step (the calls' bus bytes)."""
    return None if plan is None else float(sum(call.bus_bytes for call in plan))
