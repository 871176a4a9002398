"""The communication each strategy must do per optimizer step, from the model and training shape.

A plan is a list of `Call`s: a collective, its message size in nccl-tests' convention (the whole
buffer: see `collectives`), how many times the busiest rank issues it per step, and over how
many ranks. `bus_bytes` = size x bus_factor is what each rank's link carries (ring algorithms),
so the per-rank volume of a step is the sum of the calls' bus bytes, and the alpha-beta model
turns the same plan into seconds.

Counted: the traffic of the technique (gradient/parameter collectives, activations crossing
TP/SP/PP/CP/EP boundaries). Not counted: scalar all-reduces (loss, norms), the step-time
all-reduce, TP's one-off gathers at the embedding and head, and anything an implementation adds
beyond the textbook algorithm. Gradients and parameters travel in fp32 (fp32 master weights;
bf16 means autocast here), activations in the compute dtype.

Strategies of other modules are matched by name; an unknown name gives None (no prediction),
not an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GRAD_BYTES = PARAM_BYTES = 4  # fp32 master weights and gradients in every strategy of this project


@dataclass(frozen=True)
class ModelShape:
    """A GPT-NeoX (Pythia) shape: what the volumes depend on."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int

    @classmethod
    def from_dict(cls, d: dict) -> ModelShape:
        """From a shardlab model config or a Hugging Face config.json."""
        get = lambda *keys: next(d[k] for k in keys if k in d)  # noqa: E731
        return cls(get("vocab_size"), get("hidden_size"), get("num_layers", "num_hidden_layers"),
                   get("num_heads", "num_attention_heads"), get("intermediate_size"))

    def layer_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        layer_norms = 2 * 2 * h  # input + post-attention LayerNorm, weight and bias
        attention = (h * 3 * h + 3 * h) + (h * h + h)  # fused QKV + output projection
        mlp = (h * i + i) + (i * h + h)
        return layer_norms + attention + mlp

    def mlp_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        return (h * i + i) + (i * h + h)

    def parameters(self) -> int:
        """Untied input embedding and LM head (no bias), final LayerNorm, and the layers."""
        h, v = self.hidden_size, self.vocab_size
        return v * h + self.num_layers * self.layer_parameters() + 2 * h + h * v


