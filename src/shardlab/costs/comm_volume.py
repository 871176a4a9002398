"""The communication each strategy must do per optimizer step, from the model and training shape.

A plan is a list of `Call`s: a collective, its message size in nccl-tests' convention (the whole
buffer: see `collectives`), how many times the busiest rank issues it per step, and over how
many ranks. `bus_bytes` = size x bus_factor is what each rank's link carries (ring algorithms),
so the per-rank volume of a step is the sum of the calls' bus bytes, and the alpha-beta model
turns the same plan into seconds.

Counted: the traffic of the technique (gradient/parameter collectives, activations crossing
TP/SP/PP/CP/EP boundaries). Not counted: scalar all-reduces (loss, norms), the step-time
all-reduce, TP's one-off gathers at the embedding and head, and anything an implementation adds
beyond the textbook algorithm. Gradients and parameters travel in fp32 (fp32 master weights;
bf16 means autocast here), activations in the compute dtype.

Each strategy's registry entry names its plan (`StrategySpec.comm_plan`); this module knows no
strategy names.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.costs.collectives import bus_factor
from shardlab.costs.shapes import ModelShape, StepShape, pipeline_rank_parameters

GRAD_BYTES = PARAM_BYTES = 4  # fp32 master weights and gradients in every strategy of this project

# Collectives one transformer layer issues per micro-batch, forward + backward: the counts of the
# per-run plans below and of the planner's step time (costs.step_time) alike.
TP_COLLECTIVES_PER_LAYER = 4  # after attention and after the MLP (all-reduce, or all-gather + reduce-scatter), fwd and bwd
TP_COLLECTIVES_PER_RECOMPUTE = 2  # a recomputed forward repeats its two
CP_RING_PASSES_PER_LAYER = 3  # K/V around the ring in forward; K/V and their gradients in backward
EP_ALL_TO_ALLS_PER_LAYER = 4  # dispatch and combine, forward and backward


def kv_message(tokens: float, kv_width: float, value_bytes: float) -> float:
    """Bytes of one ring-attention hop: the K and V of a rank's tokens."""
    return 2 * tokens * kv_width * value_bytes


@dataclass(frozen=True)
class Call:
    collective: str
    size_bytes: float  # nccl-tests convention
    count: int  # per step, as issued by the busiest rank
    group_size: int
    purpose: str

    @property
    def bus_bytes(self) -> float:
        return self.count * self.size_bytes * bus_factor(self.collective, self.group_size) if self.group_size > 1 else 0.0


# --- one function per technique -----------------------------------------------------------------
def data_parallel(model: ModelShape, step: StepShape, dp: int) -> list[Call]:
    """DP naive, DDP, ZeRO-0: one all-reduce of every gradient per step (DDP's buckets sum to it)."""
    return [Call("all_reduce", model.parameters() * GRAD_BYTES, 1, dp, "gradient all-reduce")]


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


def bucketed_data_parallel(model: ModelShape, step: StepShape, dp: int, bucket_mb: float | None) -> list[Call]:
    """Interleaved DP: one all-reduce per gradient bucket (per layer, or layers packed up to `bucket_mb`
    MiB): the same bytes as one all-reduce, but one latency per bucket."""
    sizes = [n * GRAD_BYTES for n in gradient_groups(model)]
    buckets = [sum(sizes[i] for i in b) for b in pack_buckets(sizes, None if bucket_mb is None else bucket_mb * 2**20)]
    return [Call("all_reduce", size, buckets.count(size), dp, "gradient all-reduce, one per bucket")
            for size in dict.fromkeys(buckets)]


def zero_sharded_optimizer(model: ModelShape, step: StepShape, dp: int) -> list[Call]:
    """ZeRO-1/2 (FSDP2 without resharding after forward): reduce-scatter gradients, all-gather updated params."""
    p = model.parameters()
    return [Call("reduce_scatter", p * GRAD_BYTES, 1, dp, "gradient reduce-scatter"),
            Call("all_gather", p * PARAM_BYTES, 1, dp, "parameter all-gather")]


def zero_sharded_parameters(model: ModelShape, step: StepShape, dp: int) -> list[Call]:
    """ZeRO-3 / FSDP2 full: parameters gathered for forward AND again for backward: ~1.5x DP's volume."""
    p = model.parameters()
    return [Call("all_gather", p * PARAM_BYTES, 2, dp, "parameter all-gather (forward, backward)"),
            Call("reduce_scatter", p * GRAD_BYTES, 1, dp, "gradient reduce-scatter")]


def _activation_bytes(step: StepShape, dp: int, seq_len: int | None = None) -> tuple[float, int]:
    rows, n_micro = step.micro_batches(dp)
    return rows * (seq_len or step.seq_len) * step.activation_bytes, n_micro


