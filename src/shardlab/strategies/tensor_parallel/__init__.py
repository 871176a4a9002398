"""Tensor and sequence parallelism: hand-written (Megatron-style) `tp`/`tp_sp` and their PyTorch
DTensor twins `tp_dtensor`/`tp_sp_dtensor`."""

from __future__ import annotations

from shardlab.costs.comm_volume import sequence_parallel, tensor_parallel
from shardlab.costs.memory import ModelStates, MOMENT_BYTES
from shardlab.strategies.spec import StrategySpec, one
from shardlab.strategies.tensor_parallel.options import check_tp_options

TOPIC = "tensor_parallel"


def _states(dtensor: bool):
    def states(model, world, options, dtype, optimizer):
        local = model.tensor_parallel_parameters(world)
        # Measured (torch 2.13): DTensor's vocabulary-sharded embedding gets a Replicate (whole) gradient.
        grads = local + (model.embedding_parameters() * (world - 1) // world if dtensor else 0)
        return [ModelStates(4 * local, 4 * grads, MOMENT_BYTES[optimizer] * local, 4 * grads, 0.0)] * world

    return states


def _spec(name: str, target: str, summary: str, sequence: bool, dtensor: bool, twin: str | None = None):
    plan = sequence_parallel if sequence else tensor_parallel
    split = ("tp_sp_gathered" if dtensor else "tp_sp") if sequence else "tp"
    return StrategySpec(name, f"shardlab.strategies.tensor_parallel.{target}", "tensor parallel", TOPIC, summary,
                        lambda model, step, world, options: plan(model, step, world), _states(dtensor), twin=twin,
                        data_parallel_size=one, check_options=check_tp_options, activation_split=split,
                        layout=lambda world, options: {"dp": 1, "tp": world, "sp": sequence,
                                                       "sp_gathered_inputs": split == "tp_sp_gathered"})


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
