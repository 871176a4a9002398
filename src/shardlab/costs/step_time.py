"""Step time of one pipeline rank under a plan: compute (GEMM FLOPs at the device's achieved rate,
element-wise HBM traffic), the communication each technique puts on the critical path, the
data-parallel gradient reduction, the optimizer step and offload transfers. Formulas only; the
composition into a step (micro-batches, fill and drain) is `costs.predict.evaluate`.
"""

from __future__ import annotations

from shardlab.costs import memory
from shardlab.costs.collectives import bus_factor
from shardlab.costs.comm_volume import (CP_RING_PASSES_PER_LAYER, EP_ALL_TO_ALLS_PER_LAYER, TP_COLLECTIVES_PER_LAYER,
                                        TP_COLLECTIVES_PER_RECOMPUTE, kv_message)
from shardlab.costs.plan import Plan, Workload
from shardlab.costs.rank_memory import activation_layer_parts, rank_layers
from shardlab.costs.shapes import ModelShape

CPU_ADAM_PARAMS_PER_S = 1e9  # per GPU's share of the host: an order-of-magnitude assumption, not measured
TIME_COMPONENTS = ("compute", "tp_comm", "cp_comm", "ep_comm", "zero_comm", "pp_p2p", "pp_bubble",
                   "dp_comm", "optimizer", "offload")


def collective_s(device: dict, collective: str, size_bytes: float, group: int, intra_node: bool) -> float:
    """alpha + bus bytes / achieved bus bandwidth on the group's link (NVLink inside a node, the
    per-GPU NIC across nodes)."""
    if group < 2 or size_bytes <= 0:
        return 0.0
    fitted = device.get("alpha_beta", {}).get(collective)  # a machine calibrated by the comm benchmark
    if fitted is not None:
        return fitted.seconds_for(collective, size_bytes, group)
    if intra_node:
        beta, alpha = device["nvlink_gbps"] / 2 * 1e9, device["intra_node_latency_us"] * 1e-6  # per direction
    else:
        beta, alpha = device["network_gbps"] * 1e9, device["inter_node_latency_us"] * 1e-6
    return alpha + size_bytes * bus_factor(collective, group) / (beta * device["link"])


def gemm_efficiency(device: dict, width: float) -> float:
    """Achieved/peak GEMM throughput at a per-rank matrix width (hidden / tp): Hockney's
    half-performance form, gemm x width / (width + gemm_half_width). Narrow shards leave tensor cores
    idle (tile and wave quantisation, operand traffic)."""
    return device["gemm"] * width / (width + device.get("gemm_half_width", 0.0))


def layer_flops(model: ModelShape, plan: Plan, workload: Workload) -> tuple[float, float]:
    """(GEMM, attention-core) forward FLOPs of one layer, one micro-batch, one rank."""
    h, t = model.hidden_size, plan.tp
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    width = model.expert_intermediate or model.intermediate_size
    attention_linear = h * (h + 2 * model.kv_width) + h * h
    if model.num_experts:
        mlp = model.top_k * model.mlp_matrices * h * width + h * model.num_experts * t  # router not split
    else:
        mlp = model.mlp_matrices * h * model.intermediate_size
    gemm = 2 * tokens * (attention_linear + mlp) / t
    core = 4 * tokens * workload.seq_len * h / t  # the full score matrix, as model FLOPs count it (MFU)
    return gemm, core


