"""Single device: the reference, and the same run in another summation order (its rounding noise).

`SingleDevice` is the default behaviour of `Strategy`. `SingleReordered` computes exactly the same
training with its sums split where parallel strategies split them: each micro-batch of the reference
in two (gradient accumulation: every weight gradient summed over tokens as two partial sums, as data
parallelism does), and every linear layer's reduction over its input features in two halves added
together (split-K, as row-parallel tensor parallelism and split-K GEMM kernels do; under bf16
autocast each half is rounded to bf16 before the sum, as a TP shard's partial output is). In exact
arithmetic the two runs are identical; in floating point they differ by rounding alone, and how far
their loss curves drift apart is the noise floor of the parity rule (`tables.parity`).
"""

from functools import partial

import torch.nn.functional as F
from torch import nn

from shardlab.strategies.base import Strategy, split_micro_batches
from shardlab.strategies import smaller_micro_batch


def split_reduction_forward(linear: nn.Linear, x):
    """`linear(x)` with the sum over input features taken as two halves, then added."""
    k = linear.in_features // 2
    y = F.linear(x[..., :k], linear.weight[:, :k]) + F.linear(x[..., k:], linear.weight[:, k:])
    return y if linear.bias is None else y + linear.bias


class SingleDevice(Strategy):
    dp_rank, dp_size = 0, 1  # one process holds the whole global batch


class SingleReordered(SingleDevice):
    def wrap(self, model):
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.in_features >= 2:
                module.forward = partial(split_reduction_forward, module)  # same parameters and names
        return model

    def micro_batches(self, inputs, labels):
        rows = min(self.training.get("micro_batch_size") or inputs.shape[0], inputs.shape[0])
        return split_micro_batches(inputs, labels, smaller_micro_batch(rows))
