"""The ZeRO decision tree: the cheapest DeepSpeed rung that fits, as the planner predicts it.

A view of the one cost model (`costs.predict.evaluate`), not a second memory rule: each rung of the
registry's ladder (`shardlab.strategies.zero.deepspeed_ladder`) as pure data parallelism over the
cluster's devices under the DeepSpeed stack, one micro-batch of `seq_len` tokens per rank. Its
memory is everything the planner counts (model states at their peak, the micro-batch's activations,
ZeRO-3's gathered layers, the stack's runtime allowance), its host memory the offloaded share. The
tree walks the ladder from the least communication to the most and takes the first rung that fits,
so `plan-zero` and `plan evaluate` agree on every rung by construction.

The command line is `shardlab.strategies.zero.tree`:

    python -m shardlab plan-zero --model pythia-6.9b --hardware "A100-80GB SXM" --gpus 2
"""

from __future__ import annotations

from shardlab.costs.hardware import by_name
from shardlab.costs.plan import Cluster, Plan, Workload
from shardlab.costs.predict import Prediction, evaluate
from shardlab.costs.shapes import ModelShape

STACK = "deepspeed"


def cluster_of(accelerator: str, gpus: int, host_memory_gb: float | None = None, overrides: dict | None = None) -> Cluster:
    """`gpus` devices of `accelerator`: one node below the catalog's node size, else whole nodes (a
    ValueError naming the node size otherwise)."""
    per_node = by_name(accelerator)["gpus_per_node"]
    if gpus <= per_node:
        return Cluster(accelerator, 1, gpus, host_memory_gb, dict(overrides or {}))
    if gpus % per_node:
        raise ValueError(f"gpus: {gpus} devices are not whole nodes of {per_node} {accelerator}")
    return Cluster(accelerator, gpus // per_node, per_node, host_memory_gb, dict(overrides or {}))


def rung_plan(fields: dict, gpus: int, micro_batch: int = 1, dtype: str = "bf16", optimizer: str = "adamw") -> Plan:
    """The plan of a rung of the ladder (its Plan fields): every device a data-parallel rank."""
    return Plan(**{**fields, "dp": gpus, "micro_batch": micro_batch, "dtype": dtype, "optimizer": optimizer})


def ladder(model: ModelShape, cluster: Cluster, seq_len: int, rungs: dict[str, dict], micro_batch: int = 1,
           dtype: str = "bf16", optimizer: str = "adamw") -> list[dict]:
    """One row per rung (`rungs`: name -> Plan fields, in ladder order): the planner's memory of the
    fullest device, what is usable, the host memory offloaded per node, and whether it fits."""
    workload = Workload(cluster.gpus * micro_batch, seq_len)
    rows = []
    for rung, fields in rungs.items():
        p = evaluate(model, rung_plan(fields, cluster.gpus, micro_batch, dtype, optimizer), cluster, workload, STACK,
                     with_time=False)
        if isinstance(p, Prediction):
            rows.append({"rung": rung, "device_bytes": p.device_bytes, "usable_bytes": p.capacity_bytes,
                         "host_per_node_bytes": p.memory["host_bytes"] * cluster.gpus_per_node,
                         **{f"{k}_bytes": v for k, v in p.memory.items() if k != "host_bytes"},
                         "fits": p.fits, "why": p.why})
        else:
            rows.append({"rung": rung, "fits": False, "why": p})
    return rows


def choose(rows: list[dict]) -> str | None:
    """The first rung on the ladder that fits (least communication), or None: shard further (TP/PP)."""
    return next((r["rung"] for r in rows if r["fits"]), None)
