"""A rehearsal of a cluster plan: the plan a search found for a large model on a large cluster, scaled down to
the same composition on as few ranks as its degrees allow and a toy GPT-NeoX, as an experiment block whose
composed run a laptop trains beside the single-device reference. The run then shows, before the cluster is
paid for, that the composition computes the reference's losses (the parity rule) and holds the memory per
rank the cost model predicts for it.

The composition kept: which of dp, tp, pp, cp are > 1 (each becomes 2: at most 16 ranks), sequence
parallelism, the pipeline schedule (interleaved with 2 chunks per rank), how dp shards the model, the
recompute mode and the micro-batch rows. What a composed run does not do is refused by name
(`NotRehearsable`): expert parallelism, offload, DeepSpeed's ZeRO-2/3 engine, per-op recompute. What only
changes speed is dropped (TP communication overlap, the attention kernel), and the toy is GPT-NeoX whatever
the plan's model (no GQA or SwiGLU). Torch-free: the `plan-export` command line imports it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import yaml

from shardlab.config import REPO_ROOT, resolve_experiment
from shardlab.costs.plan import Cluster, Plan, Workload
from shardlab.costs.planner import Scenario, scenario
from shardlab.costs.search import Space, search
from shardlab.costs.shapes import ModelShape
from shardlab.strategies import get_spec
from shardlab.strategies.composed.runs import DP_SHARD, composed_options, run_name

MAX_RANKS = 16  # dp x tp x pp x cp at 2 each
NAME = "rehearsal"  # the experiment's name in the block's check
DEFAULT_CONFIG = REPO_ROOT / "config" / "config.yaml"  # the defaults a rehearsal is resolved against
PLANNING = REPO_ROOT / "config" / "planning.yaml"  # the planning scenarios every study shares (the Snakefile's)
# (framework, zero) of a plan -> what a composed run shards dp with: Megatron's distributed optimizer and
# DeepSpeed's ZeRO-1 shard the optimizer state, as the composed distributed optimizer (plain PyTorch's stage 1)
SHARDING = {**{key: key for key in DP_SHARD}, ("megatron", 0): ("torch", 0), ("mcore", 0): ("torch", 0),
            ("deepspeed", 0): ("torch", 0), ("megatron", 1): ("torch", 1), ("mcore", 1): ("torch", 1),
            ("deepspeed", 1): ("torch", 1)}
# The toy's sizes: 16 ranks on 2 CPU cores train it in seconds.
HEAD_DIM, HEADS, VOCAB, SEQ_LEN, STEPS = 16, 4, 256, 32, 6


class NotRehearsable(ValueError):
    """A plan a composed run cannot rehearse; the message starts with the plan field at fault."""


def rehearsal_plan(plan: Plan, max_ranks: int = MAX_RANKS) -> Plan:
    """`plan`'s composition on the fewest ranks: each of dp, tp, pp, cp > 1 becomes 2, an interleaved schedule
    keeps 2 chunks per rank, dp shards as a composed run can (SHARDING), sp, schedule, micro-batch rows,
    recompute and dtype are kept, the optimizer as the runner's AdamW or SGD. NotRehearsable for what a
    composed run does not do, or for more than `max_ranks` ranks."""
    label = plan.label()
    if plan.ep > 1:
        raise NotRehearsable(f"ep: rehearsals are of dense plans (ep={plan.ep} in {label}; composed_moe runs a MoE "
                             f"model's composition by hand)")
    if plan.offload != "none":
        raise NotRehearsable(f"offload: {plan.offload} offload runs as DeepSpeed's zero*_offload strategies only, "
                             f"not composed ({label})")
    if (plan.framework, plan.zero) not in SHARDING:
        instead = f"; FSDP2 shards the same states: framework=fsdp2, zero={plan.zero}" if plan.zero in (2, 3) else ""
        raise NotRehearsable(f"zero: {plan.framework} ZeRO-{plan.zero} does not compose: DeepSpeed's engine owns the "
                             f"step, and a composed run shards dp as replicas, ZeRO-1 or FSDP2 ({label}){instead}")
    if plan.recompute == "op":
        raise NotRehearsable(f"recompute: the composed runner has no per-op checkpointing (recompute 'op' in {label}); "
                             f"it recomputes none, selective or full")
    two = {dim: min(getattr(plan, dim), 2) for dim in ("dp", "tp", "pp", "cp")}
    world = math.prod(two.values())
    if world > max_ranks:
        raise NotRehearsable(f"world: the rehearsal of {label} needs {world} ranks "
                             f"({' x '.join(f'{d}{n}' for d, n in two.items() if n > 1)}), more than {max_ranks}")
    framework, zero = SHARDING[plan.framework, plan.zero]
    return Plan(**two, sp=plan.sp, schedule=plan.schedule if plan.pp > 1 else "1f1b",
                virtual_stages=2 if plan.pp > 1 and plan.schedule == "interleaved" else 1,
                framework=framework, zero=zero, micro_batch=plan.micro_batch, recompute=plan.recompute,
                dtype=plan.dtype, optimizer="sgd" if plan.optimizer == "sgd" else "adamw")


def composition(plan: Plan) -> dict:
    """What a rehearsal keeps of a plan: which degrees are > 1, sp, schedule, chunks, dp's sharding, recompute."""
    framework, zero = SHARDING.get((plan.framework, plan.zero), (plan.framework, plan.zero))
    return {"split": tuple(d for d in ("dp", "tp", "pp", "cp") if getattr(plan, d) > 1), "sp": plan.sp,
            "schedule": plan.schedule if plan.pp > 1 else None, "interleaved": plan.virtual_stages > 1,
            "dp_shard": DP_SHARD.get((framework, zero)), "recompute": plan.recompute}


