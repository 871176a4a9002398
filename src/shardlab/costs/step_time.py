"""Step time of one pipeline rank under a plan: compute (GEMM FLOPs at the stack's achieved rate,
the attention kernel, element-wise HBM traffic), the communication each technique leaves on the
critical path, the data-parallel gradient reduction, the optimizer step and offload transfers.
Formulas only; the composition into a step (micro-batches, fill and drain) is `costs.predict`.

Communication is costed per collective as NCCL runs it (`costs.nccl`), over the group's span of
nodes. What hides behind what follows the schedule the stack runs, not a fitted overlap factor;
on hardware whose collectives share the compute's cores (`comm_overlaps_compute: false`, a CPU
with gloo) nothing hides:
- a ZeRO-3 / FSDP layer's parameter all-gather behind the previous layer's compute (prefetch one
  layer ahead), in forward and again in backward, together with the gradient reduce-scatter of the
  layer after it; the first gather and the last reduce-scatter of a pass are exposed;
- the once-per-step gradient reduction behind the last micro-batch's backward where the stack
  overlaps it (DDP buckets, Megatron's overlap_grad_sync), and the distributed optimizer's
  parameter all-gather behind the next step's first forward (overlap_param_sync);
- tensor-parallel collectives are exposed unless the plan overlaps them with the GEMMs (Transformer
  Engine's userbuffers, async TP: `tp_overlap`), then only what exceeds the layer's GEMMs;
- ring attention's K/V hops behind the attention blocks they feed;
- pipeline sends are exposed unless the stack overlaps them in the interleaved schedule;
- expert all-to-alls are exposed.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from shardlab.costs import nccl, sharded_states
from shardlab.costs.comm_volume import (CP_RING_PASSES_PER_LAYER, Call, cp_calls, ep_calls, gradient_bytes,
                                        parameter_bytes, pipeline_calls, sharded_per_micro_batch, step_sync_calls,
                                        tp_calls)
from shardlab.costs.hardware import peak_flops
from shardlab.costs.nccl import Span
from shardlab.costs.plan import Plan, Workload
from shardlab.costs.rank_memory import activation_layer_parts, layer_parameters_on_rank, pipeline_ranks, rank_parameters
from shardlab.costs.shapes import ModelShape

CPU_ADAM_PARAMS_PER_S = 1e9  # per GPU's share of the host: an order-of-magnitude assumption, not measured
TIME_COMPONENTS = ("compute", "tp_comm", "cp_comm", "ep_comm", "zero_comm", "pp_p2p", "pp_bubble",
                   "dp_comm", "optimizer", "offload")


def calls_s(device: dict, calls: list[Call], span: Span) -> float:
    """Seconds of a list of calls issued one after another over `span` (calls of the same collective and
    size costed once)."""
    if span.ranks < 2 or not calls:
        return 0.0
    efficiency = device.get("collective_efficiency", 1.0)
    counts: dict[tuple, int] = {}
    for c in calls:
        counts[c.collective, c.size_bytes] = counts.get((c.collective, c.size_bytes), 0) + c.count
    return sum(n * nccl.seconds(device, collective, size, span, efficiency) for (collective, size), n in counts.items())


# --- compute ------------------------------------------------------------------------------------------
def gemm_efficiency(device: dict, width: float, tokens: float) -> float:
    """Achieved/peak throughput of a GEMM whose weight shard's narrower side is `width`, on a
    micro-batch of `tokens`: Hockney's half-performance form in each, gemm x width / (width +
    gemm_half_width) x tokens / (tokens + gemm_half_tokens). Narrow shards leave tensor cores idle
    (tile and wave quantisation, operand traffic); small micro-batches pay the per-kernel and
    per-module costs (launches, framework hooks) on less work."""
    half_width, half_tokens = device.get("gemm_half_width", 0.0), device.get("gemm_half_tokens", 0.0)
    return device["gemm"] * width / (width + half_width) * tokens / (tokens + half_tokens)


def layer_gemms(model: ModelShape, plan: Plan, workload: Workload) -> list[tuple[float, float]]:
    """(forward FLOPs, narrower side of the weight shard) of each GEMM of one layer, one micro-batch,
    one rank. Tensor parallelism splits the output side of column-parallel matrices (QKV, MLP up and
    gate) and the input side of row-parallel ones (attention output, MLP down), so under TP8 a
    Llama-3-405B layer multiplies by 16384 x 2304 and 2048 x 16384 attention shards but 16384 x 6656
    MLP shards: most of its FLOPs stay on wide matrices."""
    h, t, kv = model.hidden_size, plan.tp, model.kv_width
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    width = model.expert_intermediate or model.intermediate_size
    copies = model.top_k if model.num_experts else 1  # a token passes through top_k experts
    shards = [(h, (h + 2 * kv) / t, 1), (h / t, h, 1),  # QKV, attention output
              (h, width / t, copies * (model.mlp_matrices - 1)), (width / t, h, copies)]  # up (and gate), down
    if model.num_experts:
        shards.append((h, model.num_experts, 1))  # the router, not split
    return [(2 * tokens * rows * cols * count, min(rows, cols)) for rows, cols, count in shards]


def op_recomputed_share(model: ModelShape) -> float:
    """The share of a layer's forward matrix-product FLOPs per-op checkpointing runs again: the
    products it does not save (K, the attention output, and the MLP's second product: SwiGLU's up,
    GeLU's down; activations._per_op_saved)."""
    h, kv, width = model.hidden_size, model.kv_width, model.expert_intermediate or model.intermediate_size
    total = h * (h + 2 * kv) + h * h + model.mlp_matrices * h * width
    return (h * kv + h * h + h * width) / total


def attention_core_flops(model: ModelShape, plan: Plan, workload: Workload) -> float:
    """Forward FLOPs of one layer's attention core (scores and their product with V), one micro-batch,
    one rank: the full score matrix, as model FLOPs count it (MFU)."""
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    return 4 * tokens * workload.seq_len * model.hidden_size / plan.tp


def gemm_seconds(device: dict, peak: float, gemms: list[tuple[float, float]], tokens: float) -> float:
    """Seconds of `gemms` ((FLOPs, width) pairs), each at its own shape's achieved rate."""
    return sum(flops / (peak * gemm_efficiency(device, width, tokens)) for flops, width in gemms)


def attention_rate(device: dict, plan: Plan, workload: Workload, peak: float, gemm_s: float) -> float:
    """FLOP/s of the attention core (counted whole, as model FLOPs count it): a fused kernel's own
    achieved share of peak, halved at `flash_attention_half_keys` keys per call; else the GEMMs' rate
    (eager attention's batched matrix products). A context-parallel ring balances the causal work by
    giving each rank two chunks of seq / (2 cp) tokens (Megatron-Core's and torchtitan's layout), so its
    kernel calls see that many keys."""
    if plan.attention not in ("flash", "sdpa"):
        return gemm_s
    keys = workload.seq_len / (2 * plan.cp if plan.cp > 1 else 1)
    return peak * device["flash_attention"] * keys / (keys + device.get("flash_attention_half_keys", 0.0))


class LayerTimes(NamedTuple):
    """Seconds of one layer for one micro-batch on one rank."""

    forward: float
    backward: float  # with what recompute runs again
    gemm: float  # the matrix products of all passes: what overlapped TP collectives hide behind
    attention: float  # the attention core's forward: what one pass of ring attention's K/V hops hides behind


def layer_compute(model: ModelShape, plan: Plan, workload: Workload, device: dict) -> LayerTimes:
    """A layer's compute (`LayerTimes`), memoised in the device's figures: a search times the same layer
    under many shardings and pipelines."""
    memo = device.setdefault("_layer_compute", {})
    key = (model, workload, plan.micro_batch, plan.tp, plan.cp, plan.ep, plan.sp, plan.sp_gathered_inputs,
           plan.activation_precision, plan.attention, plan.recompute, plan.dtype)
    if key not in memo:
        memo[key] = _layer_compute(model, plan, workload, device)
    return memo[key]


def _layer_compute(model: ModelShape, plan: Plan, workload: Workload, device: dict) -> LayerTimes:
    peak = peak_flops(device, plan.dtype)
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    hbm = device["hbm_tbps"] * 1e12 * device["hbm"]
    gemms = layer_gemms(model, plan, workload)
    gemm = gemm_seconds(device, peak, gemms, tokens)
    core = attention_core_flops(model, plan, workload) / attention_rate(
        device, plan, workload, peak, sum(f for f, _ in gemms) / gemm)
    # Element-wise kernels (norms, activations, softmax, dropout, residual adds) move bytes in proportion
    # to what a layer stores: a third of the passes in forward, two thirds in backward.
    stored = sum(activation_layer_parts(model, plan, workload, recompute="none").values())
    elementwise = stored * device["elementwise_passes"] / hbm
    gemm_again = {"op": op_recomputed_share(model), "full": 1.0}.get(plan.recompute, 0.0) * gemm
    again = gemm_again + {"selective": core, "full": core}.get(plan.recompute, 0.0) + (
        elementwise / 3 if plan.recompute in ("op", "full") else 0.0)
    return LayerTimes(forward=gemm + core + elementwise / 3, backward=2 * gemm + 2 * core + 2 * elementwise / 3 + again,
                      gemm=3 * gemm + gemm_again, attention=core)


def head_compute(model: ModelShape, plan: Plan, workload: Workload, device: dict) -> float:
    """Forward + backward seconds of the LM head (hidden x vocabulary / tp) for one micro-batch."""
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    head = [(2 * tokens * model.hidden_size * model.vocab_size / plan.tp, model.hidden_size)]
    return 3 * gemm_seconds(device, peak_flops(device, plan.dtype), head, tokens)


# --- where groups sit ---------------------------------------------------------------------------------
def spans(plan: Plan, device: dict) -> dict[str, Span]:
    """The span of each group of the mesh (Megatron's order, innermost first: tp, cp, dp, pp)."""
    return _spans(plan.tp, plan.cp, plan.dp, plan.ep, plan.pp, device["gpus_per_node"])


@lru_cache(maxsize=4096)
def _spans(tp: int, cp: int, dp: int, ep: int, pp: int, per_node: int) -> dict[str, Span]:
    return {"tp": Span.of(tp, 1, per_node), "cp": Span.of(cp, tp, per_node),
            "dp": Span.of(dp * cp, tp, per_node),  # gradients reduce over dp x cp
            "ep": Span.of(ep, tp, per_node), "pp": Span.of(pp, tp * cp * dp, per_node)}


# --- ZeRO-3 / FSDP: per layer, behind the compute -----------------------------------------------------
def gather_sizes(model: ModelShape, plan: Plan, device: dict) -> list[float]:
    """Parameters of each all-gather call that fetches one layer's shard on this rank: one call per layer
    (a flat parameter per block), per module with parameters, or per parameter tensor (the stack's
    `gathers_per_layer`)."""
    dense, experts = layer_parameters_on_rank(model, plan.tp, plan.ep)
    whole = dense + experts
    mode = device.get("gathers_per_layer", 1)
    if mode in ("modules", "tensors"):
        h, width, bias = model.hidden_size, model.expert_intermediate or model.intermediate_size, model.biases
        norm = (2 if bias else 1) * h
        linear = [h * (h + 2 * model.kv_width), h * h, *[h * width] * model.mlp_matrices]
        biases = [h + 2 * model.kv_width, h, *[width] * (model.mlp_matrices - 1), h] if bias else []
        if mode == "modules":
            parts = [norm, norm, *(w + b for w, b in zip(linear, biases or [0] * len(linear)))]
        else:
            parts = [*[h] * (4 if bias else 2), *linear, *biases]
        scale = whole / sum(parts)
        return [p * scale for p in parts]
    return [whole / mode] * int(mode)


def zero_per_micro_batch(model: ModelShape, plan: Plan, device: dict, spans_: dict, layers: int, edge_params: float,
                         forward: float, backward: float) -> float:
    """Exposed seconds of ZeRO-2/3 and FSDP's per-micro-batch communication on a rank of `layers`
    layers: parameter all-gathers (forward, backward, and again for a recomputed forward where the
    stack re-fetches) and gradient reduce-scatters, each layer's behind the neighbouring layer's
    compute; `edge_params` (embedding, head) gathered and reduced with nothing to hide behind."""
    if not sharded_per_micro_batch(plan) or spans_["dp"].ranks < 2:
        return 0.0
    span, efficiency = spans_["dp"], device.get("collective_efficiency", 1.0)
    g = 0.0
    if plan.zero == 3 or plan.framework == "fsdp2":
        g = sum(nccl.seconds(device, "all_gather", n * parameter_bytes(plan), span, efficiency)
                for n in gather_sizes(model, plan, device))
    dense, experts = layer_parameters_on_rank(model, plan.tp, plan.ep)
    rs = nccl.seconds(device, "reduce_scatter", (dense + experts) * gradient_bytes(plan), span, efficiency)
    g_back = g if plan.zero == 3 else 0.0
    if plan.zero == 3 and plan.recompute == "full" and device.get("regather_for_recompute"):
        g_back *= 2
    edges = 0.0  # the embedding and the head: gathered as the layers are, reduced once
    if edge_params:
        passes = (g > 0) + (g_back > 0)
        edges = passes * nccl.seconds(device, "all_gather", edge_params * parameter_bytes(plan), span, efficiency)
        edges += nccl.seconds(device, "reduce_scatter", edge_params * gradient_bytes(plan), span, efficiency)
    if not device["comm_overlaps_compute"]:
        return layers * (g + g_back + rs) + edges
    ahead = g + (layers - 1) * max(0.0, g - forward)
    behind = g_back + (layers - 1) * max(0.0, g_back + rs - backward) + rs
    return ahead + behind + edges


# --- a pipeline rank's micro-batch ----------------------------------------------------------------------
def stage_times(model: ModelShape, plan: Plan, workload: Workload, device: dict, rank: int) -> dict:
    """Seconds of pipeline rank `rank` per micro-batch, by component (forward + backward), and the
    forward and backward compute of the micro-batch (keys `_forward`, `_backward`) the step's
    once-per-step communication can hide behind."""
    layers, embedding, head = pipeline_ranks(model.num_layers, plan.pp, plan.virtual_stages)[rank]
    layer = layer_compute(model, plan, workload, device)
    compute = layers * (layer.forward + layer.backward) + (head_compute(model, plan, workload, device) if head else 0.0)
    spans_ = spans(plan, device)
    overlaps = device["comm_overlaps_compute"]

    tp = calls_s(device, tp_calls(model, plan, workload, layers), spans_["tp"])
    if plan.tp_overlap and overlaps:
        tp = max(0.0, tp - layers * layer.gemm)
    cp = calls_s(device, cp_calls(model, plan, workload, layers), spans_["cp"])
    if overlaps and device.get("cp_overlap", True):  # K/V hops behind the blocks' attention, fwd + bwd
        cp = max(0.0, cp - CP_RING_PASSES_PER_LAYER * layers * layer.attention)
    ep = calls_s(device, ep_calls(model, plan, workload, layers), spans_["ep"])
    dense, experts = rank_parameters(model, plan, rank)
    layer_dense, layer_experts = layer_parameters_on_rank(model, plan.tp, plan.ep)
    edge = max(0.0, dense + experts - layers * (layer_dense + layer_experts))
    zero = zero_per_micro_batch(model, plan, device, spans_, layers, edge, layer.forward, layer.backward)
    p2p = calls_s(device, pipeline_calls(model, plan, workload), spans_["pp"])
    if device.get("p2p_overlap") and plan.schedule == "interleaved" and overlaps:
        p2p = 0.0
    return {"compute": compute, "tp_comm": tp, "cp_comm": cp, "ep_comm": ep, "zero_comm": zero, "pp_p2p": p2p,
            "_forward": layers * layer.forward, "_backward": layers * layer.backward}


def gradient_sync_s(model: ModelShape, plan: Plan, device: dict, rank: int, forward_s: float, backward_s: float) -> float:
    """Exposed seconds of the once-per-step communication (`comm_volume.step_sync_calls`): the gradient
    all-reduce (replicas) or reduce-scatter (ZeRO-1, the distributed optimizer) behind the last
    micro-batch's backward where the stack overlaps it; the updated parameters' all-gather (ZeRO-1/2,
    the distributed optimizer) behind the next step's first forward where it overlaps that, else exposed."""
    calls = step_sync_calls(model, plan, rank)
    span = spans(plan, device)["dp"]
    gathered = calls_s(device, [c for c in calls if c.collective == "all_gather"], span)
    reduced = calls_s(device, [c for c in calls if c.collective != "all_gather"], span)
    if not device["comm_overlaps_compute"]:
        return reduced + gathered
    if device.get("grad_sync_overlap") if plan.grad_sync_overlap is None else plan.grad_sync_overlap:
        reduced = max(0.0, reduced - backward_s)
    if device.get("param_gather_overlap"):
        gathered = max(0.0, gathered - forward_s)
    return reduced + gathered


def optimizer_s(plan: Plan, device: dict, states: sharded_states.ModelStates) -> tuple[float, float]:
    """(on-device optimizer step, offload transfer + CPU Adam) seconds: the step reads and writes
    every model-state byte the rank holds once."""
    hbm = device["hbm_tbps"] * 1e12 * device["hbm"]
    device_bytes = states.total_bytes - states.offloaded_bytes
    step = 2 * device_bytes / hbm
    offload = 0.0
    if plan.offload != "none":
        moved = states.grad_bytes + states.param_bytes  # gradients down, updated parameters up
        params = states.optimizer_bytes / (sharded_states.MOMENT_BYTES[plan.optimizer] + 4)
        offload = moved / (device["host_link_gbps"] * 1e9) + params / CPU_ADAM_PARAMS_PER_S
    return step, offload

