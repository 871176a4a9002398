"""Activation memory per transformer layer, by component: one formula (`layer_bytes`) that covers the
Korthikanti et al. (2022) setting and what our GPT-NeoX actually saves, and the mapping from the
activation probe's module names to components. A model of cost: it never feeds back into what a run
records.

Symbols: s sequence length, b micro-batch, h hidden size, a heads, i intermediate (MLP) width,
t tensor-parallel degree, v bytes per activation value.

Korthikanti et al. (sequential residual, eager attention, dropout, v = 2, 1-byte masks, i = 4h), per
layer without recomputation:
    LayerNorm inputs 4sbh | QKV input 2sbh | attention core 6sbh + 5as^2b (Q, K, V; softmax output;
    softmax dropout mask and output) | output-projection input 2sbh | dropout masks 2sbh |
    MLP 18sbh (input 2, GeLU input 8, GeLU output 8)           = sbh(34 + 5as/h)
    TP keeps LayerNorms, QKV/MLP inputs and dropout masks whole (10sbh) and splits the rest by t;
    TP+SP splits everything by t; selective recomputation drops the 5as^2b; full keeps the input.

What our GPT-NeoX saves (Pythia: parallel residual, SDPA, dropout 0; measured by the probe over the
grid of tests/test_cost_grid.py, transformers 5):
- LayerNorm: both LayerNorms read the SAME residual tensor (parallel residual), so it is saved once
  (sbh values, not 2sbh), plus each LayerNorm's mean and rstd per token (`norm_stats_bytes`).
- Attention core: no s^2 term. SDPA's flash kernels save Q and K after the rotary embedding (new
  tensors), V (a view of the fused QKV output, which keeps all of it alive), the output and a float32
  logsumexp per (head, token): v sb(h + kvw) + v sb(h + 2kvw) + v sbh + 4asb with kvw = h kv/a, i.e.
  6 v sbh + 4asb without GQA (as with Megatron's fused QKV and RoPE). The rotary cos/sin tables
  (2 s x rotary dims, < 1 % of the core) are left out. (With `use_cache=True` transformers copies K
  and V into its cache instead; training runs turn the cache off.)
- MLP: the input, the GeLU input and output, each of width i (not 4h): v sb(h + 2i).
- Dropout: p = 0, so torch saves no masks.
- bf16: under `torch.autocast` (how the torch-native strategies run bf16) the residual stream and the
  LayerNorms stay float32 (the LayerNorm input costs 4 bytes a value), every matmul saves its bf16
  input AND a bf16 copy of its weight (2 bytes per weight element, per layer, independent of s and b:
  `autocast=True`); with the module itself in bf16 (DeepSpeed's and FSDP2's bf16) every value is 2
  bytes and no weight copy is saved. The logsumexp stays float32 in both.
- Sequence parallelism: the all-gathered inputs of the column-parallel layers are what the linear
  layers save. Our hand-written `tp_sp` saves only the sequence shard and re-gathers it in backward
  (as Megatron-LM does), so it follows the TP+SP formula; DTensor's SequenceParallel keeps the
  gathered input whole (split 'tensor_sequence_gathered'). Under autocast `tp_sp`'s column layers
  (one autograd Function each) save that shard in the LayerNorm's float32 and no bf16 weight copy.
"""

from __future__ import annotations

import re

COMPONENTS = ["layernorm", "qkv", "attention_core", "attention_projection", "dropout", "mlp", "residual"]

# Innermost module name (as tagged by probes.ActivationProbe) -> component of a transformer layer.
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


SPLITS = ("none", "tensor", "tensor_sequence", "tensor_sequence_gathered")
RECOMPUTE = ("none", "selective", "op", "full")
ATTENTION = ("flash", "sdpa", "eager", "ring")
# How the probed runs store values (tests/test_cost_grid.py): fp32; bf16 under torch.autocast (the
# torch-native strategies); bf16 with the module cast (DeepSpeed, FSDP2; CPU's bf16 LayerNorm keeps
# bf16 statistics).
PRECISIONS = {"fp32": {"value_bytes": 4, "autocast": False, "norm_stats_bytes": 4},
              "bf16_autocast": {"value_bytes": 2, "autocast": True, "norm_stats_bytes": 4},
              "bf16_cast": {"value_bytes": 2, "autocast": False, "norm_stats_bytes": 2}}


