"""Activation memory per transformer layer, by component: the Korthikanti et al. (2022) formulas,
the same formulas adapted to what our GPT-NeoX actually saves, and the mapping from the activation
probe's module names to components. A model of cost: it never feeds back into what a run records.

Symbols: s sequence length, b micro-batch, h hidden size, a heads, t tensor-parallel degree.

Korthikanti et al. (2-byte activations, 1-byte dropout masks), per layer, without recomputation:
    LayerNorm inputs 4sbh | QKV input 2sbh | attention core 6sbh + 5as^2b (Q, K, V; softmax output;
    softmax dropout mask and output) | output-projection input 2sbh | dropout masks 2sbh |
    MLP 18sbh (input 2, GeLU input 8, GeLU output 8)           = sbh(34 + 5as/h)
    TP keeps LayerNorms, QKV/MLP inputs and dropout masks whole (10sbh) and splits the rest by t;
    TP+SP splits everything by t.

What this model saves instead (fp32, GPT-NeoX with Pythia's parallel residual, SDPA, dropout 0):
- LayerNorm: both LayerNorms read the SAME residual tensor (parallel residual), so it is saved
  once (sbh values, not 2sbh), plus each LayerNorm's fp32 mean and rstd (2 x 2sb values).
- Attention core: no s^2 term. SDPA's CPU/flash kernels never materialise scores or softmax; they
  save Q and K after RoPE, the fused QKV output (V is a view of it, which keeps all 3sbh alive),
  the output (sbh) and a logsumexp per (head, token) (asb): 6sbh + asb values.
- Dropout: p = 0, so torch saves no masks (0 instead of 2sbh).
- Sequence parallelism: the all-gathered inputs of the column-parallel layers are what the
  linear layers save. Our hand-written `tp_sp` saves only the sequence shard and re-gathers it in
  backward (as Megatron-LM does), so it follows the TP+SP formula; DTensor's SequenceParallel
  keeps the gathered input whole (2 x sbh per layer).
"""

from __future__ import annotations

import re

COMPONENTS = ["layernorm", "qkv", "attention_core", "attention_projection", "dropout", "mlp", "residual"]

# Innermost module name (as tagged by memory.ActivationProbe) -> component of a transformer layer.
_LAYER_PATTERNS = [
    (re.compile(r"\.layers\.\d+\.(input_layernorm|post_attention_layernorm)$"), "layernorm"),
    (re.compile(r"\.layers\.\d+\.attention\.query_key_value$"), "qkv"),
    (re.compile(r"\.layers\.\d+\.attention\.dense$"), "attention_projection"),
    (re.compile(r"\.layers\.\d+\.attention$"), "attention_core"),
    (re.compile(r"\.layers\.\d+\.(post_attention_dropout|post_mlp_dropout)$"), "dropout"),
    (re.compile(r"\.layers\.\d+\.mlp(\..*)?$"), "mlp"),
    (re.compile(r"\.layers\.\d+$"), "residual"),
]


def component_of(module_name: str) -> str:
    """The transformer-layer component a module belongs to, or 'outside_layers' (embedding, final
    LayerNorm, LM head, loss)."""
    for pattern, component in _LAYER_PATTERNS:
        if pattern.search(module_name):
            return component
    return "outside_layers"


def measured_per_layer(activation_by_module: dict[str, int], n_layers: int) -> dict[str, float]:
    """Bytes per layer by component (mean over layers), from one rank's `activation_by_module`."""
    out = {c: 0.0 for c in COMPONENTS}
    for module, nbytes in activation_by_module.items():
        component = component_of(module)
        if component != "outside_layers":
            out[component] += nbytes / n_layers
    return out


def _split(value: float, t: int, sharded: bool) -> float:
    return value / t if sharded else value


