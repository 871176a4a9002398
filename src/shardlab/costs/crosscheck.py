"""The planner beside the one-liners users already know, on the same configurations:

- DeepSpeed's `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`
  (called from the installed library), device bytes of model states per GPU;
- Megatron-LM's theoretical memory formula (`megatron/training/theoretical_memory_usage.py`:
  weights + optimizer of the most loaded shard at 18 bytes per parameter, or 6 + 12/dp with the
  distributed optimizer; activations of the first stage under SP + selective recompute,
  sbh(18 + 4 ffn/h) per layer / tp). Megatron is not a dependency, so its formula is restated here
  for the comparison only.

Each row says why the numbers differ, so a user can tell which one answers their question.
"""

from __future__ import annotations

import math

from shardlab.costs import rank_memory
from shardlab.costs.plan import Plan, Workload
from shardlab.costs.shapes import ModelShape

GB = 1e9
_WHY_DEEPSPEED = ("DeepSpeed's estimator counts 18 bytes per sharded parameter (it adds a 4-byte fp32 "
                  "gradient partition to our 2 + 4 + 8) and its largest layer in fp32 (ZeRO-3); the "
                  "planner counts what the measured runs hold plus one reduce bucket")


def deepspeed_estimate(model: ModelShape, stage: int, gpus_per_node: int, nodes: int, offload: bool) -> float:
    """Device bytes per GPU from DeepSpeed's own estimator."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    total = model.parameters()
    if stage == 3:
        largest = max(model.layer_parameters(), model.embedding_parameters())
        return float(estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes, cpu_offload=offload,
                                                           cpu_offload_params=offload)[1])
    return float(estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload=offload)[1])


def megatron_weights_and_optimizer(model: ModelShape, tp: int, pp: int, dp: int, distributed_optimizer: bool) -> float:
    """Megatron's formula: the most loaded shard (1/pp of the layers + the embedding, over tp) times
    18 bytes, or 6 + 12/dp with the distributed optimizer."""
    h, L = model.hidden_size, model.num_layers
    gated = 1.5 if model.mlp == "swiglu" else 1.0
    attention = 2 * h * h * (1 + model.kv_heads / model.num_heads)
    layer = 2 * h * (model.intermediate_size * gated + 2) + attention
    embedding = h * model.vocab_size
    shard = (layer * L / pp + embedding) / tp
    if not model.tied_embeddings and pp == 1:
        shard += embedding / tp
    return shard * (6 + 12 / dp if distributed_optimizer else 18)


def megatron_activations(model: ModelShape, tp: int, pp: int, v: int, micro_batch: int, seq_len: int, m: int) -> float:
    """Megatron's first-stage activation formula (SP + selective recompute only)."""
    s, b, h = seq_len, micro_batch, model.hidden_size
    act = s * b * h * (18 + 4 * model.intermediate_size / h) * model.num_layers
    act += 8 * s * b * pp + s * b * h * pp  # embedding input and its dropout, pp micro-batches in flight
    if v > 1:
        act *= 1 + (pp - 1) / (pp * v)
    elif pp > 1:
        act *= min(1, m / pp)
    if pp == 1:
        act += s * b * h * 4 * (1 + model.vocab_size / h)
    return act / tp


def _row(config: str, quantity: str, tool: str, theirs: float, ours: float, why: str) -> dict:
    return {"config": config, "quantity": quantity, "tool": tool, "tool_gb": theirs / GB, "planner_gb": ours / GB,
            "planner_vs_tool_pct": 100 * (ours - theirs) / theirs, "why": why}


def deepspeed_rows(name: str, model: ModelShape, gpus: int) -> list[dict]:
    rows = []
    for stage, offload in ((2, False), (3, False), (3, True)):
        plan = Plan(dp=gpus, zero=stage, framework="deepspeed", offload="optimizer+params" if offload else "none")
        states = rank_memory.model_states(plan, model.parameters(), 0)
        ours = states.device_peak_bytes
        label = f"{name}, {gpus} GPUs, bf16, ZeRO-{stage}{' offload' if offload else ''}"
        rows.append(_row(label, "model states per GPU (device)", "DeepSpeed estimator",
                         deepspeed_estimate(model, stage, gpus, 1, offload), ours,
                         _WHY_DEEPSPEED if not offload else
                         "with everything offloaded DeepSpeed counts the largest layer in fp32; the planner "
                         "a reduce bucket of bf16 gradients"))
    return rows


def megatron_rows(name: str, model: ModelShape, plan: Plan, workload: Workload) -> list[dict]:
    rows = []
    for distributed in (False, True):
        p = Plan(**{**plan.as_dict(), "framework": "megatron", "zero": int(distributed)})
        dense, experts = rank_memory.rank_parameters(model, p, 0)
        states = rank_memory.model_states(p, dense, experts)
        ours = states.param_bytes + states.grad_bytes + states.optimizer_bytes
        theirs = megatron_weights_and_optimizer(model, p.tp, p.pp, p.dp * p.cp, distributed)
        rows.append(_row(f"{name}, {p.label()}", "weights + optimizer, first stage",
                         "Megatron formula" + (" (distributed optimizer)" if distributed else ""), theirs, ours,
                         "same 18 (or 6 + 12/dp) bytes per parameter; Megatron counts 2h(ffn + 2) + attention "
                         "per layer (no biases), the planner the exact tensors; where layers do not split evenly "
                         "the planner's first stage gives one layer's slot to the embedding, the formula "
                         "spreads layers fractionally"))
    m = workload.global_batch // (plan.dp * plan.micro_batch)
    selective = Plan(**{**plan.as_dict(), "sp": True, "recompute": "selective", "framework": "megatron"})
    ours = rank_memory.activation_bytes(model, selective, workload, 0)
    theirs = megatron_activations(model, plan.tp, plan.pp, plan.virtual_stages, plan.micro_batch,
                                  workload.seq_len, m)
    rows.append(_row(f"{name}, {selective.label()}", "activations, first stage (SP + selective)", "Megatron formula",
                     theirs, ours, "Megatron's formula assumes 2-byte values, a GeLU MLP and all layers' worth in "
                     "flight (ceil for interleaving); the planner counts this model's tensors (flash attention "
                     "keeps no scores), the first stage's own layers and its in-flight micro-batches"))
    return rows


# Published plans whose assumptions Megatron's formula shares (no context parallelism, no experts):
# GPT-3 175B as Korthikanti et al. 2022 Table 3 ran it; Llama 3 405B at 8K sequence as its paper's
# Table 4 lists (TP 8, PP 16, DP 128 on 16,384 GPUs; interleaving assumed at 2 chunks).
MEGATRON_CASES = {
    "gpt3-175b": (Plan(dp=1, tp=8, pp=8, schedule="interleaved", virtual_stages=3), Workload(64, 2048)),
    "llama3-405b": (Plan(dp=128, tp=8, pp=16, schedule="interleaved", virtual_stages=2), Workload(2048, 8192)),
}


def rows(models: dict[str, ModelShape], zero_model: str = "pythia-6.9b", gpus: int = 2) -> list[dict]:
    """DeepSpeed's estimator on `zero_model` over `gpus` GPUs, Megatron's formula on MEGATRON_CASES;
    `models`: shapes by name (costs/models.yaml)."""
    out = deepspeed_rows(zero_model, models[zero_model], gpus)
    for name, (plan, workload) in MEGATRON_CASES.items():
        out += megatron_rows(name, models[name], plan, workload)
    return [r for r in out if math.isfinite(r["planner_vs_tool_pct"])]