def rehearsal_model(plan: Plan) -> dict:
    """A toy GPT-NeoX (keys of config.yaml's `defaults.model`) for the rehearsal plan: heads, MLP width and
    vocabulary split over tp, and one layer per pipeline stage (pp x virtual_stages, at least 2 layers)."""
    heads, layers = plan.tp * math.ceil(HEADS / plan.tp), max(2, plan.pp * plan.virtual_stages)
    hidden = HEAD_DIM * heads
    return {"name": f"rehearsal-neox-h{hidden}-l{layers}", "source": "local", "hidden_size": hidden,
            "num_layers": layers, "num_heads": heads, "intermediate_size": 4 * hidden,
            "vocab_size": math.lcm(VOCAB, plan.tp), "max_position_embeddings": 128, "seed": 0}


def rehearsal_training(plan: Plan, dtype: str = "fp32") -> dict:
    """A training block for the rehearsal plan: a sequence of zig-zag chunks over cp that sp splits again over
    tp, a global batch of dp x the plan's micro-batch rows x (2 x pp micro-batches with a pipeline: a 1F1B
    steady state, 2 interleaved rounds), a few steps. fp32 by default whatever the plan trains in: there the
    parity rule is an a-priori bound; bf16 needs a measured noise floor (more runs, a looser tolerance)."""
    micro_batches = 2 * plan.pp if plan.pp > 1 else 1
    chunk = 2 * plan.cp * (plan.tp if plan.sp else 1)
    return {"steps": STEPS, "warmup_steps": 1, "seq_len": chunk * math.ceil(SEQ_LEN / chunk),
            "global_batch_size": plan.dp * plan.micro_batch * micro_batches, "optimizer": plan.optimizer,
            "lr": 1e-3, "dtype": dtype, "log_every": 1, "eval_batches": 1}


def rehearse(plan: Plan, source: str, config: dict | None = None, dtype: str = "fp32") -> dict:
    """The experiment block that rehearses `plan` (found on `source`, e.g. a scenario's cluster): the toy model
    and training, the single-device reference and the composed run of `rehearsal_plan(plan)`. Checked by the
    composed strategy's own config check, resolved against `config`'s defaults (config/config.yaml's if None)."""
    small = rehearsal_plan(plan)
    training = rehearsal_training(small, dtype)
    name = run_name(small)
    block = {"description": f"Rehearsal of {plan.label()} ({source}): the same composition, {small.label()}, on "
                            f"{small.world} ranks of a toy GPT-NeoX in {dtype}.",
             "model": rehearsal_model(small), "training": training, "strategies": ["single", name],
             "strategy_options": {name: composed_options(small, training["global_batch_size"])}}
    check_block(block, config)
    return block


def check_block(block: dict, config: dict | None = None) -> None:
    """Each run of an experiment block through its strategy's config check (a ConfigError naming the field),
    the block resolved against `config`'s defaults."""
    config = config or yaml.safe_load(DEFAULT_CONFIG.read_text())
    exp = resolve_experiment({**config, "experiments": {NAME: block}}, NAME)
    for strategy in block["strategies"]:
        get_spec(strategy).check(exp, f"experiments.{NAME}")


def best_plan(model: ModelShape, cluster: Cluster, workload: Workload, stack: str | None = None,
              space: Space = Space()) -> Plan:
    """The fastest plan that fits the search's `space` under `stack`; a ValueError if none fits."""
    ranked = search(model, cluster, workload, top=1, space=space, stack=stack).ranked
    if not ranked:
        raise ValueError(f"no plan of the search fits {cluster.gpus} x {cluster.accelerator}")
    return ranked[0].plan


def planning_block(config: dict | None = None) -> dict:
    """The planning scenarios as the Snakefile reads them: the config's own block, else config/planning.yaml's."""
    return (config or {}).get("planning") or yaml.safe_load(Path(PLANNING).read_text())["planning"]


def find_scenario(planning: dict, name: str) -> tuple[str, Scenario]:
    """(model name, scenario) of a planning scenario by its name, or by its model's where one scenario has it
    (e.g. llama-3-405b: case, dashes and dots aside)."""
    entries = planning.get("scenarios", [])
    key = lambda text: re.sub(r"[-_.]", "", text.lower())  # noqa: E731
    matches = ([i for i, e in enumerate(entries) if e["name"] == name]
               or [i for i, e in enumerate(entries) if key(e["model"]) == key(name)])
    if len(matches) != 1:
        listed = ", ".join(f"{entries[i]['name']} ({entries[i]['model']})" for i in matches or range(len(entries)))
        raise ValueError(f"{'several scenarios' if matches else 'no scenario'} named or of model {name!r} "
                         f"(scenarios: {listed or 'none'})")
    entry = entries[matches[0]]
    return entry["model"], scenario(entry, f"planning.scenarios[{matches[0]}]")


def scenario_plan(config: dict | None, name: str) -> tuple[Plan, str]:
    """The best plan of a planning scenario (`find_scenario` in `planning_block(config)`) and where it was
    found, for `rehearse`."""
    model, s = find_scenario(planning_block(config), name)
    plan = best_plan(s.model, s.cluster, s.workload, s.stack, s.space)
    return plan, (f"scenario {s.name}: {model} on {s.cluster.gpus:,} x {s.cluster.accelerator} under {s.stack}, "
                  f"{s.workload.global_batch} x {s.workload.seq_len} tokens per step")
