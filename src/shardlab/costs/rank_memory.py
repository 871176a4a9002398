"""Memory of one rank under a plan: the parameters it holds (tensor, pipeline and expert splits),
its model states (ZeRO / FSDP2 / Megatron accounting over its data-parallel group), the activations
of its in-flight micro-batches, and transient communication buffers.

Composed of the single-topic models: `costs.shapes` (parameter counts), `costs.sharded_states` (bytes per
parameter by sharding), `costs.activations` (bytes per layer). Cached: the search asks for the same
pieces over and over.
"""

from __future__ import annotations

from functools import lru_cache

from shardlab.costs import sharded_states
from shardlab.costs.activations import PRECISIONS, layer_bytes
from shardlab.costs.plan import Plan, Workload, micro_batches
from shardlab.costs.shapes import EMBED, HEAD, ModelShape, stage_units

ZERO3_PREFETCH_LAYERS = 2  # layers of gathered parameters FSDP2 holds at once (the running block + the prefetched one)
# DeepSpeed ZeRO-3 bounds what it holds gathered by parameter count instead (its defaults, deepspeed/runtime/zero/
# config.py): at most stage3_max_live_parameters, though the module running is always whole, plus the prefetch bucket.
DEEPSPEED_MAX_LIVE_PARAMETERS = 1e9
DEEPSPEED_PREFETCH_BUCKET_PARAMETERS = 5e7
MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "comm_buffers")


@lru_cache(maxsize=65536)
def pipeline_ranks(n_layers: int, pp: int, v: int) -> tuple[tuple[int, bool, bool], ...]:
    """(layers, holds the embedding, holds the head) of each pipeline rank: rank r runs stages r,
    r + pp, ... of the stage cut the pipeline strategies use (`shapes.stage_units`)."""
    stages = stage_units(n_layers, pp * v)
    held = [[u for s in range(r, pp * v, pp) for u in stages[s]] for r in range(pp)]
    return tuple((sum(isinstance(u, int) for u in units), EMBED in units, HEAD in units) for units in held)


@lru_cache(maxsize=65536)
def rank_layers(n_layers: int, pp: int, v: int) -> tuple[int, ...]:
    """Transformer layers each pipeline rank holds."""
    return tuple(layers for layers, _, _ in pipeline_ranks(n_layers, pp, v))


