"""Step time of one pipeline rank under a plan: compute (GEMM FLOPs at the device's achieved rate,
element-wise HBM traffic), the communication each technique puts on the critical path, the
data-parallel gradient reduction, the optimizer step and offload transfers. Formulas only; the
composition into a step (micro-batches, fill and drain) is `costs.predict.evaluate`.
"""

from __future__ import annotations

from shardlab.costs import sharded_states
from shardlab.costs.collectives import bus_factor
from shardlab.costs.comm_volume import (CP_RING_PASSES_PER_LAYER, Call, cp_calls, ep_calls, pipeline_calls,
                                        micro_batch_sync, step_sync_calls, tp_calls)
from shardlab.costs.plan import Plan, Workload
from shardlab.costs.rank_memory import activation_layer_parts, rank_layers, rank_parameters
from shardlab.costs.shapes import ModelShape

CPU_ADAM_PARAMS_PER_S = 1e9  # per GPU's share of the host: an order-of-magnitude assumption, not measured
TIME_COMPONENTS = ("compute", "tp_comm", "cp_comm", "ep_comm", "zero_comm", "pp_p2p", "pp_bubble",
                   "dp_comm", "optimizer", "offload")


def collective_s(device: dict, collective: str, size_bytes: float, group: int, intra_node: bool,
                 rails: int = 1) -> float:
    """alpha + bus bytes / achieved bus bandwidth on the group's link: NVLink inside a node; across
    nodes the NICs of the group's `rails` ranks on each node, since NCCL's rings run one channel per
    NIC and forward inside the node over NVLink (so an 8-GPU-per-node data-parallel group all-gathers
    at 8 NICs' bandwidth, a group with one rank per node at one NIC's)."""
    if group < 2 or size_bytes <= 0:
        return 0.0
    fitted = device.get("alpha_beta", {}).get(collective)  # a machine calibrated by the comm benchmark
    if fitted is not None:
        return fitted.seconds_for(collective, size_bytes, group)
    if intra_node:
        beta = device["nvlink_gbps"] / 2 * 1e9 * device["link_intra_node"]  # per direction
        alpha = device["intra_node_latency_us"] * 1e-6
    else:
        beta = min(device["network_gbps"] * rails * device["link_inter_node"],
                   device["nvlink_gbps"] / 2 * device["link_intra_node"]) * 1e9
        alpha = device["inter_node_latency_us"] * 1e-6
    return alpha + size_bytes * bus_factor(collective, group) / beta


def calls_s(device: dict, calls: list[Call], intra_node: bool, rails: int = 1) -> float:
    """Seconds of a list of calls issued one after another (`costs.comm_volume`)."""
    return sum(c.count * collective_s(device, c.collective, c.size_bytes, c.group_size, intra_node, rails)
               for c in calls)


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


def attention_core_flops(model: ModelShape, plan: Plan, workload: Workload) -> float:
    """Forward FLOPs of one layer's attention core (scores and their product with V), one micro-batch,
    one rank: the full score matrix, as model FLOPs count it (MFU)."""
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    return 4 * tokens * workload.seq_len * model.hidden_size / plan.tp


def gemm_seconds(device: dict, peak: float, gemms: list[tuple[float, float]], tokens: float) -> float:
    """Seconds of `gemms` ((FLOPs, width) pairs), each at its own shape's achieved rate."""
    return sum(flops / (peak * gemm_efficiency(device, width, tokens)) for flops, width in gemms)


def attention_rate(device: dict, plan: Plan, workload: Workload, peak: float, gemm_s: float) -> float:
    """FLOP/s of the attention core (scores and their product with V, counted whole as model FLOPs
    count them): a fused kernel's own achieved share of peak where the catalog has one (it skips the
    causal half, and its backward recomputes the scores), else the GEMM rate (eager attention's batched
    matrix products). A fused kernel's rate halves at `flash_attention_half_keys` keys per call
    (Hockney again): short rows leave its inner loop little work per loaded query tile, and the causal
    diagonal's partly masked tiles are a larger share. A context-parallel ring calls it on seq / cp
    keys at a time."""
    if not (plan.attention in ("flash", "sdpa") and "flash_attention" in device):
        return gemm_s
    keys = workload.seq_len / plan.cp
    return peak * device["flash_attention"] * keys / (keys + device.get("flash_attention_half_keys", 0.0))


