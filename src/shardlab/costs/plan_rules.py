"""What the libraries accept of a plan: the rules behind `plan.rejection` that come from how a run is
cut, scheduled and sharded (the plan, the workload and the model are read by their fields only, so this
module imports no `plan`).

On this project's stack (`HAND_CUT_STACKS`) the rules are those of the code that runs:
- the stage cut: `shapes.stage_units` spreads the embedding, the layers and the head over up to
  layers + 2 stages (`pipeline_parallel.stages` builds one stage per unit list; more stages raise);
- torch.distributed.pipelining (torch 2.13, `torch/distributed/pipelining/schedules.py`):
  `Schedule1F1B.__init__` raises unless n_microbatches >= the number of stages;
  `ScheduleInterleaved1F1B.__init__` sets number_of_rounds = max(1, n_microbatches // pp_group_size)
  and raises unless n_microbatches % number_of_rounds == 0; `ScheduleGPipe` asks nothing;
- the zig-zag context-parallel split (`context_parallel.zigzag.check_shardable`): 2 x cp equal chunks;
- the hand-written TP's vocabulary-parallel embedding and head, which do not pad the vocabulary;
- DeepSpeed (0.19, `runtime/engine.py`): only stages 1-3 build a ZeRO optimizer, and `offload_optimizer`
  reaches only that optimizer, `offload_param` only stage 3's (elsewhere they are silently ignored).
On the planner's stacks the pipeline follows Megatron: equal stage shares (`shapes.cuts_evenly`) and
interleaved micro-batches in multiples of pp.
"""

from __future__ import annotations

from shardlab.costs.shapes import ModelShape, cuts_evenly

# Stacks that run torch.distributed.pipelining's schedules on this project's hand cut of the model
# (`shapes.stage_units`) and its hand-written tensor parallelism, whose vocabulary-parallel embedding and
# head have no padding. Their pipeline rules are torch's (schedules.py); the other stacks' are Megatron's.
HAND_CUT_STACKS = ("shardlab",)


def model_rejection(model: ModelShape, p, hand_cut: bool) -> str | None:
    """What the model's shape must split into: heads, MLP width and (hand-written TP) vocabulary over tp,
    experts over ep, layers over the pipeline stages."""
    if model.num_heads % p.tp:
        return f"tp: {model.num_heads} heads are not divisible by tp={p.tp}"
    if model.kv_heads % p.tp and p.tp % model.kv_heads:
        return f"tp: {model.kv_heads} KV heads do not split over tp={p.tp}"
    width = (model.expert_intermediate or model.intermediate_size) if model.num_experts else model.intermediate_size
    if width % p.tp:
        return f"tp: the MLP width {width} is not divisible by tp={p.tp} (column-parallel MLP)"
    if hand_cut and model.vocab_size % p.tp:
        return (f"tp: the vocabulary of {model.vocab_size} is not divisible by tp={p.tp} (the vocabulary-parallel "
                f"embedding and head have no padding)")
    if p.ep > 1 and not model.num_experts:
        return f"ep: a dense model has no experts to split over ep={p.ep}"
    if model.num_experts % p.ep:
        return f"ep: {model.num_experts} experts are not divisible by ep={p.ep}"
    return stage_cut_rejection(model.num_layers, p, hand_cut)


def stage_cut_rejection(layers: int, p, hand_cut: bool) -> str | None:
    """The hand cut (`shapes.stage_units`) spreads the embedding, the layers and the head over any number
    of stages up to layers + 2 (one unit each at most); Megatron's split wants equal shares: the layers
    evenly, or the layers + 2 with the embedding and the head as one layer each."""
    stages, field = p.pp * p.virtual_stages, "virtual_stages" if p.virtual_stages > 1 else "pp"
    if hand_cut:
        if layers + 2 < stages:
            return (f"{field}: {stages} pipeline stages (pp x virtual_stages) cannot be cut from {layers} layers "
                    f"+ the embedding + the head ({layers + 2} units, one stage each at most)")
        return None
    if layers < p.pp:
        return f"pp: {layers} layers cannot give each of {p.pp} pipeline ranks one"
    if not cuts_evenly(layers, stages):
        return (f"{field}: {stages} pipeline stages (pp x virtual_stages) split neither the {layers} layers evenly "
                f"nor {layers} + 2 with the embedding and the head as one layer each")
    return None