def tensor_parallel(model: ModelShape, step: StepShape, tp: int, dp: int = 1) -> list[Call]:
    """Megatron TP: per layer, all-reduce after attention and after the MLP (forward) and of the
    input gradients of both column-parallel blocks (backward): 4 all-reduces of b*s*h elements."""
    per_row, n_micro = _activation_bytes(step, dp)
    size, half = per_row * model.hidden_size, TP_COLLECTIVES_PER_LAYER // 2
    return [Call("all_reduce", size, half * model.num_layers * n_micro, tp, "TP forward all-reduce"),
            Call("all_reduce", size, half * model.num_layers * n_micro, tp, "TP backward all-reduce")]


def sequence_parallel(model: ModelShape, step: StepShape, tp: int, dp: int = 1) -> list[Call]:
    """TP + SP: each TP all-reduce becomes an all-gather (into the block) + a reduce-scatter (out of it):
    the same bus bytes, but LayerNorm/residual activations stay sharded along the sequence."""
    per_row, n_micro = _activation_bytes(step, dp)
    size = per_row * model.hidden_size
    n = TP_COLLECTIVES_PER_LAYER // 2 * model.num_layers * n_micro  # two blocks per layer
    return [Call("all_gather", size, n, tp, "SP forward all-gather"),
            Call("reduce_scatter", size, n, tp, "SP forward reduce-scatter"),
            Call("all_gather", size, n, tp, "SP backward all-gather"),
            Call("reduce_scatter", size, n, tp, "SP backward reduce-scatter")]


def pipeline_parallel(model: ModelShape, step: StepShape, pp: int, n_micro: int | None) -> list[Call]:
    """PP: each micro-batch's activation goes forward and its gradient backward across every stage
    boundary. The busiest rank (a middle stage; with 2 stages each rank) takes part in
    2 transfers per micro-batch per adjacent boundary."""
    n_micro = n_micro or pp
    rows = max(1, step.global_batch // n_micro)
    size = rows * step.seq_len * model.hidden_size * step.activation_bytes
    boundaries = min(2, pp - 1)
    return [Call("sendrecv", size, n_micro * boundaries, pp, "PP activation (forward)"),
            Call("sendrecv", size, n_micro * boundaries, pp, "PP activation gradient (backward)")]


def context_parallel(model: ModelShape, step: StepShape, cp: int) -> list[Call]:
    """Ring attention: per layer, K and V chunks (2*b*(s/cp)*h) pass cp-1 times around the ring in
    forward; backward passes K/V and their gradients again. Parameters are replicated over the
    ring, so gradients are all-reduced as in DP."""
    rows, n_micro = step.micro_batches(1)
    kv = kv_message(rows * step.seq_len // cp, model.kv_width, step.activation_bytes)
    hops = (cp - 1) * model.num_layers * n_micro
    backward = CP_RING_PASSES_PER_LAYER - 1
    return [Call("sendrecv", kv, hops, cp, "CP K/V ring (forward)"),
            Call("sendrecv", kv, backward * hops, cp, "CP K/V and dK/dV ring (backward)"),
            *data_parallel(model, step, cp)]


def expert_parallel(model: ModelShape, step: StepShape, ep: int, top_k: int) -> list[Call]:
    """MoE with one expert group per rank: per layer, all-to-all dispatch and combine of each routed
    token (forward) and of their gradients (backward); the dense (non-expert) parameters are
    replicated and their gradients all-reduced."""
    per_row, n_micro = _activation_bytes(step, ep)
    size, half = per_row * model.hidden_size * top_k, EP_ALL_TO_ALLS_PER_LAYER // 2
    dense = model.parameters() - model.num_layers * model.mlp_parameters()
    return [Call("all_to_all", size, half * model.num_layers * n_micro, ep, "EP dispatch + combine (forward)"),
            Call("all_to_all", size, half * model.num_layers * n_micro, ep, "EP dispatch + combine (backward)"),
            Call("all_reduce", dense * GRAD_BYTES, 1, ep, "dense-parameter gradient all-reduce")]


def hybrid_data_pipeline(model: ModelShape, step: StepShape, dp: int, pp: int, n_micro: int) -> list[Call]:
    """dp replicas of a pp-stage pipeline: each replica pipelines its 1/dp of the batch, then every
    stage all-reduces its gradients over its dp peers (the busiest rank: the largest stage)."""
    replica = StepShape(step.global_batch // dp, step.seq_len, step.micro_batch, step.activation_bytes)
    stage = max(pipeline_rank_parameters(model, pp))
    return [*pipeline_parallel(model, replica, pp, n_micro),
            Call("all_reduce", stage * GRAD_BYTES, 1, dp, "stage gradient all-reduce over dp")]


def bytes_per_rank(plan: list[Call] | None) -> float | None:
    """Bytes each rank's link carries per step (the plan's bus bytes)."""
    return None if plan is None else float(sum(call.bus_bytes for call in plan))
