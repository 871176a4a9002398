"""The shape every cost model works from: a GPT-NeoX (Pythia) model, its parameter counts, and the
pipeline's stage cut.

Pure arithmetic (no torch): the registry, the planner and the tables import it freely; the
strategies that really cut the model (`pipeline_parallel.stages`) use the same stage cut. Shapes the
planner knows by name are in `models.yaml`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

EMBED, HEAD = "embed", "head"
MODELS = Path(__file__).with_name("models.yaml")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer shape. The defaults describe GPT-NeoX (Pythia), the models this
    project trains: untied embedding and LM head, parallel residual, LayerNorm, biases everywhere but
    the head, a two-matrix GeLU MLP. The optional fields describe the larger families the planner
    sizes: grouped-query attention (`num_kv_heads`), SwiGLU MLPs, sequential residual (GPT-3,
    Llama), bias-free RMSNorm models (`biases=False`), tied embeddings, and mixture-of-experts MLPs
    (`num_experts` experts of width `expert_intermediate`, `top_k` routed per token)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    num_kv_heads: int | None = None  # None: as many as query heads
    mlp: str = "gelu"  # "gelu" (up, down) or "swiglu" (gate, up, down)
    residual: str = "parallel"  # "parallel" (GPT-NeoX) or "sequential" (GPT-3, Llama)
    biases: bool = True  # linear-layer biases and LayerNorm (else RMSNorm, weight only)
    tied_embeddings: bool = False
    num_experts: int = 0  # 0: dense MLPs
    top_k: int = 1
    expert_intermediate: int | None = None  # None: intermediate_size

    def __hash__(self) -> int:  # the cost model's caches hash a shape millions of times in a search
        try:
            return self._hash
        except AttributeError:
            object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in self.__dataclass_fields__)))
            return self._hash

    @classmethod
    def from_dict(cls, d: dict) -> ModelShape:
        """From a shardlab model config, a Hugging Face config.json, or a planner scenario (which may
        name the optional fields directly)."""
        get = lambda *keys: next(d[k] for k in keys if k in d)  # noqa: E731
        optional = {f: d[f] for f in ("num_kv_heads", "mlp", "residual", "biases", "tied_embeddings",
                                      "num_experts", "top_k", "expert_intermediate") if f in d}
        if "num_key_value_heads" in d:
            optional.setdefault("num_kv_heads", d["num_key_value_heads"])
        if d.get("tie_word_embeddings"):
            optional.setdefault("tied_embeddings", True)
        return cls(get("vocab_size"), get("hidden_size"), get("num_layers", "num_hidden_layers"),
                   get("num_heads", "num_attention_heads"), get("intermediate_size"), **optional)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def kv_width(self) -> int:
        """Width of the K (or V) projection: kv_heads x head dimension."""
        return self.kv_heads * (self.hidden_size // self.num_heads)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    def norm_parameters(self) -> int:
        return (2 if self.biases else 1) * self.hidden_size

    def head_parameters(self) -> int:
        """Final norm and LM head (no bias; shares the embedding's weight when tied)."""
        return self.norm_parameters() + (0 if self.tied_embeddings else self.hidden_size * self.vocab_size)

    def ffn_parameters(self, width: int) -> int:
        """One MLP (or one expert) of `width`."""
        h, bias = self.hidden_size, self.biases
        up = (self.mlp_matrices - 1) * (h * width + (width if bias else 0))
        return up + width * h + (h if bias else 0)

    def mlp_parameters(self) -> int:
        """The MLP block of one layer: one dense MLP, or the router and every expert."""
        if not self.num_experts:
            return self.ffn_parameters(self.intermediate_size)
        return self.hidden_size * self.num_experts + self.num_experts * self.expert_parameters()

    def expert_parameters(self) -> int:
        return self.ffn_parameters(self.expert_intermediate or self.intermediate_size)

    def attention_parameters(self) -> int:
        h, kv, bias = self.hidden_size, self.kv_width, self.biases
        qkv = h * (h + 2 * kv) + ((h + 2 * kv) if bias else 0)
        return qkv + h * h + (h if bias else 0)

    def layer_parameters(self) -> int:
        return 2 * self.norm_parameters() + self.attention_parameters() + self.mlp_parameters()

    def parameters(self) -> int:
        return self.embedding_parameters() + self.num_layers * self.layer_parameters() + self.head_parameters()

    def active_parameters(self) -> int:
        """Parameters one token's forward pass uses: top_k experts instead of all of them."""
        if not self.num_experts:
            return self.parameters()
        unused = (self.num_experts - self.top_k) * self.expert_parameters()
        return self.parameters() - self.num_layers * unused

    def matmul_parameters(self) -> int:
        """Parameters one token's forward multiplies by (what 6 FLOPs per parameter counts): the active
        ones less the input embedding, a table lookup. An untied model's LM head is its own matrix; a
        tied model's head is the embedding's matrix, counted once either way."""
        return self.active_parameters() - (0 if self.tied_embeddings else self.embedding_parameters())

    def layer_parameters_kept_whole(self) -> int:
        """Parameters of one layer that tensor parallelism replicates: the norms, the row-parallel
        biases (attention output, MLP or expert down-projections) and the router."""
        h, bias = self.hidden_size, self.biases
        whole = 2 * self.norm_parameters() + (h if bias else 0)
        if self.num_experts:
            return whole + h * self.num_experts + self.num_experts * (h if bias else 0)
        return whole + (h if bias else 0)


@lru_cache(maxsize=1)
def known_models() -> dict:
    """The shapes the planner knows by name (models.yaml)."""
    return yaml.safe_load(MODELS.read_text())


def model_shape(name_or_path: str | dict) -> ModelShape:
    """A named shape (models.yaml), a shape's fields, or a config file (HF config.json, YAML)."""
    if isinstance(name_or_path, dict):
        return ModelShape.from_dict(name_or_path)
    if name_or_path in known_models():
        return ModelShape.from_dict(known_models()[name_or_path])
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"{name_or_path!r} is neither a known model ({', '.join(known_models())}) nor a file")
    return ModelShape.from_dict(yaml.safe_load(path.read_text()))