@dataclass(frozen=True)
class StepShape:
    """The training side: one optimizer step's tokens and the activation element size."""

    global_batch: int
    seq_len: int
    micro_batch: int | None  # per data-parallel rank; None = the whole local batch
    activation_bytes: int  # 4 in fp32, 2 under bf16 autocast

    @classmethod
    def from_training(cls, training: dict) -> StepShape:
        return cls(training["global_batch_size"], training["seq_len"], training.get("micro_batch_size"),
                   2 if training.get("dtype") == "bf16" else 4)

    def micro_batches(self, dp: int) -> tuple[int, int]:
        """(micro-batch rows, micro-batches per step) of one data-parallel rank."""
        local = self.global_batch // dp
        rows = min(self.micro_batch or local, local)
        return rows, max(1, local // rows)


@dataclass(frozen=True)
class Call:
    collective: str
    size_bytes: float  # nccl-tests convention
    count: int  # per step, as issued by the busiest rank
    group_size: int
    purpose: str

    @property
    def bus_bytes(self) -> float:
        from shardlab.costs.collectives import bus_factor

        return self.count * self.size_bytes * bus_factor(self.collective, self.group_size) if self.group_size > 1 else 0.0


# --- one function per technique -----------------------------------------------------------------
def data_parallel(model: ModelShape, step: StepShape, dp: int) -> list[Call]:
    """DP naive/interleaved, DDP, ZeRO-0: one all-reduce of every gradient per step (buckets sum to it)."""
    return [Call("all_reduce", model.parameters() * GRAD_BYTES, 1, dp, "gradient all-reduce")]


def zero_sharded_optimizer(model: ModelShape, step: StepShape, dp: int) -> list[Call]:
    """ZeRO-1/2 (FSDP2 without resharding after forward): reduce-scatter gradients, all-gather updated params."""
    p = model.parameters()
    return [Call("reduce_scatter", p * GRAD_BYTES, 1, dp, "gradient reduce-scatter"),
            Call("all_gather", p * PARAM_BYTES, 1, dp, "parameter all-gather")]


def zero_sharded_parameters(model: ModelShape, step: StepShape, dp: int) -> list[Call]:
    """ZeRO-3 / FSDP2 full: parameters gathered for forward AND again for backward: ~1.5x DP's volume."""
    p = model.parameters()
    return [Call("all_gather", p * PARAM_BYTES, 2, dp, "parameter all-gather (forward, backward)"),
            Call("reduce_scatter", p * GRAD_BYTES, 1, dp, "gradient reduce-scatter")]


def _activation_bytes(step: StepShape, dp: int, seq_len: int | None = None) -> tuple[float, int]:
    rows, n_micro = step.micro_batches(dp)
    return rows * (seq_len or step.seq_len) * step.activation_bytes, n_micro


def tensor_parallel(model: ModelShape, step: StepShape, tp: int, dp: int = 1) -> list[Call]:
    """Megatron TP: per layer, all-reduce after attention and after the MLP (forward) and of the
    input gradients of both column-parallel blocks (backward): 4 all-reduces of b*s*h elements."""
    per_row, n_micro = _activation_bytes(step, dp)
    size = per_row * model.hidden_size
    return [Call("all_reduce", size, 2 * model.num_layers * n_micro, tp, "TP forward all-reduce"),
            Call("all_reduce", size, 2 * model.num_layers * n_micro, tp, "TP backward all-reduce")]


def sequence_parallel(model: ModelShape, step: StepShape, tp: int, dp: int = 1) -> list[Call]:
    """TP + SP: each TP all-reduce becomes an all-gather (into the block) + a reduce-scatter (out of it):
    the same bus bytes, but LayerNorm/residual activations stay sharded along the sequence."""
    per_row, n_micro = _activation_bytes(step, dp)
    size = per_row * model.hidden_size
    n = 2 * model.num_layers * n_micro  # two blocks per layer
    return [Call("all_gather", size, n, tp, "SP forward all-gather"),
            Call("reduce_scatter", size, n, tp, "SP forward reduce-scatter"),
            Call("all_gather", size, n, tp, "SP backward all-gather"),
            Call("reduce_scatter", size, n, tp, "SP backward reduce-scatter")]


def pipeline_parallel(model: ModelShape, step: StepShape, pp: int, n_micro: int | None) -> list[Call]:
    """PP: each micro-batch's activation goes forward and its gradient backward across every stage
    boundary. The busiest rank (a middle stage; with 2 stages each rank) takes part in
    2 transfers per micro-batch per adjacent boundary."""
    n_micro = n_micro or pp
    rows = max(1, step.global_batch // n_micro)
    size = rows * step.seq_len * model.hidden_size * step.activation_bytes
    boundaries = min(2, pp - 1)
    return [Call("sendrecv", size, n_micro * boundaries, pp, "PP activation (forward)"),
            Call("sendrecv", size, n_micro * boundaries, pp, "PP activation gradient (backward)")]


def context_parallel(model: ModelShape, step: StepShape, cp: int) -> list[Call]:
    """Ring attention: per layer, K and V chunks (2*b*(s/cp)*h) pass cp-1 times around the ring in
    forward; backward passes K/V and their gradients again. Parameters are replicated over the
    ring, so gradients are all-reduced as in DP."""
    per_row, n_micro = _activation_bytes(step, 1, seq_len=step.seq_len // cp)
    kv = 2 * per_row * model.hidden_size
    hops = (cp - 1) * model.num_layers * n_micro
    return [Call("sendrecv", kv, hops, cp, "CP K/V ring (forward)"),
            Call("sendrecv", kv, 2 * hops, cp, "CP K/V and dK/dV ring (backward)"),
            *data_parallel(model, step, cp)]


def expert_parallel(model: ModelShape, step: StepShape, ep: int, top_k: int) -> list[Call]:
    """MoE with one expert group per rank: per layer, all-to-all dispatch and combine of each routed
    token (forward) and of their gradients (backward); the dense (non-expert) parameters are
    replicated and their gradients all-reduced."""
    per_row, n_micro = _activation_bytes(step, ep)
    size = per_row * model.hidden_size * top_k
    dense = model.parameters() - model.num_layers * model.mlp_parameters()
    return [Call("all_to_all", size, 2 * model.num_layers * n_micro, ep, "EP dispatch + combine (forward)"),
            Call("all_to_all", size, 2 * model.num_layers * n_micro, ep, "EP dispatch + combine (backward)"),
            Call("all_reduce", dense * GRAD_BYTES, 1, ep, "dense-parameter gradient all-reduce")]


def hybrid(model: ModelShape, step: StepShape, dp: int, tp: int) -> list[Call]:
    """FSDP over dp x TP over tp (a 2-D mesh): each TP rank shards its 1/tp of the parameters over dp."""
    fsdp = [Call(c.collective, c.size_bytes / tp, c.count, dp, c.purpose + " over dp")
            for c in zero_sharded_parameters(model, step, dp)]
    return fsdp + tensor_parallel(model, step, tp, dp=dp)


# --- strategy name -> plan ---------------------------------------------------------------------
def _degree(options: dict, keys: tuple[str, ...], default: int) -> int:
    return int(next((options[k] for k in keys if options.get(k)), default))


def comm_plan(strategy: str, model: ModelShape, step: StepShape, world: int, options: dict | None = None) -> list[Call] | None:
    """The calls `strategy` makes per step on `world` ranks; [] for none; None when unknown."""
    options = options or {}
    if strategy == "single" or world < 2:
        return []
    if strategy in ("dp_naive", "dp_interleaved", "ddp", "zero0"):
        return data_parallel(model, step, world)
    if strategy == "fsdp2_grad_op":  # no reshard after forward: ZeRO-2-like
        return zero_sharded_optimizer(model, step, world)
    if strategy == "fsdp2_full":
        return zero_sharded_parameters(model, step, world)
    if strategy.startswith("zero"):  # zero1..3 and offload variants (offload adds host traffic, not counted)
        stage = next((int(c) for c in strategy if c.isdigit()), int(options.get("stage", 3)))
        if stage in (1, 2):
            return zero_sharded_optimizer(model, step, world)
        return zero_sharded_parameters(model, step, world) if stage == 3 else None
    if strategy in ("tp", "tp_dtensor"):
        return tensor_parallel(model, step, _degree(options, ("tp", "tp_size"), world))
    if strategy in ("tp_sp", "tp_sp_dtensor"):
        return sequence_parallel(model, step, _degree(options, ("tp", "tp_size"), world))
    if strategy.startswith("pp_"):
        pp = _degree(options, ("pp", "stages", "n_stages"), world)
        by_batch = step.global_batch // step.micro_batch if step.micro_batch else 0
        return pipeline_parallel(model, step, pp, _degree(options, ("n_microbatches", "microbatches", "chunks"), by_batch))
    if strategy.startswith("cp_"):
        return context_parallel(model, step, _degree(options, ("cp", "cp_size"), world))
    if strategy.startswith("ep_"):
        return expert_parallel(model, step, _degree(options, ("ep", "ep_size"), world), _degree(options, ("top_k",), 1))
    if strategy == "hybrid":
        tp = _degree(options, ("tp", "tp_size"), 2 if world % 2 == 0 else 1)
        return hybrid(model, step, _degree(options, ("dp", "dp_size"), world // tp), tp)
    return None


def bytes_per_rank(plan: list[Call] | None) -> float | None:
    """Bytes each rank's link carries per step (the plan's bus bytes)."""
    return None if plan is None else float(sum(call.bus_bytes for call in plan))


def model_shape_for(exp: dict, resources_dir: Path | str = "resources") -> ModelShape | None:
    """From the experiment config (local models) or the downloaded config.json (hub models)."""
    model = exp["model"]
    if model["source"] == "local":
        return ModelShape.from_dict(model)
    config = Path(resources_dir) / "models" / model["name"] / "config.json"
    return ModelShape.from_dict(json.loads(config.read_text())) if config.exists() else None


def experiment_plan(exp: dict, strategy: str, world: int, resources_dir: Path | str = "resources") -> list[Call] | None:
    shape = model_shape_for(exp, resources_dir)
    if shape is None:
        return None
    options = exp.get("strategy_options", {}).get(strategy, {})
    return comm_plan(strategy, shape, StepShape.from_training(exp["training"]), world, options)