def sequence_rejection(p, w) -> str | None:
    """Context parallelism shards the sequence zig-zag (load-balanced causal attention): 2 x cp equal
    chunks, two per rank; sequence parallelism splits each rank's shard again over tp."""
    if p.cp > 1 and w.seq_len % (2 * p.cp):
        return (f"cp: sequence {w.seq_len} is not divisible by 2 x cp = {2 * p.cp} (zig-zag context parallelism "
                f"gives each of the {p.cp} ranks two equal chunks)")
    if p.sp and (w.seq_len // p.cp) % p.tp:
        return (f"sp: each context-parallel shard of {w.seq_len // p.cp} tokens is not divisible by the "
                f"sequence-parallel degree tp={p.tp}")
    return None


def schedule_rejection(p) -> str | None:
    if p.pp == 1 and p.schedule == "interleaved":
        return "schedule: a single pipeline stage (pp=1) has no schedule to interleave"
    if p.pp == 1 and p.virtual_stages > 1:
        return f"virtual_stages: a single pipeline stage (pp=1) has no {p.virtual_stages} chunks to interleave"
    if p.pp > 1 and p.schedule == "interleaved" and p.virtual_stages == 1:
        return "virtual_stages: the interleaved schedule needs 2 or more model chunks per rank (virtual_stages=2...)"
    if p.pp > 1 and p.virtual_stages > 1 and p.schedule != "interleaved":
        return f"virtual_stages: {p.virtual_stages} model chunks per rank need schedule=interleaved, not {p.schedule}"
    return None


def batch_rejection(p, w, hand_cut: bool) -> str | None:
    """The batch splits into whole micro-batches, as many as the pipeline schedule needs: torch's
    Schedule1F1B at least pp (one stage per rank), its ScheduleInterleaved1F1B a multiple of its
    max(1, m // pp) rounds; Megatron's interleaved schedule a multiple of pp."""
    if w.global_batch % (p.dp * p.micro_batch):
        return f"micro_batch: global batch {w.global_batch} is not divisible by dp x micro_batch = {p.dp * p.micro_batch}"
    m = w.global_batch // (p.dp * p.micro_batch)  # micro-batches per replica and step
    if p.pp == 1:
        return None
    if hand_cut and p.schedule == "1f1b" and m < p.pp:
        return f"micro_batch: the 1F1B schedule needs at least pp={p.pp} micro-batches per step, got {m}"
    rounds = max(1, m // p.pp)
    if hand_cut and p.schedule == "interleaved" and m % rounds:
        return (f"micro_batch: the interleaved schedule runs max(1, m // pp) = {rounds} rounds and needs the "
                f"{m} micro-batches in whole rounds")
    if not hand_cut and p.schedule == "interleaved" and m % p.pp:
        return f"micro_batch: the interleaved schedule needs micro-batches ({m}) in multiples of pp={p.pp}"
    return None


def sharding_rejection(p) -> str | None:
    """What shards the model states: DeepSpeed builds a ZeRO optimizer (which alone offloads) only at
    stages 1-3 and hands parameter offload to stage 3's only."""
    if p.offload != "none" and not (p.framework == "deepspeed" and p.zero >= 1):
        return f"offload: only DeepSpeed ZeRO stages 1-3 offload ({p.framework} at stage {p.zero} was asked)"
    if p.offload == "optimizer+params" and p.zero != 3:
        return f"offload: parameters offload only at ZeRO stage 3 (stage {p.zero} was asked)"
    if p.framework in ("megatron", "mcore") and p.zero > 1:
        return "zero: Megatron's distributed optimizer shards optimizer state only (zero 0 or 1)"
    if p.framework == "torch" and p.zero > 1:
        return "zero: plain PyTorch replicas shard nothing, or the optimizer state only (zero 0 or 1)"
    if p.framework == "fsdp2" and p.zero not in (2, 3):
        return "zero: FSDP2 shards gradients and parameters (zero 2 or 3)"
    if p.grad_bucket_mb is not None and (p.framework != "torch" or p.grad_bucket_mb < 0):
        return "grad_bucket_mb: only plain PyTorch replicas bucket their gradient all-reduce (>= 0 MiB)"
    return None
