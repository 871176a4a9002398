"""What the registry knows about a strategy: every fact the workflow, the cost models, the tables
and the report need, so that none of them keeps its own list of strategy names.

Torch-free: the Snakefile and `shardlab check-config` read the registry before anything runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

from shardlab.costs.plan import Cluster, Plan, Workload, rejection
from shardlab.costs.shapes import ModelShape, known_models, model_shape
from shardlab.errors import ConfigError

RUN_STACK = "shardlab"  # the stack (costs/stacks.yaml) whose rules a registry run is checked under
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size")
TRAINING_FIELDS = ("seq_len", "dropout", "dtype", "optimizer", "recompute")  # Plan or Workload fields set by `training`
WORLD_FIELDS = ("world", "dp", "tp", "pp", "cp", "ep")  # degrees that, unless an option sets them, the world size does


class Family(StrEnum):
    """What the report calls a technique (a StrEnum: its value is what tables and summaries print)."""

    BASELINE = "baseline"
    DATA_PARALLEL = "data parallel"
    ZERO = "zero"
    TENSOR_PARALLEL = "tensor parallel"
    PIPELINE_PARALLEL = "pipeline parallel"
    HYBRID = "hybrid"
    CONTEXT_PARALLEL = "context parallel"
    EXPERT_PARALLEL = "expert parallel"


@dataclass(frozen=True)
class FamilyGuide:
    """What a reader choosing a technique needs beyond this study's measurements, which hold on any
    hardware: how the technique's communication meets its compute, where in a cluster it goes, and what
    makes it necessary (the report's decision guide, `tables.guide`)."""

    title: str  # the technique as the report names it
    overlap: str  # whether its communication can hide behind compute, and how
    placement: str  # where in the topology its group belongs
    needed_when: str  # what forces it (the planner's scenarios show where it did)


GUIDE = {
    Family.DATA_PARALLEL: FamilyGuide(
        "Data parallelism", "bucketed all-reduces hide behind the backward pass (DDP), naive waits for them",
        "outermost, across nodes (one all-reduce a step)", "the model states fit on one device"),
    Family.ZERO: FamilyGuide(
        "ZeRO / FSDP", "weight gathers and gradient reduce-scatters hide behind compute when prefetched",
        "across the data-parallel group, usually across nodes (stage 3: 1.5× an all-reduce's traffic)",
        "the model states, 16 bytes a parameter with Adam in mixed precision, do not fit on one device"),
    Family.TENSOR_PARALLEL: FamilyGuide(
        "Tensor + sequence parallelism", "not hidden: every layer waits for its collectives, forward and backward",
        "inside a node (NVLink)", "a layer's weights or activations are too large for one device"),
    Family.PIPELINE_PARALLEL: FamilyGuide(
        "Pipeline parallelism", "its cost is the bubble, cut by more micro-batches or interleaved stages",
        "across nodes (one activation a micro-batch between neighbours)",
        "the model does not fit in one node's tensor-parallel group"),
    Family.CONTEXT_PARALLEL: FamilyGuide(
        "Context parallelism (ring attention)", "keys and values pass around the ring while each rank computes",
        "inside a node first", "one long sequence's activations do not fit, even with sequence parallelism"),
    Family.EXPERT_PARALLEL: FamilyGuide(
        "Expert parallelism", "not hidden here: two all-to-alls a layer (production stacks overlap them)",
        "inside a node or a rail-aligned group", "a mixture of experts has more expert weights than a device holds"),
}


# (world size, strategy options) -> the costs.plan.Plan fields of a run: its degrees, schedule, ZeRO
# flavour and implementation facts (not dtype, optimizer or micro-batch rows: the experiment's).
# A pipeline may add "micro_batches" (per step), from which the rows per micro-batch follow.
PlanFields = Callable[[int, dict], dict]
# (the experiment's model shape, strategy options) -> the model the strategy trains (e.g. its MoE variant)
ModelOf = Callable[[ModelShape, dict], ModelShape]
# (the spec, experiment, "experiments.<exp>", world size or "auto") -> raise ConfigError naming the field.
# Option checks read names and types only: whether the run can run is the Plan's question (`StrategySpec.check`).
OptionCheck = Callable[["StrategySpec", dict, str, "int | str"], None]


def replicas(world: int, options: dict) -> dict:
    """Plain data parallelism over every rank: the plan of a run that says nothing else."""
    return {"dp": world}


def only_options(*known: str) -> OptionCheck:
    """A check that rejects any strategy option but `known` (and the launcher's world_size)."""
    def check(spec: StrategySpec, exp: dict, where: str, world: int | str) -> None:
        allowed = {"world_size", *known}
        for key in spec.options(exp):
            if key not in allowed:
                raise ConfigError(spec.option_field(where, key), f"unknown option (known: {', '.join(sorted(allowed))})")

    return check


def experiment_shape(exp: dict) -> ModelShape | None:
    """The experiment's model shape: its own sizes (local and pretrained models), else the catalog's
    (costs/models.yaml) by its name or hub id; None where neither says (checked when it is loaded)."""
    model = exp["model"]
    if all(key in model for key in SHAPE_FIELDS):
        return ModelShape.from_dict(model)
    for name in (model.get("name"), str(model.get("hub_id", "")).rpartition("/")[2]):
        if name in known_models():
            return model_shape(name)
    return None


def training_recompute(exp: dict) -> str:
    return exp["training"].get("recompute", "none")


def all_of(*checks: OptionCheck) -> OptionCheck:
    def check(spec: StrategySpec, exp: dict, where: str, world: int | str) -> None:
        for one in checks:
            one(spec, exp, where, world)

    return check


@dataclass(frozen=True)
class StrategySpec:
    """A strategy is a Plan (what the cost model predicts) plus an implementation (what runs)."""

    name: str
    target: str  # "module:Class", imported only when a run starts
    family: Family
    topic: str  # its report section, table module and rule file: reports/sections/<topic>.qmd, ...
    summary: str
    title: str = ""  # the name a reader reads in the report's prose (set by the registry, `strategies.TITLES`)
    plan: PlanFields = replicas
    model: ModelOf | None = None  # None: the experiment's model as it is
    reference: str = "single"  # the run its losses must reproduce (same experiment)
    # The runs whose distance from the reference is the rounding noise a parity check allows (tables.parity):
    # on a reference, its repeat in another summation order (None where no other order is the same math);
    # on a strategy whose bf16 is its library's own recipe (bf16 weights, not autocast), that recipe on
    # one process, compared outside fp32 only.
    reordered: str | None = None
    bf16_twin: str | None = None
    twin: str | None = None  # for a hand-written strategy: the production one it is measured against
    single_process: bool = False
    check_options: OptionCheck = only_options()
    micro_batch_rows: Callable[[int], int] | None = None  # rows the implementation runs of a micro-batch, if fewer
    # (Plan field, option key) pairs: the option that sets a Plan field, named when the Plan is rejected for
    # it (several keys for one field: the first one the experiment gives, else the first; an option that
    # overrides a training field only where the experiment gives it).
    plan_options: tuple[tuple[str, str], ...] = ()
    # False when the communication a run times is only part of its plan (what overlap left exposed, or
    # one group's collectives), so it cannot be held against a model of all of it (tables.communication).
    comm_timed_in_full: bool = True

    def plan_fields(self, world: int, options: dict) -> dict:
        """The Plan fields of a run on `world` ranks (the Plan's defaults, plain PyTorch among them,
        transformers' SDPA attention, and gradients reduced after the backward, unless the strategy says)."""
        return {"attention": "sdpa", "grad_sync_overlap": False, **self.plan(1 if self.single_process else world, options)}

    def run_plan(self, exp: dict, world: int) -> Plan:
        """The whole Plan of this strategy's run in `exp` on `world` ranks."""
        fields = self.plan_fields(world, self.options(exp))
        n_micro = fields.pop("micro_batches", None)
        recompute = fields.pop("recompute", training_recompute(exp))
        training = exp["training"]
        local = training["global_batch_size"] // max(1, fields.get("dp", 1))  # dp 0: the Plan rejects it by name
        rows = local // n_micro if n_micro else min(training.get("micro_batch_size") or local, local)
        rows = self.micro_batch_rows(rows) if self.micro_batch_rows else rows
        return Plan(**fields, micro_batch=rows, dtype=training["dtype"], optimizer=training["optimizer"],
                    recompute=recompute)

    def run_model(self, model: ModelShape, exp: dict) -> ModelShape:
        """The model shape this strategy trains in `exp`, from the experiment's."""
        return model if self.model is None else self.model(model, self.options(exp))

    def data_parallel_size(self, world: int, options: dict) -> int:
        """Ranks that split the global batch."""
        return self.plan_fields(world, options).get("dp", 1)

    def options(self, exp: dict) -> dict:
        return exp.get("strategy_options", {}).get(self.name, {})

    def option_field(self, where: str, key: str | None = None) -> str:
        """The config path of this strategy's options in the experiment at `where` (or of one of them)."""
        return f"{where}.strategy_options.{self.name}" + (f".{key}" if key else "")

    def world_size(self, exp: dict) -> int | str:
        """Processes a run of this strategy uses in `exp` ('auto' until the launcher counts devices)."""
        return 1 if self.single_process else self.options(exp).get("world_size", exp["launch"]["world_size"])

    def check(self, exp: dict, where: str, world: int | str | None = None) -> None:
        """The one gate of this strategy in `exp` (at `where`, "experiments.<name>"): its options' names
        and types, then `rejection` of its run's Plan, as a ConfigError naming the config field that sets
        what is at fault. `world` overrides 'auto' once it is known (launch)."""
        world = self.world_size(exp) if world is None else world
        self.check_options(self, exp, where, world)
        if world == "auto":
            return  # checked again at launch, once the device count is known
        problem = self.rejection(exp, int(world))
        if problem:
            plan_field, reason = problem
            raise ConfigError(self.config_field(exp, where, plan_field, int(world)),
                              f"{reason} ('{self.name}' on {world} ranks)")

    def rejection(self, exp: dict, world: int) -> tuple[str, str] | None:
        """(the Plan field at fault, why) this strategy cannot run in `exp` on `world` ranks, or None: its
        options must ask for whole micro-batches (or its Plan would be another run's), and
        `costs.plan.rejection` must accept its run's Plan under this project's stack."""
        unheld = self.unheld_micro_batches(exp, world)
        if unheld:
            return "micro_batch", unheld
        shape = experiment_shape(exp)
        model = self.run_model(shape, exp) if shape else None
        cluster = Cluster("cpu", nodes=1, gpus_per_node=1 if self.single_process else world)
        reason = rejection(model, self.run_plan(exp, world), cluster, Workload.from_training(exp["training"]), RUN_STACK)
        return (reason.partition(":")[0], reason) if reason else None

    def unheld_micro_batches(self, exp: dict, world: int) -> str | None:
        """Why the micro-batches the options or `training.micro_batch_size` ask for do not split each
        replica's batch evenly (the Plan holds equal micro-batches only), or None."""
        fields, training = self.plan_fields(world, self.options(exp)), exp["training"]
        gbs, dp = training["global_batch_size"], fields.get("dp", 1)
        if dp < 1 or gbs % dp:
            return None  # the Plan's degree or batch rule names it
        local, count, rows = gbs // dp, fields.get("micro_batches"), training.get("micro_batch_size")
        if count and local % count:
            return f"micro_batch: n_microbatches={count} does not divide the per-replica batch {local}"
        if rows and local % rows:
            return f"micro_batch: micro_batch_size={rows} does not divide the per-rank batch {local}"
        return None

    def config_field(self, exp: dict, where: str, plan_field: str, world: int) -> str:
        """The config field behind a Plan (or Workload) field of this strategy's run in `exp` on `world`
        ranks: the option that sets it, a training setting, or the world size."""
        options, training = self.options(exp), exp["training"]
        # An option behind a training field names the fault only where the experiment gives it.
        keys = [key for field, key in self.plan_options
                if field == plan_field and (key in options or plan_field not in TRAINING_FIELDS)]
        if plan_field == "micro_batch" and training["global_batch_size"] % self.data_parallel_size(world, options):
            return f"{where}.training.global_batch_size"
        if keys:
            return self.option_field(where, next((key for key in keys if key in options), keys[0]))
        if plan_field == "micro_batch":
            return f"{where}.training.{'micro_batch_size' if training.get('micro_batch_size') else 'global_batch_size'}"
        if plan_field in TRAINING_FIELDS:
            return f"{where}.training.{plan_field}"
        if plan_field in WORLD_FIELDS:
            return self.option_field(where, "world_size") if "world_size" in options else f"{where}.launch.world_size"
        return self.option_field(where)

    def load(self):
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)

    def build(self, model, topo, training: dict, options: dict):
        """The implementation, set up for one run (imports torch and the strategy's module)."""
        return self.load()(model, topo, training, options, name=self.name)

