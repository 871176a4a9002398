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

`rejection` says why a plan cannot run (a divisibility, the batch, a placement), naming the field,
before any cost is computed. It is also the registry's gate: a strategy's config check builds its run's
Plan and asks `rejection` under this project's stack, so the rules state what the libraries accept.
On that stack the pipeline follows torch.distributed.pipelining (any stage cut up to layers + 2, the
1F1B minimum of pp micro-batches, the interleaved schedule's rounds); on the planner's stacks the
pp x virtual_stages stages hold equal shares of the model: the layers split evenly, or the layers + 2
with the embedding and the head as one layer each (`shapes.cuts_evenly`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from shardlab.costs import hardware, stacks
from shardlab.costs.plan_rules import (HAND_CUT_STACKS, batch_rejection, model_rejection, schedule_rejection,
                                       sequence_rejection, sharding_rejection)
from shardlab.costs.shapes import ModelShape
from shardlab.costs.sharded_states import DTYPE_BYTES, MOMENT_BYTES

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
    # Whether the once-per-step gradient reduction runs behind the backward (DDP's buckets, FSDP2's
    # reduce-scatters) or after it (a plain all-reduce, DeepSpeed without overlap_comm); None: as the stack does.
    grad_sync_overlap: bool | None = None
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
        return DTYPE_BYTES[self.dtype]

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
        parts += ["torch" if self.framework == "torch" and not self.zero else f"{self.framework}-z{self.zero}", f"mb{self.micro_batch}",
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


def rejection(model: ModelShape | None, plan: Plan, cluster: Cluster, workload: Workload,
              stack: str | None = None) -> str | None:
    """Why `plan` cannot run `model` on `cluster` at `workload` under `stack` (the first reason, starting
    with the field at fault: a Plan, Workload or Cluster field), or None. `model` None: a model whose shape
    is not known yet (checked when it is loaded), so its divisibilities are skipped. A plain chain of
    checks: the search calls it for every candidate."""
    hand_cut = stack in HAND_CUT_STACKS
    return (_value_rejection(plan) or _placement_rejection(plan, cluster)
            or (model_rejection(model, plan, hand_cut) if model is not None else None)
            or sequence_rejection(plan, workload) or schedule_rejection(plan)
            or batch_rejection(plan, workload, hand_cut) or sharding_rejection(plan)
            or _workload_rejection(workload) or stacks.rejection(plan, stack))


def _value_rejection(p: Plan) -> str | None:
    for name, allowed in CHOICES.items():
        if getattr(p, name) not in allowed:
            return f"{name}: {getattr(p, name)!r} is not one of {allowed}"
    if min(p.dp, p.tp, p.pp, p.cp, p.ep, p.micro_batch, p.virtual_stages) < 1:
        name = next(name for name in DEGREES if getattr(p, name) < 1)
        return f"{name}: {getattr(p, name)} is not a count of at least 1"
    if p.sp and p.tp == 1:
        return "sp: sequence parallelism needs tp > 1"
    if p.tp_overlap and p.tp == 1:
        return "tp_overlap: there are no tensor-parallel collectives to overlap (tp=1)"
    if p.sp_gathered_inputs and not p.sp:
        return "sp_gathered_inputs: only sequence parallelism gathers its inputs"
    if p.whole_embedding_grad and p.tp == 1:
        return "whole_embedding_grad: only tensor parallelism splits the embedding"
    return None


def _placement_rejection(p: Plan, cluster: Cluster) -> str | None:
    if p.world != cluster.gpus:
        return f"world: dp*tp*pp*cp = {p.world} is not the cluster's {cluster.gpus} GPUs"
    if p.tp > cluster.gpus_per_node:
        return f"tp: {p.tp} ranks would span nodes ({cluster.gpus_per_node} GPUs per node)"
    if (p.dp * p.cp) % p.ep:
        return f"ep: ep={p.ep} must divide the dp x cp = {p.dp * p.cp} ranks it is carved from"
    return None


def _workload_rejection(w: Workload) -> str | None:
    if not 0 <= w.dropout < 1:
        return f"dropout: {w.dropout} is not a probability in [0, 1)"
    return None
