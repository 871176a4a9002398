"""Cut a GPT-NeoX causal LM into pipeline stages by hand.

torch's tracer (`pipelining.pipeline()`) handles only 2 stages of HF GPT-NeoX: the causal mask and
the rotary embedding are computed once in the model and skip over layers. Here every stage
rebuilds both from its input's shape (cheap, and identical to what the full model computes), so
a stage needs nothing from its neighbours but the hidden states.

The model is a sequence of units: the token embedding, the transformer layers, then the head
(final norm + LM head). The first stage holds the embedding, the last the head; the layers are
spread evenly. With more stages than layers (e.g. 2 layers in 4 virtual stages), units are spread
instead, so the embedding and head get stages of their own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from shardlab.costs.shapes import EMBED, HEAD

class NeoXStage(nn.Module):
    """One contiguous slice of a GPTNeoXForCausalLM. Layers keep their original index as name
    (`layers.2.attention...`), so activation tables line up with the unsplit model's."""

    def __init__(self, causal_lm: nn.Module, units: list, sequence_shards: int = 1,
                 position_ids: torch.Tensor | None = None):
        super().__init__()
        # Composed with sequence parallelism, a stage past layer 0 receives one of `sequence_shards` shards
        # of the sequence; composed with context parallelism, its tokens sit at `position_ids` (zig-zag).
        self.sequence_shards = sequence_shards
        self.position_ids = position_ids
        base = causal_lm.gpt_neox
        self.config = causal_lm.config
        self.units = list(units)
        self.embed_in = base.embed_in if EMBED in units else None
        self.emb_dropout = base.emb_dropout if EMBED in units else None
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in units if isinstance(i, int)})
        self.rotary_emb = copy.deepcopy(base.rotary_emb)  # buffers only: every stage rebuilds RoPE
        self.final_layer_norm = base.final_layer_norm if HEAD in units else None
        self.lm_head = causal_lm.get_output_embeddings() if HEAD in units else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.embed_in is not None:
            hidden = self.emb_dropout(self.embed_in(hidden))
        if len(self.layers):
            seq = hidden.shape[1] * (1 if self.embed_in is not None or "0" in self.layers else self.sequence_shards)
            position_ids = (torch.arange(seq, device=hidden.device).unsqueeze(0) if self.position_ids is None
                            else self.position_ids)
            whole = hidden[:, :1].expand(hidden.shape[0], seq, hidden.shape[2])  # the mask's shape, no copy
            mask = create_causal_mask(config=self.config, inputs_embeds=whole, attention_mask=None,
                                      cache=None, position_ids=position_ids)
            rope = self.rotary_emb(hidden, position_ids=position_ids)
            for layer in self.layers.values():
                hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)
        if self.lm_head is not None:
            hidden = self.lm_head(self.final_layer_norm(hidden))
        return hidden.contiguous()  # sent to the next stage (SP's reduce-scatter leaves a permuted layout)