def stage_times(model: ModelShape, plan: Plan, workload: Workload, device: dict, rank: int, dropout: bool) -> dict:
    """Seconds of pipeline rank `rank` per micro-batch, by component (forward + backward)."""
    peak = device["fp32_tflops" if plan.dtype == "fp32" else "bf16_tflops"] * 1e12
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    hbm_s = device["hbm_tbps"] * 1e12 * device["hbm"]
    layers = rank_layers(model.num_layers, plan.pp, plan.virtual_stages)[rank]
    gemms = layer_gemms(model, plan, workload)
    gemm_time = gemm_seconds(device, peak, gemms, tokens)
    core = attention_core_flops(model, plan, workload)
    # eager attention's batched products run at the layer's mean GEMM rate
    gemm_s = sum(flops for flops, _ in gemms) / gemm_time
    passes = {"none": 3, "selective": 3, "full": 4}[plan.recompute]  # forward, backward (2x), recompute
    core_flops = passes * core + (core if plan.recompute == "selective" else 0)
    core_s = attention_rate(device, plan, workload, peak, gemm_s)
    # Element-wise kernels (norms, GeLU, softmax, dropout, residual adds) move bytes in proportion to
    # what a layer stores; full recompute reruns all of them, selective the attention core's.
    stored = activation_layer_parts(model, plan, workload, recompute="none", dropout=dropout)
    rerun = {"none": 0.0, "selective": stored["attention_core"], "full": sum(stored.values())}[plan.recompute]
    elementwise = (sum(stored.values()) + rerun) * device["elementwise_passes"]
    compute = layers * (passes * gemm_time + core_flops / core_s + elementwise / hbm_s)
    if rank == plan.pp - 1:  # the LM head: hidden x vocabulary / tp
        head = [(2 * tokens * model.hidden_size * model.vocab_size / plan.tp, model.hidden_size)]
        compute += 3 * gemm_seconds(device, peak, head, tokens)

    per_node, hide = device["gpus_per_node"], device["overlap"]
    tp = calls_s(device, tp_calls(model, plan, workload, layers), True)
    ring = calls_s(device, cp_calls(model, plan, workload, layers), plan.tp * plan.cp <= per_node)
    cp = max(0.0, ring - hide * CP_RING_PASSES_PER_LAYER * layers * core / core_s)  # overlapped with attention math
    ep = calls_s(device, ep_calls(model, plan, workload, layers), plan.tp * plan.ep <= per_node)
    group, intra, rails = _dp_group(plan, device)
    dense, experts = rank_parameters(model, plan, rank)
    sharded = [*micro_batch_sync(plan, dense, group), *micro_batch_sync(plan, experts, group // plan.ep)]
    zero = max(0.0, calls_s(device, sharded, intra, rails) - hide * compute)  # overlapped with the micro-batch
    p2p = calls_s(device, pipeline_calls(model, plan, workload), plan.tp * plan.cp * plan.dp < per_node)
    return {"compute": compute, "tp_comm": tp, "cp_comm": cp, "ep_comm": ep, "zero_comm": zero, "pp_p2p": p2p}


def _dp_group(plan: Plan, device: dict) -> tuple[int, bool, int]:
    """The data-parallel (x context-parallel) group that shards and reduces: its size, whether it fits
    in one node, and how many of its ranks share each node (tensor ranks are innermost)."""
    group, per_node = plan.dp * plan.cp, device["gpus_per_node"]
    return group, plan.tp * group <= per_node, max(1, min(group, per_node // plan.tp))


def gradient_sync_s(model: ModelShape, plan: Plan, device: dict, rank: int, backward_s: float) -> float:
    """Once per step (`comm_volume.step_sync_calls`): the gradient all-reduce (ZeRO-0, replicas) or
    reduce-scatter (ZeRO-1, Megatron's distributed optimizer) overlaps the last micro-batch's backward;
    the updated parameters' all-gather (ZeRO-1/2) is hidden by nothing."""
    calls = step_sync_calls(model, plan, rank)
    _, intra, rails = _dp_group(plan, device)
    gathered = calls_s(device, [c for c in calls if c.collective == "all_gather"], intra, rails)
    overlapped = calls_s(device, [c for c in calls if c.collective != "all_gather"], intra, rails)
    return max(0.0, overlapped - device["overlap"] * backward_s) + gathered


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
