"""Search every valid plan of a model on a cluster at a batch: the plans that fit, ranked by
predicted throughput, and for the rest why not (grouped by reason).

The space (`Space`): tp over the powers of two within a node, cp, pp over the divisors whose stages
cut the layers evenly, dp as what is left of the world, sequence parallelism on/off, GPipe, 1F1B and
interleaved 1F1B (chunk counts that still cut evenly), ep over the divisors of the experts (MoE
only), the ZeRO stages of each framework (DeepSpeed 0-3 with and without offload, FSDP2, Megatron
with and without its distributed optimizer), micro-batch sizes and activation recompute. A space
can be narrowed: fields fixed at one value (`Space.fixing`), techniques left out (`Space.without`).
Memory is checked for every valid candidate; time is computed only for those that fit.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from shardlab.costs import stacks
from shardlab.costs.plan import RECOMPUTE, SCHEDULES, Cluster, Plan, Workload, rejection
from shardlab.costs.predict import Prediction, evaluate
from shardlab.costs.shapes import ModelShape, cuts_evenly

# (framework, zero, offload) combinations worth searching
SHARDINGS = (
    ("torch", 0, "none"), ("megatron", 0, "none"), ("megatron", 1, "none"), ("mcore", 0, "none"), ("mcore", 1, "none"),
    ("deepspeed", 1, "none"), ("deepspeed", 2, "none"), ("deepspeed", 3, "none"),
    ("deepspeed", 2, "optimizer"), ("deepspeed", 3, "optimizer"), ("deepspeed", 3, "optimizer+params"),
    ("fsdp2", 2, "none"), ("fsdp2", 3, "none"),
)


# Techniques a search can leave out (`Space.without`), in the command line's words.
TECHNIQUES = {
    "tp": "tensor parallelism (tp=1, and so no sp)", "sp": "sequence parallelism", "pp": "pipeline parallelism (pp=1)",
    "interleaved": "the interleaved schedule", "cp": "context parallelism (cp=1)", "ep": "expert parallelism (ep=1)",
    "offload": "optimizer and parameter offload", "recompute": "activation recompute",
    "tp_overlap": "tensor-parallel communication overlap",
}


@dataclass(frozen=True)
class Space:
    """The plans a search tries. The degrees left at None take every value that can fill the cluster:
    tp the powers of two within a node, pp the divisors of the ranks left whose stages cut the layers
    evenly (`shapes.cuts_evenly`), dp what remains, ep the powers of two dividing dp x cp and the
    experts. A value given explicitly is tried as given, so `rejection` says what is wrong with it."""

    cp: tuple[int, ...] = (1, 2, 4, 8, 16)
    micro_batch: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = RECOMPUTE
    virtual_stages: tuple[int, ...] = (2, 4)
    shardings: tuple = SHARDINGS
    dtype: str = "bf16"
    attention: str = "flash"
    optimizer: str = "adamw"
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    sp: tuple[bool, ...] = (False, True)
    tp_overlap: tuple[bool, ...] = (False, True)
    schedule: tuple[str, ...] = SCHEDULES

    def for_stack(self, stack: str | None) -> Space:
        """This space narrowed to what `stack` can run: its sharding accounting, its recompute
        granularities, TP overlap where it has it (stacks.yaml)."""
        s = stacks.get(stack)
        # what the stack cannot run goes, unless nothing would be left: then `rejection` says why
        narrow = lambda values, ok: tuple(v for v in values if ok(v)) or values  # noqa: E731
        return replace(self, shardings=narrow(self.shardings, lambda x: x[0] in s.frameworks),
                       recompute=narrow(self.recompute, lambda r: r in s.recompute),
                       tp_overlap=narrow(self.tp_overlap, lambda o: s.tp_overlap or not o))

    def without(self, technique: str) -> Space:
        """This space with one technique of TECHNIQUES left out."""
        changes = {"tp": {"tp": (1,)}, "sp": {"sp": (False,)}, "pp": {"pp": (1,)}, "cp": {"cp": (1,)},
                   "ep": {"ep": (1,)}, "recompute": {"recompute": ("none",)}, "tp_overlap": {"tp_overlap": (False,)},
                   "interleaved": {"schedule": tuple(s for s in self.schedule if s != "interleaved")},
                   "offload": {"shardings": tuple(s for s in self.shardings if s[2] == "none")}}
        return replace(self, **changes[technique])

    def fixing(self, fixed: dict) -> Space:
        """This space with some plan fields at one value each (e.g. {"tp": 8, "zero": 1}); a ValueError
        for a field the search does not choose (an implementation fact of a run)."""
        out = self
        for name, value in fixed.items():
            if name == "virtual_stages" and value > 1:
                out = replace(out, virtual_stages=(value,), schedule=("interleaved",))
            elif name == "virtual_stages":
                out = out.without("interleaved")
            elif name in SHARDING_FIELDS:
                continue  # fixed together, below
            elif name not in Space.__dataclass_fields__ or name == "shardings":
                raise ValueError(f"{name}: the search does not choose it (it can fix "
                                 f"{', '.join(sorted(FIXABLE))})")
            else:
                out = replace(out, **{name: value if isinstance(getattr(Space(), name), str) else (value,)})
        return replace(out, shardings=_fixed_shardings(out.shardings, fixed))


SHARDING_FIELDS = ("framework", "zero", "offload")
FIXABLE = (set(Space.__dataclass_fields__) - {"shardings"}) | set(SHARDING_FIELDS)


def _fixed_shardings(shardings: tuple, fixed: dict) -> tuple:
    """The shardings that agree with the fixed framework/zero/offload fields; else the one they name
    (the fields not given at Plan's defaults), for `rejection` to judge."""
    if not any(name in fixed for name in SHARDING_FIELDS):
        return shardings
    agreeing = tuple(s for s in shardings if all(fixed.get(n, v) == v for n, v in zip(SHARDING_FIELDS, s)))
    return agreeing or (tuple(fixed.get(n, Plan.__dataclass_fields__[n].default) for n in SHARDING_FIELDS),)


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


def _pipeline_degrees(space: Space, layers: int, ranks: int) -> list[int]:
    if space.pp is not None:
        return [p for p in space.pp if ranks % p == 0]
    return [p for p in divisors(ranks) if p <= layers and cuts_evenly(layers, p)]


def _schedules(space: Space, layers: int, pp: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs of `pp` ranks; one plain schedule without a pipeline."""
    plain = [s for s in space.schedule if s != "interleaved"]
    if pp == 1:
        return [("1f1b" if "1f1b" in plain else plain[0], 1)] if plain else []
    interleaved = [("interleaved", v) for v in space.virtual_stages
                   if "interleaved" in space.schedule and cuts_evenly(layers, pp * v)]
    return [(s, 1) for s in plain] + interleaved


def _expert_degrees(space: Space, model: ModelShape, ranks: int) -> list[int]:
    if space.ep is not None:
        return list(space.ep)
    if not model.num_experts:
        return [1]
    return [e for e in _powers_of_two(ranks) if ranks % e == 0 and model.num_experts % e == 0]


def candidates(model: ModelShape, cluster: Cluster, workload: Workload, space: Space = Space()):
    """Every plan of the space whose degrees multiply to the cluster's GPU count."""
    world, layers = cluster.gpus, model.num_layers
    for tp in space.tp if space.tp is not None else _powers_of_two(cluster.gpus_per_node):
        for cp in (c for c in space.cp if world % (tp * c) == 0):
            rest = world // (tp * cp)
            for pp in _pipeline_degrees(space, layers, rest):
                dp = rest // pp
                if space.dp is not None and dp not in space.dp:
                    continue
                sps = [sp for sp in space.sp if tp > 1 or not sp]
                overlaps = [o for o in space.tp_overlap if tp > 1 or not o]
                for sp, ov, (schedule, v), ep, (framework, zero, offload), mb, rc in itertools.product(
                        sps, overlaps, _schedules(space, layers, pp), _expert_degrees(space, model, dp * cp),
                        space.shardings, space.micro_batch, space.recompute):
                    yield Plan(dp=dp, tp=tp, sp=sp, tp_overlap=ov, pp=pp, schedule=schedule, virtual_stages=v, cp=cp,
                               ep=ep, zero=zero, framework=framework, offload=offload, micro_batch=mb, recompute=rc,
                               dtype=space.dtype, attention=space.attention, optimizer=space.optimizer)


def reason_kind(reason: str) -> str:
    """'tp: 40 heads are not divisible by tp=16' -> 'tp'; memory reasons -> 'out of memory'."""
    return reason.split(":", 1)[0]


def rank_key(p: Prediction) -> tuple:
    """Fastest first; on a tie (the model hides some communication completely), the plan that
    communicates less (lower ZeRO stage, no offload), then the one with more memory left."""
    return -p.tokens_per_s, p.plan.zero, p.plan.offload != "none", p.device_bytes


def search(model: ModelShape, cluster: Cluster, workload: Workload, top: int = 10, space: Space = Space(),
           stack: str | None = None) -> SearchResult:
    """The plans of `space` that `stack` can run on `cluster`, ranked (the fitting ones) or grouped by
    why not (the others)."""
    start = time.perf_counter()
    result = SearchResult([])
    fitting = []
    figures = cluster.figures(stack)
    for plan in candidates(model, cluster, workload, space.for_stack(stack)):
        result.candidates += 1
        reason = rejection(model, plan, cluster, workload, stack)
        if reason is None:
            prediction = evaluate(model, plan, cluster, workload, stack, figures=figures, time_only_if_fits=True)
            reason = None if prediction.fits else prediction.why
        if reason is not None:
            kind = reason_kind(reason)
            result.rejected[kind] += 1
            if kind not in result.examples:
                result.examples[kind] = f"{plan.label()}: {reason}"
            continue
        fitting.append(prediction)
    result.ranked = sorted(fitting, key=rank_key)[:top]
    result.fitting = len(fitting)
    result.seconds = time.perf_counter() - start
    return result
