"""The cost model of a plan: memory per rank by category and step time by component, for a software
stack on catalogued hardware.

One model for every strategy (`costs.plan.Plan`), composed of the project's single-topic models:
model-state bytes from `costs.sharded_states` (ZeRO/FSDP2/Megatron accounting), activation bytes per
layer from `costs.activations`, parameter splits from `costs.shapes`, collectives as NCCL runs them
(`costs.nccl`), the bubble from `costs.bubble`'s schedule algebra; the hardware's figures
(`costs.hardware`) and the stack's schedule and efficiencies (`costs.stacks`) are the inputs.

Memory (`costs.rank_memory`) is predicted for the first, the last and the fullest-layered pipeline
rank (`predicted_ranks`), and the largest counts against the device less the stack's runtime allowance.

Step time (`costs.step_time`), per pipeline rank and micro-batch: compute (GEMMs, the attention
kernel, element-wise HBM traffic) + the communication the stack's schedule leaves exposed. A step is
`m x t_slowest + (p-1)/v x t_stage` (fill and drain) + the once-per-step gradient reduction and
parameter gather left exposed + the optimizer step (HBM-bound, or PCIe + CPU Adam when offloaded).
A prediction whose MFU is above any published for its hardware generation and stack is flagged.

Assumptions that are not measured anywhere in this project are named where they are used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shardlab.costs import published, sharded_states
from shardlab.costs.bubble import theory_bubble_ratio
from shardlab.costs.comm_volume import Call, step_calls
from shardlab.costs.hardware import memory_bytes, peak_flops, recomputed_flops_per_token, training_flops_per_token
from shardlab.costs.plan import Cluster, Plan, Workload, micro_batches, rejection
from shardlab.costs.rank_memory import (activation_bytes, comm_buffer_bytes, embedding_gradient_bytes,
                                        layer_parameters_on_rank, model_states, rank_layers, rank_parameters)
from shardlab.costs.rank_memory import MEMORY_CATEGORIES  # noqa: F401 (the tables read the categories here)
from shardlab.costs.shapes import ModelShape
from shardlab.costs.step_time import gradient_sync_s, op_recomputed_share, optimizer_s, stage_times


# --- one run, rank by rank: what the tables hold against the measurements ----------------------------
def exact_tensors(model: ModelShape, plan: Plan) -> tuple | None:
    """The parameter shapes, where the plan leaves every tensor whole on its data-parallel ranks (so
    DeepSpeed's partition boundaries and FSDP2's row chunks can be followed exactly)."""
    if plan.tp == plan.pp == plan.ep == 1 and not model.num_experts:
        return tuple(map(tuple, sharded_states.parameter_shapes(model)))
    return None


def rank_states(model: ModelShape, plan: Plan, rank: int) -> sharded_states.ModelStates:
    """Model-state bytes (parameters, gradients, optimizer state) of world rank `rank` under `plan`,
    exactly where the tensors stay whole (`exact_tensors`)."""
    at = plan.coordinates(rank)
    return stage_states(model, plan, at["pp"], exact_tensors(model, plan), at["dp"] * plan.cp + at["cp"])


def stage_states(model: ModelShape, plan: Plan, stage: int, tensors: tuple | None = None,
                 shard_rank: int | None = None) -> sharded_states.ModelStates:
    """Model-state bytes of a rank of pipeline stage `stage` (the even split without `tensors`)."""
    dense, experts = rank_parameters(model, plan, stage)
    states = model_states(plan, dense, experts, tensors, shard_rank)
    extra = embedding_gradient_bytes(model, plan, stage)
    if not extra:
        return states
    return sharded_states.ModelStates(states.param_bytes, states.grad_bytes + extra, states.optimizer_bytes,
                              states.grad_peak_bytes + extra, states.offloaded_bytes)


def rank_activations(model: ModelShape, plan: Plan, workload: Workload, rank: int, working_set: bool = True) -> float:
    """Activation bytes world rank `rank` holds at its peak (its pipeline stage's in-flight micro-batches);
    without `working_set`, what its forward left saved for backward (`rank_memory.activation_bytes`)."""
    return activation_bytes(model, plan, workload, plan.coordinates(rank)["pp"], working_set=working_set)


def collectives(model: ModelShape, plan: Plan, workload: Workload) -> list[Call]:
    """The collectives the busiest rank issues per optimizer step (`costs.comm_volume`)."""
    return step_calls(model, plan, workload) if plan.world > 1 else []


@dataclass(frozen=True)
class Prediction:
    plan: Plan
    memory: dict  # bytes on the device of the fullest rank, by MEMORY_CATEGORIES, plus host_bytes
    device_bytes: float
    capacity_bytes: float
    fits: bool
    time: dict  # seconds per step by TIME_COMPONENTS
    step_s: float
    tokens_per_s: float
    mfu: float
    bottleneck: str
    why: str  # "fits" or what does not
    hfu: float  # hardware FLOPs utilisation: MFU's FLOPs plus the recomputed forward work
    tflops_per_gpu: float  # Megatron's figure: hardware FLOPs per second per GPU, in TFLOP/s
    stack: str = ""
    flag: str = ""  # why the prediction is implausible (above every published MFU of its hardware and stack), or ""

    def as_dict(self) -> dict:
        d = asdict(self)
        d["plan"] = self.plan.as_dict()
        d["label"] = self.plan.label()
        return d


def predicted_ranks(model: ModelShape, plan: Plan) -> list[int]:
    """The pipeline ranks a prediction looks at: the first (the embedding, the most micro-batches in
    flight), the last (the head and the logits) and the one with the most layers (a middle rank, where
    the embedding and the head take a layer's slot each)."""
    layers = rank_layers(model.num_layers, plan.pp, plan.virtual_stages)
    return sorted({0, plan.pp - 1, layers.index(max(layers))})


def usable_bytes(figures: dict) -> float:
    """Device memory a plan's tensors may take: HBM less the stack's runtime allowance."""
    return memory_bytes(figures) * (1 - figures["reserved_memory_share"])


def evaluate(model: ModelShape, plan: Plan, cluster: Cluster, workload: Workload, stack: str | None = None,
             with_time: bool = True, figures: dict | None = None, time_only_if_fits: bool = False) -> Prediction | str:
    """The prediction for `plan` under `stack` (None: the default stack), or the reason it cannot run (a
    string). With `figures` (the cluster's `figures(stack)`), the caller has already checked
    `plan.rejection` (the search); `with_time=False`: memory only; `time_only_if_fits`: memory only for a
    plan that does not fit, and its memory that of the first rank found over capacity (a search needs
    no more)."""
    if figures is None:
        reason = rejection(model, plan, cluster, workload, stack)
        if reason:
            return reason
        figures = cluster.figures(stack)
    m = micro_batches(plan, workload)
    ranks = predicted_ranks(model, plan)
    layer_params = sum(layer_parameters_on_rank(model, plan.tp, plan.ep))  # dense + this rank's experts
    capacity = usable_bytes(figures)
    per_rank = {}
    for r in ranks:
        states = stage_states(model, plan, r)
        mem = {"parameters": states.param_bytes, "gradients": states.grad_peak_bytes,
               "optimizer": states.optimizer_bytes,
               "activations": activation_bytes(model, plan, workload, r),
               "comm_buffers": comm_buffer_bytes(model, plan, workload, layer_params)}
        device_total = sum(mem.values()) - states.offloaded_bytes
        per_rank[r] = (device_total, mem, states)
        if time_only_if_fits and device_total > capacity:
            break
    fullest = max(per_rank, key=lambda r: per_rank[r][0])
    device_total, mem, states = per_rank[fullest]
    host_needed = states.offloaded_bytes * cluster.gpus_per_node
    fits = device_total <= capacity and (cluster.host_memory_gb is None or host_needed <= cluster.host_memory_gb * 1e9)
    why = "fits" if fits else (
        f"out of memory: {device_total / 1e9:.1f} GB per device > {capacity / 1e9:.1f} GB usable"
        if device_total > capacity else f"host memory: {host_needed / 1e9:.0f} GB offloaded per node")
    memory_out = dict(mem, host_bytes=states.offloaded_bytes)
    if not with_time or (time_only_if_fits and not fits):
        return Prediction(plan, memory_out, device_total, capacity, fits, {}, float("nan"), float("nan"),
                          float("nan"), "", why, float("nan"), float("nan"), figures["stack"])

    # A step: m micro-batches at the slowest rank's pace, plus the pipeline's fill and drain (the
    # bubble of costs.bubble, in units of the first rank's micro-batch time), plus what the
    # once-per-step communication leaves exposed, plus the optimizer step.
    stages = {r: stage_times(model, plan, workload, figures, r) for r in ranks}
    per_micro = {r: sum(v for k, v in t.items() if not k.startswith("_")) for r, t in stages.items()}
    slowest = max(per_micro, key=per_micro.get)
    time = {k: m * v for k, v in stages[slowest].items() if not k.startswith("_")}
    time["pp_bubble"] = theory_bubble_ratio(plan.pp, m, plan.virtual_stages) * m * per_micro[0]
    time["dp_comm"] = max(gradient_sync_s(model, plan, figures, r, stages[r]["_forward"], stages[r]["_backward"])
                          for r in ranks)
    time["optimizer"], time["offload"] = optimizer_s(plan, figures, states)
    step = sum(time.values())
    tokens = workload.global_batch * workload.seq_len
    peak = peak_flops(figures, plan.dtype)
    shape = (model.matmul_parameters(), model.num_layers, model.hidden_size, workload.seq_len)
    model_flops = training_flops_per_token(*shape) * tokens
    mfu = model_flops / (step * plan.world * peak)
    hardware_flops = model_flops + recomputed_flops_per_token(*shape, plan.recompute, op_recomputed_share(model)) * tokens
    hfu = hardware_flops / (step * plan.world * peak)
    tflops_per_gpu = hardware_flops / (step * plan.world) / 1e12
    return Prediction(plan, memory_out, device_total, capacity, fits, time, step, tokens / step, mfu,
                      max(time, key=time.get), why, hfu, tflops_per_gpu, figures["stack"],
                      implausible(mfu, figures))


def implausible(mfu: float, figures: dict) -> str:
    """Why an MFU is beyond what was ever published for the accelerator's generation and the stack
    (`published.best_mfu`), or ""."""
    generation = figures.get("generation", "")
    best = published.best_mfu(generation, figures["stack"])
    if best is None or mfu <= best["mfu"]:
        return ""
    return (f"MFU {mfu:.1%} is above the best published for {figures['stack']} on {generation} "
            f"({best['mfu']:.1%}, {best['source']})")