def stage_times(model: ModelShape, plan: Plan, workload: Workload, device: dict, rank: int,
                layer_params: float, dropout: bool) -> dict:
    """Seconds of pipeline rank `rank` per micro-batch, by component (forward + backward)."""
    peak = device["fp32_tflops" if plan.dtype == "fp32" else "bf16_tflops"] * 1e12
    gemm_s, hbm_s = peak * gemm_efficiency(device, model.hidden_size / plan.tp), device["hbm_tbps"] * 1e12 * device["hbm"]
    layers = rank_layers(model.num_layers, plan.pp, plan.virtual_stages)[rank]
    gemm, core = layer_flops(model, plan, workload)
    passes = {"none": 3, "selective": 3, "full": 4}[plan.recompute]  # forward, backward (2x), recompute
    flops = passes * gemm + passes * core + (core if plan.recompute == "selective" else 0)
    # Element-wise kernels (norms, GeLU, softmax, dropout, residual adds) move bytes in proportion to
    # what a layer stores; full recompute reruns all of them, selective the attention core's.
    stored = activation_layer_parts(model, plan, workload, recompute="none", dropout=dropout)
    rerun = {"none": 0.0, "selective": stored["attention_core"], "full": sum(stored.values())}[plan.recompute]
    elementwise = (sum(stored.values()) + rerun) * device["elementwise_passes"]
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    compute = layers * (flops / gemm_s + elementwise / hbm_s)
    if rank == plan.pp - 1:
        compute += 3 * 2 * tokens * model.hidden_size * model.vocab_size / plan.tp / gemm_s

    act = tokens * model.hidden_size * plan.value_bytes
    per_node = device["gpus_per_node"]
    tp_calls = TP_COLLECTIVES_PER_LAYER + (TP_COLLECTIVES_PER_RECOMPUTE if plan.recompute == "full" else 0)
    tp = layers * tp_calls * collective_s(device, "all_reduce", act, plan.tp, True)
    kv = kv_message(tokens, model.kv_width, plan.value_bytes) / plan.tp
    ring_passes = CP_RING_PASSES_PER_LAYER * layers
    ring = ring_passes * (plan.cp - 1) * collective_s(device, "sendrecv", kv, plan.cp, plan.tp * plan.cp <= per_node)
    hide = device["overlap"]
    cp = max(0.0, ring - hide * ring_passes * core / gemm_s)  # ring attention overlaps the transfer with attention math
    ep = 0.0
    if model.num_experts and plan.ep > 1:
        routed = act * model.top_k / (plan.tp if plan.sp else 1)
        ep = layers * EP_ALL_TO_ALLS_PER_LAYER * collective_s(device, "all_to_all", routed, plan.ep,
                                                             plan.tp * plan.ep <= per_node)
    zero = max(0.0, sharded_data_parallel_s(plan, device, layer_params * layers) - hide * compute)  # overlapped
    p2p = 0.0
    if plan.pp > 1:
        stride_intra = plan.tp * plan.cp * plan.dp < per_node
        msg = act / plan.tp  # each TP rank sends its 1/tp slice (Narayanan et al. 2021's scatter/gather)
        p2p = 2 * plan.virtual_stages * collective_s(device, "sendrecv", msg, 2, stride_intra)
    return {"compute": compute, "tp_comm": tp, "cp_comm": cp, "ep_comm": ep, "zero_comm": zero, "pp_p2p": p2p}


def _dp_group(plan: Plan, device: dict) -> tuple[int, bool]:
    """The data-parallel (x context-parallel) group that shards and reduces: size, inside one node?"""
    return plan.dp * plan.cp, plan.tp * plan.cp * plan.dp <= device["gpus_per_node"]


def _grad_bytes(plan: Plan) -> int:
    return 4 if plan.framework in ("megatron", "fsdp2") or plan.dtype == "fp32" else 2


def sharded_data_parallel_s(plan: Plan, device: dict, params: float) -> float:
    """Per micro-batch, ZeRO-2/3 and FSDP reduce-scatter the gradients of `params` as backward makes
    them, and ZeRO-3/FSDP all-gather the parameters again for forward and for backward."""
    if plan.zero < 2:
        return 0.0
    group, intra = _dp_group(plan, device)
    weight = 4 if plan.dtype == "fp32" or plan.framework == "fsdp2" else 2
    seconds = collective_s(device, "reduce_scatter", params * _grad_bytes(plan), group, intra)
    if plan.zero == 3:
        seconds += 2 * collective_s(device, "all_gather", params * weight, group, intra)
    return seconds


def gradient_sync_s(plan: Plan, device: dict, dense: float, experts: float, backward_s: float) -> float:
    """Once per step: ZeRO-0 all-reduces the gradients, ZeRO-1 (and Megatron's distributed optimizer)
    reduce-scatters them, both overlapped with the last micro-batch's backward; ZeRO-1/2 then
    all-gather the updated parameters, which nothing hides. ZeRO-3 has reduced per micro-batch."""
    group, intra = _dp_group(plan, device)
    grad = _grad_bytes(plan)
    overlapped = gathered = 0.0
    for params, size in ((dense, group), (experts, group // plan.ep)):
        if not params:
            continue
        if plan.zero == 0:
            overlapped += collective_s(device, "all_reduce", params * grad, size, intra)
        elif plan.zero == 1:
            overlapped += collective_s(device, "reduce_scatter", params * grad, size, intra)
        if plan.zero in (1, 2):
            gathered += collective_s(device, "all_gather", params * (4 if plan.dtype == "fp32" else 2), size, intra)
    return max(0.0, overlapped - device["overlap"] * backward_s) + gathered


def optimizer_s(plan: Plan, device: dict, states: memory.ModelStates) -> tuple[float, float]:
    """(on-device optimizer step, offload transfer + CPU Adam) seconds: the step reads and writes
    every model-state byte the rank holds once."""
    hbm = device["hbm_tbps"] * 1e12 * device["hbm"]
    device_bytes = states.total_bytes - states.offloaded_bytes
    step = 2 * device_bytes / hbm
    offload = 0.0
    if plan.offload != "none":
        moved = states.grad_bytes + states.param_bytes  # gradients down, updated parameters up
        params = states.optimizer_bytes / (memory.MOMENT_BYTES[plan.optimizer] + 4)
        offload = moved / (device["host_link_gbps"] * 1e9) + params / CPU_ADAM_PARAMS_PER_S
    return step, offload