def layer_bytes(s: int, b: int, h: int, a: int, intermediate: int, t: int = 1, split: str = "none",
                value_bytes: int = 4, residual: str = "parallel", attention: str = "sdpa", dropout: bool = False,
                recompute: str = "none", mask_bytes: int = 1, kv_heads: int | None = None, mlp: str = "gelu",
                autocast: bool = False, norm_stats_bytes: int = 0, weight_copies: bool = True,
                keys: int | None = None) -> dict[str, float]:
    """Bytes one transformer layer keeps for backward on one rank, by component (see the module docstring).

    split: one of SPLITS ('none', 'tensor', 'tensor_sequence', 'tensor_sequence_gathered');
    residual: 'parallel' (both LayerNorms read one input) | 'sequential'; attention: 'flash' (a fused
    kernel as Megatron and FlashAttention run it: Q, K, V and a logsumexp; its output is the projection's
    input) | 'sdpa' (what transformers' SDPA path saves in our GPT-NeoX, see the module docstring) |
    'eager' (scores, softmax; dropout's mask and output) | 'ring'; recompute: 'none' | 'selective' (the attention core's inputs
    Q, K, V are kept, the rest recomputed) | 'op' (`_per_op_saved`) | 'full' (only the layer input); kv_heads: for GQA;
    mlp: 'gelu' (GeLU input and output) | 'swiglu' (fused: gate and up outputs, their product);
    autocast: bf16 compute over fp32 weights (fp32 residual stream, bf16 weight copies);
    norm_stats_bytes: per LayerNorm statistic value (0: left out, as the paper does); weight_copies: False
    leaves autocast's weight copies out (a pipeline rank keeps them once for all its micro-batches); keys:
    the keys each query attends to (default s; the whole sequence under context parallelism, where s is
    the rank's share of the queries: eager attention's score matrix is (s/cp) x s per rank)."""
    _check(split, residual, attention, recompute, mlp)
    by = _Splitter(t if split != "none" else 1, split)
    sb, sbh, v = s * b, s * b * h, value_bytes
    kv_width = h * (kv_heads or a) / a
    residual_bytes = 4 if autocast else v
    copy = v if autocast and weight_copies else 0  # bytes per weight element of autocast's saved bf16 weight copies
    if recompute == "full":
        return dict(dict.fromkeys(COMPONENTS, 0.0), residual=by.sp(residual_bytes * sbh))
    if recompute == "op":
        return _per_op_saved(by, sb, h, a, v, residual_bytes, kv_width, intermediate, mlp)
    inputs = 1 if residual == "parallel" else 2
    # Saved width-i tensors (GeLU: its input and output; fused SwiGLU: gate, up, their product), and as
    # many weight matrices of h x i (up, down; gate, up, down).
    wide = 3 if mlp == "swiglu" else 2
    qkv_width = h + 2 * kv_width
    if recompute == "selective":
        # The core's inputs only, as the kernel gets them: Q, K, V (the paper's count: eager, flash); under
        # this GPT-NeoX's SDPA and ring kernels rotary's new Q and K too, V staying a view of the fused QKV
        # output, kept whole (what `_attention_saved` counts for SDPA beyond Q, K, V).
        core = v * sb * qkv_width + (v * sb * (h + kv_width) if attention in ("sdpa", "ring") else 0)
    else:
        # Q, K, V (the paper's count; under SDPA: the fused QKV output, see below; the ring kernel keeps
        # fp32 copies), and what the core saves beyond them.
        core = (4 if attention == "ring" else v) * sb * qkv_width + _attention_saved(
            s, b, h, a, v, attention, dropout, mask_bytes, kv_width, keys or s)
    # SP that re-gathers in backward saves the column layers' input shard as the LayerNorm wrote it (fp32
    # under autocast), inside one autograd Function: no bf16 copy of that input or of the layer's weight.
    column_bytes, column_copy = (residual_bytes, 0) if split == "tensor_sequence" else (v, copy)
    return {
        "layernorm": by.sp(inputs * residual_bytes * sbh + 2 * 2 * sb * norm_stats_bytes),
        "qkv": by.column_input(column_bytes * sbh) + by.tp(column_copy * h * qkv_width),
        "attention_core": by.tp(core),
        "attention_projection": by.tp(v * sbh + copy * h * h),
        "dropout": by.sp(2 * mask_bytes * sbh) if dropout else 0.0,
        "mlp": by.column_input(column_bytes * sbh) + by.tp(wide * v * sb * intermediate
                                                          + (column_copy * (wide - 1) + copy) * h * intermediate),
        "residual": 0.0,
    }