def split_evenly(n: int, parts: int) -> list[range]:
    """0..n-1 in `parts` contiguous runs whose lengths differ by at most one (longer runs first)."""
    size, extra = divmod(n, parts)
    starts = [k * size + min(k, extra) for k in range(parts + 1)]
    return [range(starts[k], starts[k + 1]) for k in range(parts)]


def cuts_evenly(n_layers: int, n_stages: int) -> bool:
    """Whether `n_stages` pipeline stages can hold equal shares of the model: the layers split evenly,
    or, with the embedding and the head each taking one layer's slot, the layers + 2 do (Llama 3
    405B's cut: 126 layers over 16 stages, the first and the last stage holding one layer fewer)."""
    return n_layers % n_stages == 0 or (n_layers + 2) % n_stages == 0


def stage_units(n_layers: int, n_stages: int) -> list[list]:
    """Units of each pipeline stage, e.g. (4, 2) -> [['embed', 0, 1], [2, 3, 'head']].

    Where the layers split evenly, each stage holds as many and the first stage adds the embedding,
    the last the head. Where only layers + 2 split evenly, or there are more stages than layers, the
    embedding and the head count as one unit each and the units are spread: (126, 16) gives the first
    stage the embedding and 7 layers, the last 7 layers and the head, the others 8 layers. Any other
    count (a run may still ask for it) spreads the layers, longer runs first."""
    if n_stages < 1:
        raise ValueError("a pipeline needs at least one stage")
    only_units_split = n_layers % n_stages != 0 and (n_layers + 2) % n_stages == 0
    if n_layers >= n_stages and not only_units_split:
        chunks = [list(r) for r in split_evenly(n_layers, n_stages)]
        chunks[0].insert(0, EMBED)
        chunks[-1].append(HEAD)
        return chunks
    units = [EMBED, *range(n_layers), HEAD]
    if len(units) < n_stages:
        raise ValueError(f"{n_stages} stages cannot be cut from {n_layers} layers (+ embedding and head)")
    return [[units[i] for i in r] for r in split_evenly(len(units), n_stages)]