@lru_cache(maxsize=65536)
def layer_parameters_on_rank(model: ModelShape, tp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters of one layer on one rank. TP splits every matrix and the biases of
    column-parallel layers; norms, row-parallel biases and the router stay whole. Experts split over
    ep, and their matrices over tp (Megatron's default expert tensor parallelism; down biases whole)."""
    whole = model.layer_parameters_kept_whole()
    if not model.num_experts:
        return (model.layer_parameters() - whole) / tp + whole, 0.0
    bias = model.hidden_size if model.biases else 0
    experts = model.num_experts * model.expert_parameters()
    dense_whole = whole - model.num_experts * bias  # the expert down biases are counted with the experts
    dense = (model.layer_parameters() - experts - dense_whole) / tp + dense_whole
    return dense, model.num_experts / ep * ((model.expert_parameters() - bias) / tp + bias)


def rank_parameters(model: ModelShape, plan: Plan, rank: int) -> tuple[float, float]:
    """(dense, expert) parameters pipeline rank `rank` holds (the embedding and the head where its
    stages hold them; vocabulary-split under TP)."""
    dense_layer, expert_layer = layer_parameters_on_rank(model, plan.tp, plan.ep)
    layers, embedding, head = pipeline_ranks(model.num_layers, plan.pp, plan.virtual_stages)[rank]
    dense = layers * dense_layer
    if embedding:
        dense += model.embedding_parameters() / plan.tp
    if head:
        dense += (model.head_parameters() - model.norm_parameters()) / plan.tp + model.norm_parameters()
    return dense, layers * expert_layer


def model_states(plan: Plan, dense: float, experts: float, tensors: tuple | None = None,
                 shard_rank: int | None = None) -> sharded_states.ModelStates:
    """Model-state bytes of a rank: dense parameters sharded over the dp x cp ranks, experts over the
    dp x cp / ep ranks that hold the same experts. `tensors` (the dense parameters' shapes, when
    known): DeepSpeed's padding and partition boundaries, FSDP2's row chunks, exactly, for the rank
    `shard_rank` of the sharding group (None: the fullest); else the even split."""
    return _model_states(plan.zero, plan.offload, plan.framework, plan.dtype, plan.optimizer,
                         plan.dp * plan.cp, plan.ep, dense, experts, tensors, shard_rank)


@lru_cache(maxsize=65536)
def _model_states(zero: int, offload: str, framework: str, dtype: str, optimizer: str, shard: int, ep: int,
                  dense: float, experts: float, tensors: tuple | None, shard_rank: int | None) -> sharded_states.ModelStates:
    rung = sharded_states.ZeroRung.of(zero, offload, framework)
    dtype = "fp32" if dtype == "fp32" else "bf16"
    parts = [sharded_states.predict(rung, dense, shard, dtype, optimizer, tensors=tensors,
                            rank=shard_rank if tensors else None)]
    if experts:
        parts.append(sharded_states.predict(rung, experts, shard // ep, dtype, optimizer))
    return sharded_states.ModelStates(*(sum(getattr(p, f) for p in parts) for f in
                                ("param_bytes", "grad_bytes", "optimizer_bytes", "grad_peak_bytes", "offloaded_bytes")))


def embedding_gradient_bytes(model: ModelShape, plan: Plan, rank: int) -> float:
    """What a TP implementation that keeps the vocabulary-split embedding's gradient whole adds on the
    pipeline rank holding the embedding (measured, torch 2.13 DTensor: a Replicate gradient)."""
    if not plan.whole_embedding_grad or not pipeline_ranks(model.num_layers, plan.pp, plan.virtual_stages)[rank][1]:
        return 0.0
    return 4 * model.embedding_parameters() * (plan.tp - 1) / plan.tp


def activation_layer_bytes(model: ModelShape, plan: Plan, workload: Workload, recompute: str | None = None,
                           weight_copies: bool = True) -> float:
    """Bytes one layer stores for one micro-batch on one rank (MoE: top_k routed copies of the MLP's)."""
    return sum(activation_layer_parts(model, plan, workload, recompute, weight_copies).values())


def activation_layer_parts(model: ModelShape, plan: Plan, workload: Workload, recompute: str | None = None,
                           weight_copies: bool = True) -> dict:
    """`activation_layer_bytes` by component (costs.activations.COMPONENTS); read-only (cached). Dropout
    masks are stored where the workload's dropout is above zero."""
    return _layer_parts(model, workload.seq_len // plan.cp, plan.micro_batch, plan.tp, plan.activation_split,
                        plan.activation_precision, plan.attention, workload.dropout > 0, recompute or plan.recompute,
                        weight_copies, model.num_experts // plan.ep, workload.seq_len)


@lru_cache(maxsize=65536)
def _layer_parts(model: ModelShape, s: int, b: int, t: int, split: str, stored: str, attention: str,
                 dropout: bool, recompute: str, weight_copies: bool, local_experts: int, keys: int) -> dict:
    width = (model.expert_intermediate or model.intermediate_size) if model.num_experts else model.intermediate_size
    how = PRECISIONS[stored]
    parts = layer_bytes(s, b, model.hidden_size, model.num_heads, width, t=t, split=split, **how,
                        residual=model.residual, attention=attention,
                        dropout=dropout, recompute=recompute, kv_heads=model.kv_heads, mlp=model.mlp,
                        weight_copies=weight_copies, keys=keys)
    if model.num_experts and recompute not in ("full", "op"):
        routed = routed_expert_bytes(model, s * b, t, how["value_bytes"], width)
        if how["autocast"] and weight_copies:  # autocast copies every local expert's weights, not one MLP's
            routed += (local_experts - 1) * how["value_bytes"] * model.mlp_matrices * model.hidden_size * width / t
        parts = dict(parts, mlp=parts["mlp"] + routed)
    return parts


def routed_expert_bytes(model: ModelShape, tokens: int, t: int, value_bytes: int, width: int) -> float:
    """What a top-k mixture of experts saves beyond one dense MLP of the expert's width: k-1 more
    expert passes (their hidden activations), the k dispatched copies of each token (the experts'
    GEMM inputs) and the k expert outputs the weighted combine multiplies, and the router's fp32
    probabilities. Balanced routing assumed. Expert tensor parallelism splits only the experts' hidden
    width over tp: the tokens a rank's experts take in and give back are whole on every tp rank (the
    column-parallel input, the reduced row-parallel output; under SP gathered from the sequence shards
    first), as measured on composed_moe's EP x TP+SP run (a calibration point from 2026-12-07). The
    tensors the MoE layer also saves (the combine's weighted outputs, int64 routing indices) are left
    out: counting them overshot the off-grid ep_moe check (tests/test_run_predictions.py) by 17 %, which
    decided it, so that check is a calibration point of this formula too."""
    h, k = model.hidden_size, model.top_k
    hidden = model.mlp_matrices * value_bytes * tokens * width / t  # GeLU input and output, or SwiGLU's three
    return (k - 1) * hidden + 2 * k * value_bytes * tokens * h + 4 * tokens * model.num_experts


@lru_cache(maxsize=65536)
def rank_chunks(n_layers: int, pp: int, v: int, rank: int) -> tuple[tuple[int, bool, bool], ...]:
    """(layers, holds the embedding, holds the head) of each of pipeline rank `rank`'s v model chunks."""
    stages = stage_units(n_layers, pp * v)
    return tuple((sum(isinstance(u, int) for u in stages[s]), EMBED in stages[s], HEAD in stages[s])
                 for s in range(rank, pp * v, pp))


@lru_cache(maxsize=65536)
def live_micro_batches(schedule: str, p: int, v: int, m: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """The states, right after each forward, of how many micro-batches each of the rank's v chunks
    holds for backward (those no other state holds at least as many of in every chunk: only they can
    be the peak), in the order torch.distributed.pipelining runs them: GPipe all m; 1F1B
    p - rank (warm-up p - 1 - rank forwards, then one forward, one backward); interleaved 1F1B
    (v - 1) x (micro-batches per round) + 2 (p - 1 - rank) warm-up forwards cycling over the chunks,
    backwards in the reverse chunk order (Narayanan et al. 2021: the first rank holds about
    (1 + (p - 1)/(p v)) x its layers' worth)."""
    if p == 1 or schedule == "gpipe":
        return ((1 if p == 1 else m,) * v,)
    if schedule != "interleaved":
        return ((min(m, p - rank),),)
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    live, seen = [0] * v, set()
    for op in range(m * v):
        live[(op // per_round) % v] += 1
        seen.add(tuple(live))
        if op >= warmup:
            live[v - 1 - ((op - warmup) // per_round) % v] -= 1
    return tuple(s for s in seen if not any(o != s and all(a >= b for a, b in zip(o, s)) for o in seen))


@lru_cache(maxsize=65536)
def in_flight(n_layers: int, schedule: str, p: int, v: int, m: int, rank: int) -> tuple[tuple[int, int, int], ...]:
    """The candidate peaks of what pipeline rank `rank` holds over the schedule, as (layer-micro-batches,
    embedding micro-batches, head micro-batches): each `live_micro_batches` state summed over the rank's
    chunks, only those no other state holds at least as much of in all three."""
    chunks = rank_chunks(n_layers, p, v, rank)
    sums = {(sum(n * layers for n, (layers, _, _) in zip(state, chunks)),
             sum(n for n, (_, embedding, _) in zip(state, chunks) if embedding),
             sum(n for n, (_, _, head) in zip(state, chunks) if head))
            for state in live_micro_batches(schedule, p, v, m, rank)}
    return tuple(s for s in sums if not any(o != s and all(a >= b for a, b in zip(o, s)) for o in sums))


def layer_activation_bytes(model: ModelShape, plan: Plan, workload: Workload, rank: int) -> float:
    """What the transformer layers of pipeline rank `rank` store at its peak over the schedule."""
    return activation_bytes(model, plan, workload, rank, edges=False)


def activation_bytes(model: ModelShape, plan: Plan, workload: Workload, rank: int, edges: bool = True,
                     working_set: bool = True) -> float:
    """Activation bytes of pipeline rank `rank` at its peak: each chunk's layers and, with `edges`,
    what sits outside them (`edge_activation_bytes`), times the micro-batches the chunk holds at the
    schedule's fullest moment; autocast's bf16 weight copies once (one autocast region runs all the
    rank's micro-batches); full or per-op recompute, with `working_set`: plus one layer's working set
    (what its recomputation saves again in backward; without it, what the forward left saved)."""
    key = (plan.micro_batch, plan.tp, plan.cp, plan.ep, plan.sp, plan.sp_gathered_inputs, plan.activation_precision,
           plan.attention, plan.recompute, plan.vocab_parallel_loss, plan.dtype)
    per_layer, copies, embedding, head, head_copy, recomputed = _activation_terms(model, key, plan, workload)
    chunks = rank_chunks(model.num_layers, plan.pp, plan.virtual_stages, rank)
    peaks = in_flight(model.num_layers, plan.schedule, plan.pp, plan.virtual_stages, micro_batches(plan, workload), rank)
    edge = 1.0 if edges else 0.0
    total = max(layers * per_layer + edge * (embeddings * embedding + heads * head) for layers, embeddings, heads in peaks)
    total += sum(layers for layers, _, _ in chunks) * copies + (recomputed if working_set else 0.0)
    if edges and any(has_head for _, _, has_head in chunks):
        total += head_copy
    return total


def _activation_terms(model: ModelShape, key: tuple, plan: Plan, workload: Workload) -> tuple[float, ...]:
    """What `activation_bytes` weighs by the schedule, the same on every rank of a plan and for every plan
    with the same activation fields (`key`: a search tries each under several shardings): one layer's
    bytes per micro-batch, autocast's weight copies per layer, the embedding's and the head's bytes per
    micro-batch, the head's weight copy, and the working set of a recomputed layer."""
    cache_key = (model, key, workload)
    found = _ACTIVATION_TERMS.get(cache_key)
    if found is None:
        found = _ACTIVATION_TERMS[cache_key] = _activation_terms_of(model, plan, workload)
        if len(_ACTIVATION_TERMS) > 65536:
            _ACTIVATION_TERMS.clear()
    return found


_ACTIVATION_TERMS: dict = {}


def _activation_terms_of(model: ModelShape, plan: Plan, workload: Workload) -> tuple[float, ...]:
    per_layer = activation_layer_bytes(model, plan, workload, weight_copies=False)
    copies = activation_layer_bytes(model, plan, workload) - per_layer
    working_set = activation_layer_bytes(model, plan, workload, recompute="none") if plan.recompute in ("full", "op") else 0.0
    return (per_layer, copies, edge_activation_bytes(model, plan, workload, True, False),
            edge_activation_bytes(model, plan, workload, False, True), head_weight_copy_bytes(model, plan), working_set)


def head_weight_copy_bytes(model: ModelShape, plan: Plan) -> float:
    """Autocast's bf16 copy of the LM head's weight (vocabulary-split under TP), kept once per rank."""
    how = PRECISIONS[plan.activation_precision]
    return how["value_bytes"] * model.vocab_size * model.hidden_size / plan.tp if how["autocast"] else 0.0


def edge_activation_bytes(model: ModelShape, plan: Plan, workload: Workload, embedding: bool, head: bool) -> float:
    """One micro-batch's bytes outside the layers: at the embedding the token ids (and, vocabulary-split,
    the mask of ids outside the rank's range; the dropout mask); at the head the final norm's input and
    statistics, the LM head's input and the fp32 log-probabilities cross-entropy keeps,
    vocabulary-split only where the loss is."""
    how = PRECISIONS[plan.activation_precision]
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    shard = plan.tp if plan.sp else 1  # sequence parallelism splits the residual stream
    hidden = tokens * model.hidden_size
    out = 0.0
    if embedding:
        out += 8 * tokens + (tokens if plan.tp > 1 else 0) + (hidden / shard if workload.dropout > 0 else 0)
    if head:
        residual = 4 if how["autocast"] else how["value_bytes"]
        out += (residual * hidden + 2 * how["norm_stats_bytes"] * tokens) / shard
        out += how["value_bytes"] * hidden / shard
        out += 4 * tokens * model.vocab_size / (plan.tp if plan.vocab_parallel_loss else 1)
    return out


def zero3_gathered_parameters(model: ModelShape, plan: Plan, layer_params: float) -> float:
    """Parameters ZeRO-3 holds gathered at once: FSDP2 two transformer blocks; DeepSpeed at most its
    live-parameter limit (or the largest matrix, which it gathers whole) plus a prefetch bucket, and
    never more than the two blocks."""
    blocks = ZERO3_PREFETCH_LAYERS * layer_params
    if plan.framework != "deepspeed":
        return blocks
    h = model.hidden_size
    largest = h * max(model.expert_intermediate or model.intermediate_size, h + 2 * model.kv_width) / plan.tp
    return min(blocks, max(DEEPSPEED_MAX_LIVE_PARAMETERS, largest) + DEEPSPEED_PREFETCH_BUCKET_PARAMETERS)


def comm_buffer_bytes(model: ModelShape, plan: Plan, workload: Workload, layer_params: float) -> float:
    """Transient buffers: ZeRO-3's gathered layers, SP's gathered layer input, pipeline send/receive."""
    tokens = plan.micro_batch * workload.seq_len / plan.cp
    act = tokens * model.hidden_size * plan.value_bytes
    out = 0.0
    if plan.zero == 3:
        out += zero3_gathered_parameters(model, plan, layer_params) * plan.value_bytes
    if plan.sp:
        out += act
    if plan.pp > 1:
        out += 2 * act / (plan.tp if plan.sp else 1)
    return out