def korthikanti_per_layer(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none",
                          value_bytes: int = 2, mask_bytes: int = 1) -> dict[str, float]:
    """The paper's per-layer activation bytes by component. mode: 'none' (no TP), 'tp', 'tp_sp'."""
    sbh, as2b = s * b * h, a * s * s * b
    tp, sp = mode in ("tp", "tp_sp"), mode == "tp_sp"
    v, m = value_bytes, mask_bytes
    return {
        "layernorm": _split(2 * v * sbh, t, sp),
        "qkv": _split(v * sbh, t, sp),
        "attention_core": _split(3 * v * sbh + 2 * v * as2b + m * as2b, t, tp),
        "attention_projection": _split(v * sbh, t, tp),
        "dropout": _split(2 * m * sbh, t, sp),
        "mlp": _split(v * sbh, t, sp) + _split(8 * v * sbh, t, tp),
        "residual": 0.0,
    }


def korthikanti_total(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none") -> float:
    """The closed forms of paper.md (2-byte activations): sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)),
    sbh/t (34 + 5as/h)."""
    sbh = s * b * h
    if mode == "none":
        return sbh * (34 + 5 * a * s / h)
    if mode == "tp":
        return sbh * (10 + 24 / t + 5 * a * s / (h * t))
    return sbh / t * (34 + 5 * a * s / h)


def this_model_per_layer(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none",
                         value_bytes: int = 4, gathered_inputs_saved: bool = False) -> dict[str, float]:
    """Per-layer bytes this GPT-NeoX saves (see the module docstring). `gathered_inputs_saved`: under
    SP, the column-parallel layers keep the all-gathered (whole-sequence) input (DTensor's behaviour)."""
    sbh, v = s * b * h, value_bytes
    tp, sp = mode in ("tp", "tp_sp"), mode == "tp_sp"
    column_input_sharded = sp and not gathered_inputs_saved
    return {
        "layernorm": _split(v * sbh + 2 * 2 * 4 * s * b, t, sp),
        "qkv": _split(v * sbh, t, column_input_sharded),
        "attention_core": _split(6 * v * sbh + 4 * a * s * b, t, tp),
        "attention_projection": _split(v * sbh, t, tp),
        "dropout": 0.0,
        "mlp": _split(v * sbh, t, column_input_sharded) + _split(8 * v * sbh, t, tp),
        "residual": 0.0,
    }


# Components whose assumptions hold in this model, so the paper's formula (with fp32 values) applies.
MATCHING_COMPONENTS = ["qkv", "attention_projection", "mlp"]

# A strategy's `activation_split` (registry) -> how it splits a layer's activations:
# the paper's mode ("none", "tp", "tp_sp") and whether SP keeps the gathered column inputs whole.
SPLITS = ("none", "tp", "tp_sp", "tp_sp_gathered")


def paper_mode(split: str) -> str:
    """The Korthikanti et al. mode of an activation split: 'tp_sp_gathered' is still TP+SP there."""
    if split not in SPLITS:
        raise ValueError(f"unknown activation split {split!r} (known: {', '.join(SPLITS)})")
    return "tp_sp" if split.startswith("tp_sp") else split


def comparison_rows(split: str, activation_by_module: dict[str, int], dims: dict, t: int) -> list[dict]:
    """One row per component: measured vs the paper (fp32-scaled) vs this model's formula.

    split: the strategy's `activation_split`; dims: s, b (the probed micro-batch on this rank), h, a,
    n_layers; t: the run's world size (the TP degree when the split is not 'none')."""
    mode = paper_mode(split)
    t = t if mode != "none" else 1
    s, b, h, a = dims["s"], dims["b"], dims["h"], dims["a"]
    measured = measured_per_layer(activation_by_module, dims["n_layers"])
    paper = korthikanti_per_layer(s, b, h, a, t, mode, value_bytes=4, mask_bytes=1)
    gathered_inputs_saved = split == "tp_sp_gathered"
    ours = this_model_per_layer(s, b, h, a, t, mode, gathered_inputs_saved=gathered_inputs_saved)
    # Kept whole, the gathered inputs of the column layers break the paper's TP+SP split of qkv and mlp.
    holds = [c for c in MATCHING_COMPONENTS if not (gathered_inputs_saved and c in ("qkv", "mlp"))]
    rows = []
    for component in COMPONENTS:
        rows.append({"mode": mode, "tp": t, "component": component,
                     "measured_bytes": measured[component], "paper_formula_bytes": paper[component],
                     "model_formula_bytes": ours[component],
                     "paper_assumptions_hold": component in holds})
    return rows
