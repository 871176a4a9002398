"""A parallel training plan, the cluster it runs on, and whether the plan can run at all.

A plan places `world = dp x tp x pp x cp` ranks (Megatron's order, innermost first: tensor,
context, data, pipeline; expert parallelism is carved out of the dp x cp ranks, as in Megatron-Core):

- tp with or without sequence parallelism (`sp`), pp with a schedule and `virtual_stages` chunks per
  rank (interleaved 1F1B), cp (ring attention), ep (experts split over ranks);
- `zero` 0-3: how the data-parallel group shards optimizer state (1), gradients (2), parameters (3);
  `framework` says whose accounting (DeepSpeed, FSDP2, Megatron's fp32-gradient mixed precision
  where `zero` = 1 is its distributed optimizer, or plain PyTorch replicas with fp32 weights under
  autocast); `offload` moves optimizer state (and at stage 3
  parameters) to host memory;
- micro-batch rows per rank, activation recompute none/selective/full, dtype, and an attention
  kernel: "flash" (a fused kernel as Megatron and FlashAttention run it), "sdpa" (what transformers'
  SDPA path saves in this project's GPT-NeoX runs), "eager" (stores the score matrix) or "ring".

The pipeline's pp x virtual_stages stages must hold equal shares of the model: the layers split
evenly, or the layers + 2 with the embedding and the head as one layer each (`shapes.cuts_evenly`).

`rejection` says why a plan cannot run (a divisibility, the batch, a placement), naming the field,
before any cost is computed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from shardlab.costs import hardware, stacks
from shardlab.costs.shapes import ModelShape, cuts_evenly
from shardlab.costs.sharded_states import MOMENT_BYTES

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "op", "full")  # selective: the attention core; op: per-op checkpointing
OFFLOAD = ("none", "optimizer", "optimizer+params")
# torch: plain replicas (DDP, hand-written TP/PP/CP/EP); megatron: fp32 main gradients (Megatron-LM);
# mcore: compute-dtype gradients (Megatron-Core, NeMo's distributed fused Adam)
FRAMEWORKS = ("deepspeed", "fsdp2", "megatron", "mcore", "torch")
ATTENTION = ("flash", "sdpa", "eager", "ring")  # ring: a hand-written blockwise kernel (q, k, v, output, logsumexp)
DTYPES = ("bf16", "fp16", "fp32")
ZERO_STAGES = (0, 1, 2, 3)
OPTIMIZERS = tuple(MOMENT_BYTES)  # the optimizers whose state costs.sharded_states counts
# The plan fields limited to a list of values, and those that count something (at least one).
CHOICES = {"schedule": SCHEDULES, "recompute": RECOMPUTE, "offload": OFFLOAD, "framework": FRAMEWORKS,
           "attention": ATTENTION, "dtype": DTYPES, "zero": ZERO_STAGES, "optimizer": OPTIMIZERS}
DEGREES = ("dp", "tp", "pp", "cp", "ep", "micro_batch", "virtual_stages")


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    tp: int = 1
    sp: bool = False
    sp_gathered_inputs: bool = False  # SP that keeps the all-gathered column inputs (DTensor's SequenceParallel)
    tp_overlap: bool = False  # TP collectives overlapped with the GEMMs (Transformer Engine userbuffers, async TP)
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    framework: str = "torch"
    offload: str = "none"
    micro_batch: int = 1
    recompute: str = "none"
    dtype: str = "bf16"
    attention: str = "flash"
    optimizer: str = "adamw"
    # Implementation facts the cost model must know of a run (the registry sets them; the planner's
    # search leaves them at their defaults):
    grad_bucket_mb: float | None = None  # replicas all-reducing gradients per bucket (0: one per layer); None: once
    whole_embedding_grad: bool = False  # TP that keeps the vocabulary-split embedding's gradient whole (DTensor)
    vocab_parallel_loss: bool = True  # False: TP gathers the logits for a plain cross-entropy (whole on every rank)

    def __hash__(self) -> int:  # the cost model's caches hash a plan many times per candidate of a search
        try:
            return self._hash
        except AttributeError:
            object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in self.__dataclass_fields__)))
            return self._hash

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def value_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def activation_split(self) -> str:
        """How TP splits a layer's activations (a key of costs.activations.SPLITS)."""
        if self.sp:
            return "tensor_sequence_gathered" if self.sp_gathered_inputs else "tensor_sequence"
        return "tensor" if self.tp > 1 else "none"

    @property
    def activation_precision(self) -> str:
        """How activation values are stored (a key of costs.activations.PRECISIONS): plain PyTorch runs
        bf16 as autocast over fp32 weights; DeepSpeed, FSDP2 and Megatron compute with bf16 weights."""
        if self.dtype == "fp32":
            return "fp32"
        return "bf16_autocast" if self.framework == "torch" else "bf16_cast"

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where world rank `rank` sits on the mesh, in Megatron's order (tensor innermost, then
        context, data, pipeline): e.g. {"tp": 1, "cp": 0, "dp": 0, "pp": 1}."""
        out = {}
        for dim in ("tp", "cp", "dp", "pp"):
            rank, out[dim] = divmod(rank, getattr(self, dim))
        return out

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}{'+sp' if self.sp else ''}{'+ov' if self.tp_overlap else ''}", f"pp{self.pp}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.virtual_stages})" if self.virtual_stages > 1 else ""))
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += ["torch" if self.framework == "torch" else f"{self.framework}-z{self.zero}", f"mb{self.micro_batch}",
                  f"rc:{self.recompute}"]
        parts += [f"off:{self.offload}"] if self.offload != "none" else []
        return " ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown plan field(s): {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(cls.__dataclass_fields__)})")
        return cls(**d)


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `gpus_per_node` devices of one catalog accelerator (costs/hardware.yaml)."""

    accelerator: str
    nodes: int
    gpus_per_node: int = 8
    host_memory_gb: float | None = None  # per node; None: unlimited (offload never rejected for it)
    overrides: dict = field(default_factory=dict)  # what-ifs: e.g. {"network_gbps": 100}

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def device(self) -> dict:
        entry = hardware.by_name(self.accelerator)
        return {**entry, **self.overrides}

    def figures(self, stack: str | None = None) -> dict:
        """What a prediction on this cluster under `stack` reads (`costs.stacks.figures`): the
        accelerator's figures, the stack's schedule and efficiencies, the what-ifs, the node size."""
        return stacks.figures(self.accelerator, stack, {**self.overrides, "gpus_per_node": self.gpus_per_node})

    def scaled(self, **factors: float) -> Cluster:
        """A what-if: the same cluster with some catalog figures multiplied (e.g. network_gbps=2)."""
        device = self.device
        return replace(self, overrides={**self.overrides, **{k: device[k] * f for k, f in factors.items()}})


