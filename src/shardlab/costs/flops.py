"""FLOPs of a training step beyond the model's: what activation recompute runs again.

MFU counts the model's FLOPs (`hardware.training_flops_per_token`: forward and backward once).
Hardware FLOPs utilisation (HFU) and Megatron's TFLOP/s per GPU (Narayanan et al. 2021) count
what the GPUs execute, recomputed forwards included: full recompute runs the whole forward again
(8 instead of 6 FLOPs per parameter per token), selective recompute only the attention core, the
score and value products (Korthikanti et al. 2022). The step time (`costs.step_time`) charges the
same passes.
"""

from __future__ import annotations

from shardlab.costs.shapes import ModelShape


def recomputed_flops_per_token(model: ModelShape, recompute: str, seq_len: int) -> float:
    """Forward FLOPs per token that `recompute` ('none', 'selective', 'full') runs a second time:
    2 per active parameter for the whole forward, plus attention's score and value products,
    4 x layers x hidden x seq_len (one third of the model FLOPs' 6 and 12 per token)."""
    attention_core = 4 * model.num_layers * model.hidden_size * seq_len
    if recompute == "full":
        return 2 * model.active_parameters() + attention_core
    return attention_core if recompute == "selective" else 0.0
