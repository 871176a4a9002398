"""Search every valid plan of a model on a cluster at a batch: the plans that fit, ranked by
predicted throughput, and for the rest why not (grouped by reason).

The space (`Space`): tp over the powers of two within a node, cp, pp over the divisors that the
layers can fill, dp as what is left of the world, sequence parallelism on/off, GPipe, 1F1B and
interleaved 1F1B, ep over the divisors of the experts (MoE only), the ZeRO stages of each framework
(DeepSpeed 0-3 with and without offload, FSDP2, Megatron with and without its distributed
optimizer), micro-batch sizes and activation recompute. Memory is checked for every valid
candidate; time is computed only for those that fit.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from shardlab.costs.plan import Cluster, Plan, Workload, rejection
from shardlab.costs.predict import Prediction, evaluate
from shardlab.costs.shapes import ModelShape

# (framework, zero, offload) combinations worth searching
SHARDINGS = (
    ("megatron", 0, "none"), ("megatron", 1, "none"),
    ("deepspeed", 1, "none"), ("deepspeed", 2, "none"), ("deepspeed", 3, "none"),
    ("deepspeed", 2, "optimizer"), ("deepspeed", 3, "optimizer"), ("deepspeed", 3, "optimizer+params"),
    ("fsdp2", 3, "none"),
)


@dataclass(frozen=True)
class Space:
    cp: tuple[int, ...] = (1, 2, 4, 8, 16)
    micro_batch: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    virtual_stages: tuple[int, ...] = (2, 4)
    shardings: tuple = SHARDINGS
    dtype: str = "bf16"
    attention: str = "flash"


@dataclass
class SearchResult:
    ranked: list[Prediction]  # plans that fit, fastest first
    rejected: Counter = field(default_factory=Counter)  # reason kind -> candidates
    examples: dict = field(default_factory=dict)  # reason kind -> one full reason
    candidates: int = 0
    fitting: int = 0
    seconds: float = 0.0


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelShape, cluster: Cluster, workload: Workload, space: Space = Space()):
    """Every plan of the space whose degrees multiply to the cluster's GPU count."""
    world = cluster.gpus
    for tp in _powers_of_two(cluster.gpus_per_node):
        for cp in (c for c in space.cp if world % (tp * c) == 0):
            rest = world // (tp * cp)
            for pp in (p for p in divisors(rest) if p <= model.num_layers):
                dp = rest // pp
                eps = ([e for e in _powers_of_two(dp * cp) if (dp * cp) % e == 0 and model.num_experts % e == 0]
                       if model.num_experts else [1])
                schedules = [("1f1b", 1)] if pp == 1 else [("gpipe", 1), ("1f1b", 1)] + [
                    ("interleaved", v) for v in space.virtual_stages if pp * v <= model.num_layers]
                for sp, (schedule, v), ep, (framework, zero, offload), mb, rc in itertools.product(
                        (False, True) if tp > 1 else (False,), schedules, eps, space.shardings,
                        space.micro_batch, space.recompute):
                    yield Plan(dp=dp, tp=tp, sp=sp, pp=pp, schedule=schedule, virtual_stages=v, cp=cp, ep=ep,
                               zero=zero, framework=framework, offload=offload, micro_batch=mb, recompute=rc,
                               dtype=space.dtype, attention=space.attention)


def reason_kind(reason: str) -> str:
    """'tp: 40 heads are not divisible by tp=16' -> 'tp'; memory reasons -> 'out of memory'."""
    return reason.split(":", 1)[0]


def rank_key(p: Prediction) -> tuple:
    """Fastest first; on a tie (the model hides some communication completely), the plan that
    communicates less (lower ZeRO stage, no offload), then the one with more memory left."""
    return -p.tokens_per_s, p.plan.zero, p.plan.offload != "none", p.device_bytes


def search(model: ModelShape, cluster: Cluster, workload: Workload, top: int = 10, space: Space = Space(),
           dropout: bool = False) -> SearchResult:
    start = time.perf_counter()
    result = SearchResult([])
    fitting = []
    device = cluster.device_figures()
    for plan in candidates(model, cluster, workload, space):
        result.candidates += 1
        reason = rejection(model, plan, cluster, workload)
        if reason is None:
            memory_only = evaluate(model, plan, cluster, workload, dropout, with_time=False, device=device)
            reason = None if memory_only.fits else memory_only.why
        if reason is not None:
            kind = reason_kind(reason)
            result.rejected[kind] += 1
            if kind not in result.examples:
                result.examples[kind] = f"{plan.label()}: {reason}"
            continue
        fitting.append(plan)
    predictions = [evaluate(model, plan, cluster, workload, dropout, device=device) for plan in fitting]
    result.ranked = sorted(predictions, key=rank_key)[:top]
    result.fitting = len(fitting)
    result.seconds = time.perf_counter() - start
    return result