@dataclass(frozen=True)
class Workload:
    global_batch: int  # sequences per optimizer step
    seq_len: int
    dropout: float = 0.0  # hidden dropout probability: > 0 stores a mask per dropout (and eager attention's)

    @classmethod
    def from_training(cls, training: dict) -> Workload:
        """From an experiment's `training` settings."""
        return cls(training["global_batch_size"], training["seq_len"], training.get("dropout", 0.0))


def micro_batches(plan: Plan, workload: Workload) -> int:
    """Micro-batches each data-parallel replica runs per step (gradient accumulation x pipeline)."""
    return workload.global_batch // (plan.dp * plan.micro_batch)


def rejection(model: ModelShape, plan: Plan, cluster: Cluster, workload: Workload, stack: str | None = None) -> str | None:
    """Why `plan` cannot run `model` on `cluster` at `workload` under `stack` (the first reason, starting
    with the field at fault), or None. A plain chain of ifs: the search calls it for every candidate."""
    p, w = plan, workload
    for name, allowed in CHOICES.items():
        if getattr(p, name) not in allowed:
            return f"{name}: {getattr(p, name)!r} is not one of {allowed}"
    if min(p.dp, p.tp, p.pp, p.cp, p.ep, p.micro_batch, p.virtual_stages) < 1:
        name = next(name for name in DEGREES if getattr(p, name) < 1)
        return f"{name}: {getattr(p, name)} is not a count of at least 1"
    if p.world != cluster.gpus:
        return f"world: dp*tp*pp*cp = {p.world} is not the cluster's {cluster.gpus} GPUs"
    if p.tp > cluster.gpus_per_node:
        return f"tp: {p.tp} ranks would span nodes ({cluster.gpus_per_node} GPUs per node)"
    if model.num_heads % p.tp:
        return f"tp: {model.num_heads} heads are not divisible by tp={p.tp}"
    if model.kv_heads % p.tp and p.tp % model.kv_heads:
        return f"tp: {model.kv_heads} KV heads do not split over tp={p.tp}"
    if p.sp and p.tp == 1:
        return "sp: sequence parallelism needs tp > 1"
    if p.tp_overlap and p.tp == 1:
        return "tp_overlap: there are no tensor-parallel collectives to overlap (tp=1)"
    if p.sp_gathered_inputs and not p.sp:
        return "sp_gathered_inputs: only sequence parallelism gathers its inputs"
    if w.seq_len % p.cp:
        return f"cp: sequence {w.seq_len} is not divisible by cp={p.cp}"
    if p.sp and (w.seq_len // p.cp) % p.tp:
        return f"sp: the sequence shard of {w.seq_len // p.cp} tokens is not divisible by tp={p.tp}"
    if p.pp == 1 and p.schedule == "interleaved":
        return "schedule: a single pipeline stage (pp=1) has no schedule to interleave"
    if p.pp == 1 and p.virtual_stages > 1:
        return f"virtual_stages: a single pipeline stage (pp=1) has no {p.virtual_stages} chunks to interleave"
    if p.pp > 1 and p.schedule == "interleaved" and p.virtual_stages == 1:
        return "virtual_stages: the interleaved schedule needs 2 or more model chunks per rank (virtual_stages=2...)"
    if p.pp > 1 and p.virtual_stages > 1 and p.schedule != "interleaved":
        return f"virtual_stages: {p.virtual_stages} model chunks per rank need schedule=interleaved, not {p.schedule}"
    if model.num_layers < p.pp:
        return f"pp: {model.num_layers} layers cannot give each of {p.pp} pipeline ranks one"
    if not cuts_evenly(model.num_layers, p.pp * p.virtual_stages):
        return (f"{'virtual_stages' if p.virtual_stages > 1 else 'pp'}: {p.pp * p.virtual_stages} pipeline stages "
                f"(pp x virtual_stages) split neither the {model.num_layers} layers evenly nor "
                f"{model.num_layers} + 2 with the embedding and the head as one layer each")
    if p.ep > 1 and not model.num_experts:
        return f"ep: a dense model has no experts to split over ep={p.ep}"
    if model.num_experts % p.ep:
        return f"ep: {model.num_experts} experts are not divisible by ep={p.ep}"
    if (p.dp * p.cp) % p.ep:
        return f"ep: ep={p.ep} must divide the dp x cp = {p.dp * p.cp} ranks it is carved from"
    if w.global_batch % (p.dp * p.micro_batch):
        return f"micro_batch: global batch {w.global_batch} is not divisible by dp x micro_batch = {p.dp * p.micro_batch}"
    if p.pp > 1 and p.schedule == "interleaved" and micro_batches(p, w) % p.pp:
        return f"micro_batch: the interleaved schedule needs micro-batches ({micro_batches(p, w)}) in multiples of pp={p.pp}"
    if p.offload != "none" and not (p.framework == "deepspeed" and p.zero >= 1):
        return f"offload: only DeepSpeed ZeRO-1..3 offloads ({p.framework} ZeRO-{p.zero} was asked)"
    if p.offload == "optimizer+params" and p.zero != 3:
        return "offload: parameters offload only at ZeRO-3"
    if p.framework in ("megatron", "mcore") and p.zero > 1:
        return "zero: Megatron's distributed optimizer shards optimizer state only (zero 0 or 1)"
    if p.framework == "torch" and p.zero:
        return "zero: plain PyTorch replicas shard nothing (zero 0)"
    if p.grad_bucket_mb is not None and (p.framework != "torch" or p.grad_bucket_mb < 0):
        return "grad_bucket_mb: only plain PyTorch replicas bucket their gradient all-reduce (>= 0 MiB)"
    if p.whole_embedding_grad and p.tp == 1:
        return "whole_embedding_grad: only tensor parallelism splits the embedding"
    if p.framework == "fsdp2" and p.zero not in (2, 3):
        return "zero: FSDP2 shards gradients and parameters (zero 2 or 3)"
    if not 0 <= w.dropout < 1:
        return f"dropout: {w.dropout} is not a probability in [0, 1)"
    return stacks.rejection(p, stack)
