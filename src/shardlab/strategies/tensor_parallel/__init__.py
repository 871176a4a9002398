"""Tensor and sequence parallelism: hand-written (Megatron-style) `tp`/`tp_sp` and their PyTorch
DTensor twins `tp_dtensor`/`tp_sp_dtensor`."""

from __future__ import annotations

from shardlab.strategies.spec import Family, StrategySpec, all_of, only_options
from shardlab.strategies.tensor_parallel.options import check_tp_options

TOPIC = "tensor_parallel"


def _spec(name: str, target: str, summary: str, sequence: bool, dtensor: bool, twin: str | None = None):
    # DTensor's SequenceParallel keeps the gathered column inputs, and its vocabulary-split embedding
    # gets a Replicate (whole) gradient (measured, torch 2.13). Both gather the logits for the loss
    # unless the hand-written one is asked for its vocabulary-parallel cross-entropy.
    fields = {"sp": sequence, "sp_gathered_inputs": sequence and dtensor, "whole_embedding_grad": dtensor}
    known = () if dtensor else ("parallel_cross_entropy",)
    return StrategySpec(name, f"shardlab.strategies.tensor_parallel.{target}", Family.TENSOR_PARALLEL, TOPIC, summary,
                        plan=lambda world, options: {"tp": world, **fields,
                                                     "vocab_parallel_loss": bool(options.get("parallel_cross_entropy"))},
                        twin=twin,
                        check_options=all_of(only_options(*known), check_tp_options))


SPECS = [
    _spec("tp", "tensor_parallel:HandTensorParallel",
          "Megatron-style column/row-parallel attention and MLP, vocab-parallel embedding and head (hand-written).",
          sequence=False, dtensor=False, twin="tp_dtensor"),
    _spec("tp_sp", "tensor_parallel:HandSequenceParallel",
          "tp plus sequence parallelism: LayerNorms and residuals on a sequence shard (hand-written).",
          sequence=True, dtensor=False, twin="tp_sp_dtensor"),
    _spec("tp_dtensor", "dtensor_tp:DTensorTensorParallel",
          "PyTorch DTensor parallelize_module with Colwise/RowwiseParallel (comparator for tp).",
          sequence=False, dtensor=True),
    _spec("tp_sp_dtensor", "dtensor_tp:DTensorSequenceParallel",
          "DTensor TP plus SequenceParallel LayerNorms (comparator for tp_sp).", sequence=True, dtensor=True),
]
