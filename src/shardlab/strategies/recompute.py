"""Activation recomputation (the Plan field `recompute`, set by `training.recompute`): what each
transformer layer keeps for backward and what backward computes again, under any strategy.

- `full`: a layer keeps only its input and runs again in backward: transformers' activation
  checkpointing of the GPT-NeoX layers, with non-reentrant `torch.utils.checkpoint`.
- `selective`: the attention core (Korthikanti et al. 2022, section 5): its inputs Q, K and V are
  kept, the scores, softmax and attention over V run again. Whatever attention the run uses (SDPA,
  eager, the ring kernel of context parallelism) is wrapped through transformers' AttentionInterface.

Both apply to the model's own layer objects, which every strategy keeps (TP replaces their linear
layers, pipeline stages hold them, DDP, FSDP2 and DeepSpeed wrap them), after the strategy has set
its attention, so each composes with every parallel dimension. The checkpoint restores the RNG state
before recomputing (`preserve_rng_state`), so dropout draws the same masks twice.
"""

from __future__ import annotations

import sys

from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")
PRESERVE_RNG_STATE = True  # a module constant so that a test can drop the RNG restore and see parity fail


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Recompute `mode` in the transformers model `model` (its layers and config, shared with whatever
    the strategy wrapped it in)."""
    if mode == "full":
        # transformers recomputes only in training mode; from_pretrained returns eval mode (every model here
        # has dropout off, so the mode changes nothing else).
        model.train()
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": PRESERVE_RNG_STATE})
    elif mode == "selective":
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        name = model.config._attn_implementation
        core = ALL_ATTENTION_FUNCTIONS[name] if name in ALL_ATTENTION_FUNCTIONS else eager_attention(model)
        AttentionInterface.register(f"{name}_recomputed", recomputed(core))
        model.set_attn_implementation(f"{name}_recomputed")
    elif mode != "none":
        raise ValueError(f"recompute must be one of {', '.join(MODES)}, not {mode!r}")


def recomputed(core):
    """`core` (a transformers attention function) run under a checkpoint: only its inputs are saved."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        return checkpoint(core, module, query, key, value, attention_mask, use_reentrant=False,
                          preserve_rng_state=PRESERVE_RNG_STATE, **kwargs)

    return attention


def eager_attention(model: nn.Module):
    """The model family's own eager attention function (transformers keeps 'eager' out of its registry)."""
    return sys.modules[type(model).__module__].eager_attention_forward
