"""Published training runs (`published.yaml`) as the planner sees them: each row's model, plan,
cluster, batch and stack, the throughput it reached, and whether it calibrates its stack or is held
out. Loading and unit conversion only; predicting the rows is `costs.comparison`.

Every row's throughput is compared as tokens per second per GPU, whatever the source published
(seconds per step, tokens per second, Megatron's teraFLOP/s, MFU), so no FLOP convention enters the
comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from shardlab.costs import hardware
from shardlab.costs.plan import Cluster, Plan, Workload
from shardlab.costs.shapes import ModelShape, model_shape

POINTS = Path(__file__).with_name("published.yaml")
PLAN_FIELDS = ("tp", "pp", "cp", "sp", "tp_overlap", "framework", "zero", "micro_batch", "recompute", "dtype",
               "attention", "optimizer")
SPLITS = ("calibration", "held_out", "informed")  # informed: its error chose a model change; fitted on by nothing


@lru_cache(maxsize=1)
def reference() -> dict:
    return yaml.safe_load(POINTS.read_text())


def sources() -> dict[str, dict]:
    return {s["id"]: s for s in reference()["sources"]}


@dataclass(frozen=True)
class Row:
    """One published configuration and what it reached."""

    source: str
    index: int  # within its source, from 0
    model_name: str
    model: ModelShape
    cluster: Cluster
    workload: Workload
    stack: str
    metric: str
    published: float  # in the source's own unit (`metric`)
    split: str
    plan: Plan | None = None  # None: the source leaves choices open (`choices`), the planner picks the best plan
    choices: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)  # the row's settings as published, for the tables

    @property
    def key(self) -> str:
        return f"{self.source}[{self.index}]"

    @property
    def generation(self) -> str:
        return hardware.by_name(self.cluster.accelerator)["generation"]

    def tokens_per_s_per_gpu(self) -> float:
        """The published throughput as tokens per second per GPU."""
        w, gpus, value = self.workload, self.cluster.gpus, self.published
        if self.metric == "step_s":
            return w.global_batch * w.seq_len / value / gpus
        if self.metric == "tokens_per_s_per_gpu":
            return value
        if self.metric == "megatron_tflops_per_gpu":  # Narayanan et al. 2021 eq. 3, per token
            m, s = self.model, w.seq_len
            flops = 96 * m.num_layers * m.hidden_size**2 * (1 + s / (6 * m.hidden_size)
                                                            + m.vocab_size / (16 * m.num_layers * m.hidden_size))
            return value * 1e12 / flops
        if self.metric == "mfu_pct":
            return value / 100 * hardware.peak_flops(hardware.by_name(self.cluster.accelerator), "bf16") / flops_per_token(self)
        raise ValueError(f"{self.key}: unknown metric {self.metric!r}")

    def mfu(self) -> float:
        """The published throughput as model FLOPs utilisation (costs.hardware.training_flops_per_token)."""
        device = hardware.by_name(self.cluster.accelerator)
        dtype = self.plan.dtype if self.plan else "bf16"
        return self.tokens_per_s_per_gpu() * flops_per_token(self) / hardware.peak_flops(device, dtype)


def flops_per_token(row: Row) -> float:
    m = row.model
    return hardware.training_flops_per_token(m.matmul_parameters(), m.num_layers, m.hidden_size, row.workload.seq_len)


def _row(source: dict, index: int, raw: dict) -> Row:
    s = {**source.get("defaults", {}), **source.get("configurations", {}).get(raw.get("model"), {}), **raw}
    name = s["model"]
    model = model_shape(source.get("models", {}).get(name, name))
    gpus = s["gpus"]
    seq_len = s["seq_len"]
    global_batch = s.get("global_batch") or s["tokens_per_batch"] // seq_len
    cluster = Cluster(source["accelerator"], nodes=gpus // 8)
    workload = Workload(global_batch, seq_len, s.get("dropout", 0.0))
    plan = None
    if "choices" not in source:
        fields = {k: s[k] for k in PLAN_FIELDS if k in s}
        vp = s.get("vp", 1)
        degrees = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)
        plan = Plan(dp=gpus // degrees, virtual_stages=vp,
                    schedule="interleaved" if vp > 1 else "1f1b", **fields)
    return Row(source["id"], index, name, model, cluster, workload, s.get("stack", source.get("stack")), source["metric"],
               s["published"], s["split"], plan, source.get("choices", {}), s)


@lru_cache(maxsize=1)
def rows() -> tuple[Row, ...]:
    """Every published row, source by source."""
    return tuple(_row(source, i, raw) for source in reference()["sources"] for i, raw in enumerate(source["rows"]))


def memory_rows() -> list[dict]:
    """Korthikanti et al.'s Figure 1 values with their model shapes and plans (`costs.comparison`)."""
    source = sources()["korthikanti2022"]
    plans = {r["model"]: r for r in source["rows"]}
    return [{**m, "shape": model_shape(source["models"][m["model"]]), "plan_row": plans[m["model"]],
             "defaults": source["defaults"], "accelerator": source["accelerator"]} for m in source["memory"]]


@lru_cache(maxsize=16)
def best_mfu(generation: str, stack: str) -> dict | None:
    """The highest MFU any published row reached on `generation` under `stack`, or on `generation` under any
    stack where `stack` has no row there; None without a row of that generation ({"mfu", "source"})."""
    found = [r for r in rows() if r.generation == generation]
    own = [r for r in found if r.stack == stack]
    candidates = own or found
    if not candidates:
        return None
    best = max(candidates, key=Row.mfu)
    return {"mfu": best.mfu(), "source": f"{best.key}, {best.model_name} on {best.cluster.gpus} GPUs"}
