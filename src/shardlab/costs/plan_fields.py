"""Plan fields as people write them: `dp=8,tp=2,sp=true` on the command line, a CSV or YAML file of
plans, and the --help text that lists every field with its values and default.

Each value is read by its `Plan` field's type and checked against the field's allowed values
(`plan.CHOICES`, `plan.DEGREES`); an error names the field, so the command line can print it
without a traceback. Whether a plan can run on a model and cluster is `plan.rejection`'s question.
"""

from __future__ import annotations

import csv
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import yaml

from shardlab.costs.plan import CHOICES, DEGREES, Plan

TYPES = get_type_hints(Plan)  # field -> int, bool, str or float | None
BOOLEANS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
MEANINGS = {
    "dp": "data-parallel replicas (dp x tp x pp x cp = the cluster's GPUs)",
    "tp": "tensor-parallel ranks (within a node)",
    "sp": "sequence parallelism over the tp ranks",
    "sp_gathered_inputs": "SP that keeps its all-gathered layer inputs (PyTorch DTensor's SequenceParallel)",
    "tp_overlap": "TP collectives overlapped with the GEMMs (Transformer Engine userbuffers, async TP; the stack must have it)",
    "pp": "pipeline ranks",
    "schedule": "pipeline schedule",
    "virtual_stages": "model chunks per pipeline rank (the interleaved schedule's v)",
    "cp": "context-parallel ranks (ring attention over the sequence)",
    "ep": "expert-parallel ranks, carved from dp x cp (mixture-of-experts models)",
    "zero": "what the dp x cp ranks shard: 1 optimizer state, 2 and gradients, 3 and parameters",
    "framework": ("whose accounting of the sharded states: torch plain fp32 replicas (zero 0); megatron fp32 main "
                  "gradients (Megatron-LM); mcore compute-dtype gradients (Megatron-Core, NeMo); deepspeed; fsdp2"),
    "offload": "what DeepSpeed ZeRO moves to host memory",
    "micro_batch": "sequences per rank in one micro-batch",
    "recompute": ("activation recompute: selective the attention core (Megatron), op per-op checkpointing "
                  "(torchtitan: every other matrix product and the attention output saved), full the whole layer"),
    "dtype": "training precision",
    "attention": "attention kernel (eager keeps the score matrix, ring: the hand-written blockwise kernel)",
    "optimizer": "optimizer (adamw-bf16: moments and master copy in bf16; sgd: without momentum)",
    "grad_bucket_mb": "plain PyTorch replicas: gradient all-reduce bucket in MiB (0: per layer; none: once)",
    "grad_sync_overlap": ("the once-per-step gradient reduction behind the backward (true) or after it (false); "
                          "none: as the stack does"),
    "whole_embedding_grad": "TP that keeps the vocabulary-split embedding's gradient whole (DTensor)",
    "vocab_parallel_loss": "TP computes the loss on vocabulary-split logits (false: gathers them)",
}
BOOLEAN_WORDS = "true/false, yes/no, on/off or 1/0"


class PlanFieldError(ValueError):
    """A plan field or value that cannot be read; the message starts with the field."""


def parse_value(name: str, raw) -> object:
    """The value of field `name` from its text (or a YAML scalar), typed and checked."""
    kind, text = TYPES[name], str(raw).strip()
    if kind == bool | None and text.lower() in ("none", "null", ""):
        value = None
    elif kind in (bool, bool | None):
        value = BOOLEANS.get(text.lower())
        if value is None:
            raise PlanFieldError(f"{name}: {text!r} is not a boolean ({BOOLEAN_WORDS})")
    elif kind is int:
        value = _number(name, text, int, "an integer")
    elif kind is str:
        value = text
    else:  # float | None
        value = None if text.lower() in ("none", "null", "") else _number(name, text, float, "a number or none")
    allowed = CHOICES.get(name)
    if allowed and value not in allowed:
        raise PlanFieldError(f"{name}: {text!r} is not one of {', '.join(map(str, allowed))}")
    if name in DEGREES and value < 1:
        raise PlanFieldError(f"{name}: {value} is not a count of at least 1")
    return value


def _number(name: str, text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise PlanFieldError(f"{name}: {text!r} is not {what}") from None


def typed_fields(raw: dict) -> dict:
    """{field: text or YAML value} -> {field: typed value}; an unknown field names the known ones."""
    for name in raw:
        if name not in TYPES:
            raise PlanFieldError(f"{name!r} is not a plan field (fields: {', '.join(TYPES)})")
    return {name: parse_value(name, value) for name, value in raw.items()}


def parse_fields(text: str) -> dict:
    """'dp=8,tp=2,sp=true' -> {'dp': 8, 'tp': 2, 'sp': True}."""
    raw = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise PlanFieldError(f"{item!r} is not field=value")
        raw[name.strip()] = value
    return typed_fields(raw)


def plan_of(values: dict) -> Plan:
    """A Plan of the typed fields given, the others at their defaults. virtual_stages > 1 on a
    pipeline (pp > 1) without a schedule means the interleaved one, the only schedule with chunks."""
    if values.get("virtual_stages", 1) > 1 and values.get("pp", 1) > 1 and "schedule" not in values:
        values = {**values, "schedule": "interleaved"}
    return Plan(**values)


def parse_plan(text: str) -> Plan:
    return plan_of(parse_fields(text))


def read_plans(path: Path) -> list[Plan]:
    """The plans of a CSV file (a header of field names; an empty cell: the default) or a YAML/JSON
    file (a list of mappings); a PlanFieldError naming the file, the row (from 1) and the field."""
    plans = []
    for row, raw in enumerate(_rows(path), 1):
        try:
            plans.append(plan_of(typed_fields(raw)))
        except PlanFieldError as err:
            raise PlanFieldError(f"{path.name} row {row}: {err}") from None
    return plans


def _rows(path: Path) -> list[dict]:
    try:
        if path.suffix.lower() == ".csv":
            with path.open(newline="") as f:
                rows = list(csv.DictReader(f, restkey="(more values than columns)"))
            return [{k.strip(): v for k, v in row.items() if v not in (None, "")} for row in rows]
        rows = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise PlanFieldError(f"{path}: {err}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise PlanFieldError(f"{path.name}: not a list of plans (each a mapping of plan fields)")
    return rows


def allowed_values(name: str) -> str:
    kind = TYPES[name]
    if name in CHOICES:
        return "|".join(map(str, CHOICES[name]))
    if kind is bool:
        return "true|false"
    if kind == bool | None:
        return "true|false|none"
    if kind is int:
        return "an integer >= 1" if name in DEGREES else "an integer"
    return "a number|none" if kind is not str else "text"


def fields_help() -> str:
    """Every plan field with its allowed values, default and meaning (the command line's --help)."""
    lines = ["plan fields (--plan, --fix, the columns of a --plans file): field=values (default): meaning"]
    for f in fields(Plan):
        default = str(f.default).lower() if f.default is None or isinstance(f.default, bool) else f.default
        lines.append(f"  {f.name}={allowed_values(f.name)} ({default}): {MEANINGS[f.name]}")
    lines += [f"Booleans read {BOOLEAN_WORDS}, in any case.",
              "virtual_stages=V (V > 1) with pp > 1 and no schedule means schedule=interleaved;",
              "schedule=interleaved needs virtual_stages=2 or more."]
    return "\n".join(lines)
