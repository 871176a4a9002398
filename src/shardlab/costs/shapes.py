"""The shapes every cost model works from: a GPT-NeoX (Pythia) model, one training step, and how
a model's parameters split over tensor-parallel shards, pipeline stages and experts.

Pure arithmetic (no torch): the registry, the planner and the tables import it freely; the
strategies that really cut the model (`pipeline_parallel.stages`) use the same stage cut.
"""

from __future__ import annotations

from dataclasses import dataclass

EMBED, HEAD = "embed", "head"


@dataclass(frozen=True)
class ModelShape:
    """A GPT-NeoX (Pythia) shape: untied embedding and LM head, parallel residual, biases everywhere
    but the head."""

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

    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_parameters(self) -> int:
        """Final LayerNorm and LM head (no bias)."""
        return 2 * self.hidden_size + self.hidden_size * self.vocab_size

    def mlp_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        return (h * i + i) + (i * h + h)

    def layer_parameters(self) -> int:
        h = self.hidden_size
        layer_norms = 2 * 2 * h  # input + post-attention LayerNorm, weight and bias
        attention = (h * 3 * h + 3 * h) + (h * h + h)  # fused QKV + output projection
        return layer_norms + attention + self.mlp_parameters()

    def parameters(self) -> int:
        return self.embedding_parameters() + self.num_layers * self.layer_parameters() + self.head_parameters()

    def tensor_parallel_parameters(self, t: int) -> int:
        """Parameters one of t Megatron-style shards holds: QKV, the MLP up-projection (weights and
        biases), both down-projections' weights, the embedding and the head split over t; LayerNorms
        and the row-parallel biases stay whole."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer_split = (3 * h * h + 3 * h) + h * h + (h * i + i) + i * h
        split = self.num_layers * per_layer_split + self.embedding_parameters() + h * self.vocab_size
        return split // t + self.parameters() - split


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

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len

    def micro_batches(self, dp: int) -> tuple[int, int]:
        """(micro-batch rows, micro-batches per step) of one data-parallel rank."""
        local = self.global_batch // dp
        rows = min(self.micro_batch or local, local)
        return rows, max(1, local // rows)


def split_evenly(n: int, parts: int) -> list[range]:
    """0..n-1 in `parts` contiguous runs whose lengths differ by at most one (longer runs first)."""
    size, extra = divmod(n, parts)
    starts = [k * size + min(k, extra) for k in range(parts + 1)]
    return [range(starts[k], starts[k + 1]) for k in range(parts)]


def stage_units(n_layers: int, n_stages: int) -> list[list]:
    """Units of each pipeline stage, e.g. (4, 2) -> [['embed', 0, 1], [2, 3, 'head']].

    The first stage holds the embedding, the last the head, the layers are spread evenly. With more
    stages than layers, units are spread instead, so the embedding and head get stages of their own."""
    if n_stages < 1:
        raise ValueError("a pipeline needs at least one stage")
    if n_layers >= n_stages:
        chunks = [list(r) for r in split_evenly(n_layers, n_stages)]
        chunks[0].insert(0, EMBED)
        chunks[-1].append(HEAD)
        return chunks
    units = [EMBED, *range(n_layers), HEAD]
    if len(units) < n_stages:
        raise ValueError(f"{n_stages} stages cannot be cut from {n_layers} layers (+ embedding and head)")
    return [[units[i] for i in r] for r in split_evenly(len(units), n_stages)]


def stage_parameters(model: ModelShape, units: list) -> int:
    return sum(model.embedding_parameters() if u == EMBED else model.head_parameters() if u == HEAD
               else model.layer_parameters() for u in units)


def pipeline_rank_parameters(model: ModelShape, pp: int, virtual_stages: int = 1) -> list[int]:
    """Parameters each of `pp` pipeline ranks holds; rank r runs stages r, r + pp, ... (looped)."""
    stages = stage_units(model.num_layers, pp * virtual_stages)
    return [sum(stage_parameters(model, stages[s]) for s in range(r, pp * virtual_stages, pp)) for r in range(pp)]


def moe_parameters(model: ModelShape, num_experts: int, top_k: int, expert_intermediate: int | None,
                   ep: int = 1) -> int:
    """Parameters one of `ep` expert-parallel ranks holds when every MLP is a top-k mixture of
    `num_experts` GPT-NeoX MLPs (width `expert_intermediate`, default intermediate / top_k) with a
    bias-free router: the dense part and the routers whole, the experts split over `ep`."""
    h = model.hidden_size
    ffn = expert_intermediate or model.intermediate_size // top_k
    expert = (h * ffn + ffn) + (ffn * h + h)
    dense = model.parameters() - model.num_layers * model.mlp_parameters()
    return dense + model.num_layers * (h * num_experts + num_experts // ep * expert)