def _per_op_saved(by: _Splitter, sb: int, h: int, a: int, v: int, residual_bytes: int, kv_width: float,
                  intermediate: int, mlp: str) -> dict[str, float]:
    """Per-op selective checkpointing as torchtitan applies it to a layer with separate Q, K, V, output
    and MLP projections: the layer's input, the attention kernel's output and logsumexp, and the output
    of every other matrix product in forward order (Q, V, the first MLP projection and, in a SwiGLU
    MLP, the down projection) are saved; the other products and every element-wise op are recomputed."""
    down = by.sp(v * sb * h) if mlp == "swiglu" else 0.0
    return dict(dict.fromkeys(COMPONENTS, 0.0), residual=by.sp(residual_bytes * sb * h),
                qkv=by.tp(v * sb * (h + kv_width)), attention_core=by.tp(v * sb * h + 4 * a * sb),
                mlp=by.tp(v * sb * intermediate) + down)


def _attention_saved(s: int, b: int, h: int, a: int, v: int, attention: str, dropout: bool,
                     mask_bytes: int, kv_width: float, keys: int) -> float:
    """What the attention core saves beyond Q, K, V (`keys`: the keys each of the s queries attends to, the
    whole sequence where context parallelism splits the queries)."""
    if attention == "ring":
        # The hand-written blockwise kernel (context parallelism) saves float32 copies of Q, K, V, its float32
        # output and logsumexp per (head, token), in any dtype; no view of a fused QKV output stays alive.
        return 4 * s * b * h + 4 * a * s * b
    if attention == "flash":
        return 4 * a * s * b  # the float32 logsumexp per (head, token); the output is counted as the projection's input
    if attention == "sdpa":
        # V is a view of the fused QKV output (kept whole); rotary makes new Q and K; the output and a
        # float32 logsumexp per (head, token).
        return v * s * b * (h + kv_width) + v * s * b * h + 4 * a * s * b
    scores = a * s * keys * b
    return v * scores + ((mask_bytes + v) * scores if dropout else 0)  # softmax output; dropout mask, output


class _Splitter:
    """Which tensors a tensor-parallel split divides by t."""

    def __init__(self, t: int, split: str):
        self.t, self.split = t, split

    def tp(self, value: float) -> float:  # heads / MLP width: split under any TP
        return value / self.t

    def sp(self, value: float) -> float:  # the residual stream: split only under sequence parallelism
        return value / self.t if self.split.startswith("tensor_sequence") else value

    def column_input(self, value: float) -> float:  # kept whole when SP's gathered input is saved
        return value / self.t if self.split == "tensor_sequence" else value


def _check(split: str, residual: str, attention: str, recompute: str, mlp: str) -> None:
    for name, value, known in [("split", split, SPLITS), ("residual", residual, ("parallel", "sequential")),
                               ("attention", attention, ATTENTION), ("recompute", recompute, RECOMPUTE),
                               ("mlp", mlp, ("gelu", "swiglu"))]:
        if value not in known:
            raise ValueError(f"unknown {name} {value!r} (known: {', '.join(known)})")


def korthikanti_per_layer(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none",
                          value_bytes: int = 2, mask_bytes: int = 1, recompute: str = "none") -> dict[str, float]:
    """The paper's per-layer activation bytes by component. mode: 'none' (no TP), 'tensor', 'tensor_sequence';
    recompute: 'none', 'selective' (its section 5) or 'full'."""
    return layer_bytes(s, b, h, a, 4 * h, t, mode, value_bytes, residual="sequential", attention="eager",
                       dropout=True, mask_bytes=mask_bytes, recompute=recompute)


