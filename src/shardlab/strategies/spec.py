"""What the registry knows about a strategy: every fact the workflow, the cost models, the tables
and the report need, so that none of them keeps its own list of strategy names.

Torch-free: the Snakefile and `shardlab check-config` read the registry before anything runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from shardlab.costs.comm_volume import Call
from shardlab.costs.memory import ModelStates, ZeroRung
from shardlab.costs.plan import rung_fields
from shardlab.costs.shapes import ModelShape, StepShape
from shardlab.errors import ConfigError

# (model, step, world size, strategy options) -> the collectives the busiest rank issues per step
CommPlan = Callable[[ModelShape, StepShape, int, dict], list[Call]]
# (model, world size, strategy options, dtype, optimizer) -> model-state bytes of each rank
MemoryPlan = Callable[[ModelShape, int, dict, str, str], list[ModelStates]]
# (world size, strategy options) -> the planner's Plan fields of a run (costs.plan.Plan: dp, tp, pp, ...)
Layout = Callable[[int, dict], dict]
# (experiment, "experiments.<exp>.strategy_options.<strategy>", world size or "auto") -> raise ConfigError
OptionCheck = Callable[[dict, str, "int | str"], None]


def whole_world(world: int, options: dict) -> int:
    return world


def one(world: int, options: dict) -> int:
    return 1


def no_checks(exp: dict, where: str, world: int | str) -> None:
    return None


@dataclass(frozen=True)
class StrategySpec:
    name: str
    target: str  # "module:Class", imported only when a run starts
    family: str  # what the report calls the technique: "data parallel", "zero", ...
    topic: str  # its report section, table module and rule file: reports/sections/<topic>.qmd, ...
    summary: str
    comm_plan: CommPlan
    model_states: MemoryPlan
    reference: str = "single"  # the run its losses must reproduce (same experiment)
    # The runs whose distance from the reference is the rounding noise a parity check allows (tables.parity):
    # on a reference, its repeat in another summation order (None where no other order is the same math);
    # on a strategy whose bf16 is its library's own recipe (bf16 weights, not autocast), that recipe on
    # one process, compared outside fp32 only.
    reordered: str | None = None
    bf16_twin: str | None = None
    twin: str | None = None  # for a hand-written strategy: the production one it is measured against
    single_process: bool = False
    data_parallel_size: Callable[[int, dict], int] = whole_world  # ranks that split the global batch
    check_options: OptionCheck = no_checks
    zero: ZeroRung | None = None  # the ZeRO rung, for strategies on the ZeRO ladder
    # How a layer's activations split over ranks at the same per-rank batch (costs.activations):
    # "none" (whole on every rank), "tp" (Megatron TP), "tp_sp" (TP + sequence parallel, shard saved),
    # "tp_sp_gathered" (TP + SP keeping the all-gathered column inputs, as DTensor does).
    activation_split: str = "none"
    # False when the communication a run times is only part of its plan (what overlap left exposed, or
    # one group's collectives), so it cannot be held against a model of all of it (tables.communication).
    comm_timed_in_full: bool = True
    # How a run of this strategy maps onto the planner's Plan (costs.plan): None = data parallel over
    # every rank, on the ZeRO rung of `zero` when set; plain PyTorch ("torch") unless a layout says.
    layout: Layout | None = None

    def plan_fields(self, world: int, options: dict) -> dict:
        """The planner's view of a run: Plan fields (degrees, schedule, ZeRO stage) for `world` ranks."""
        if self.layout is not None:
            return {"framework": "torch", **self.layout(world, options)}
        return {"dp": world, **(rung_fields(self.zero) if self.zero is not None else {"framework": "torch"})}

    def options(self, exp: dict) -> dict:
        return exp.get("strategy_options", {}).get(self.name, {})

    def world_size(self, exp: dict) -> int | str:
        """Processes a run of this strategy uses in `exp` ('auto' until the launcher counts devices)."""
        return 1 if self.single_process else self.options(exp).get("world_size", exp["launch"]["world_size"])

    def check(self, exp: dict, where: str, world: int | str | None = None) -> None:
        """Every check of this strategy in `exp`; `world` overrides 'auto' once it is known (launch)."""
        world = self.world_size(exp) if world is None else world
        self.check_options(exp, f"{where}.strategy_options.{self.name}", world)
        if world == "auto":
            return  # checked again at launch, once the device count is known
        training = exp["training"]
        dp = self.data_parallel_size(int(world), self.options(exp))
        gbs, mbs = training["global_batch_size"], training.get("micro_batch_size")
        if gbs % dp:
            raise ConfigError(f"{where}.training.global_batch_size",
                              f"{gbs} is not divisible by the {dp} data-parallel ranks of '{self.name}'")
        if mbs and (gbs // dp) % mbs:
            raise ConfigError(f"{where}.training.micro_batch_size",
                              f"{mbs} does not divide the per-rank batch {gbs // dp} of '{self.name}'")

    def load(self):
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)