def korthikanti_total(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none") -> float:
    """The closed forms of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", section 4; 2-byte activations): sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)), sbh/t (34 + 5as/h)."""
    sbh = s * b * h
    if mode == "none":
        return sbh * (34 + 5 * a * s / h)
    if mode == "tensor":
        return sbh * (10 + 24 / t + 5 * a * s / (h * t))
    return sbh / t * (34 + 5 * a * s / h)


def this_model_per_layer(s: int, b: int, h: int, a: int, t: int = 1, mode: str = "none",
                         value_bytes: int = 4, gathered_inputs_saved: bool = False, intermediate: int | None = None,
                         precision: str | None = None) -> dict[str, float]:
    """Per-layer bytes this GPT-NeoX saves (see the module docstring). `gathered_inputs_saved`: under
    SP, the column-parallel layers keep the all-gathered (whole-sequence) input (DTensor's behaviour);
    `intermediate`: the MLP width (default 4h); `precision`: a key of PRECISIONS (default: fp32 values
    of `value_bytes`)."""
    split = "tensor_sequence_gathered" if mode == "tensor_sequence" and gathered_inputs_saved else mode
    how = PRECISIONS[precision] if precision else dict(PRECISIONS["fp32"], value_bytes=value_bytes)
    return layer_bytes(s, b, h, a, intermediate or 4 * h, t, split, **how)


# Components whose assumptions hold in this model, so the paper's formula (with fp32 values) applies.
MATCHING_COMPONENTS = ["qkv", "attention_projection", "mlp"]

# A Plan's `activation_split` (one of SPLITS) -> how it splits a layer's activations:
# the paper's mode ("none", "tensor", "tensor_sequence") and whether SP keeps the gathered column inputs whole.


def paper_mode(split: str) -> str:
    """The Korthikanti et al. mode of an activation split: 'tensor_sequence_gathered' is still TP+SP there."""
    if split not in SPLITS:
        raise ValueError(f"unknown activation split {split!r} (known: {', '.join(SPLITS)})")
    return "tensor_sequence" if split.startswith("tensor_sequence") else split


def comparison_rows(split: str, activation_by_module: dict[str, int], dims: dict, t: int,
                    recompute: str = "none") -> list[dict]:
    """One row per component: measured vs the paper (scaled to the run's value bytes) vs this model's formula.

    split: the run's `Plan.activation_split`; dims: s, b (the probed micro-batch on this rank), h, a,
    n_layers, and optionally intermediate (default 4h) and precision (a key of PRECISIONS, default
    fp32); t: the run's world size (the TP degree when the split is not 'none'); recompute: the run's
    `Plan.recompute` (a fully recomputed layer's input is its residual component)."""
    mode = paper_mode(split)
    t = t if mode != "none" else 1
    s, b, h, a = dims["s"], dims["b"], dims["h"], dims["a"]
    intermediate, precision = dims.get("intermediate", 4 * h), PRECISIONS[dims.get("precision", "fp32")]
    measured = measured_per_layer(activation_by_module, dims["n_layers"])
    paper = korthikanti_per_layer(s, b, h, a, t, mode, value_bytes=precision["value_bytes"], mask_bytes=1,
                                  recompute=recompute)
    ours = layer_bytes(s, b, h, a, intermediate, t, split, recompute=recompute, **precision)
    rows = []
    for component in COMPONENTS:
        rows.append({"mode": mode, "tp": t, "component": component,
                     "measured_bytes": measured[component], "paper_formula_bytes": paper[component],
                     "model_formula_bytes": ours[component],
                     "paper_assumptions_hold": component in paper_components(split, intermediate == 4 * h,
                                                                             precision["autocast"])})
    return rows


def paper_components(split: str, mlp_is_4h: bool, autocast: bool) -> list[str]:
    """Components where the paper's formula describes this model: none under autocast (its saved bf16
    weight copies are not in the paper); the MLP only at width 4h; under 'tensor_sequence_gathered' neither qkv nor
    the MLP (the gathered inputs of the column layers are kept whole)."""
    if autocast:
        return []
    broken = {"mlp"} if not mlp_is_4h else set()
    broken |= {"qkv", "mlp"} if split == "tensor_sequence_gathered" else set()
    return [c for c in MATCHING_COMPONENTS if c not in broken]
