"""Vocabulary-parallel cross-entropy (Megatron-LM): the loss from logits split over the vocabulary,
without ever gathering them. Three all-reduces of one value per token (max, sum of exponentials,
target logit) replace the all-gather of s*b*V logits, and each rank keeps only s*b*V/t of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        """logits: [tokens, V/t] (this rank's vocabulary slice); labels: [tokens] (global ids). Mean loss."""
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)  # for a stable exp
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        local = labels - vocab_start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~inside, 0)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside  # 0 where another rank owns it
        dist.all_reduce(target, group=group)

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, inside)  # exp becomes softmax
        return (sum_exp.log() - target).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        # d(mean loss)/d(logits) = (softmax - onehot(label)) / tokens; the one-hot lives on one rank only.
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local] -= inside.to(grad_logits.dtype)
        return grad_logits * (grad / grad_logits.shape[0]), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits.float(), labels, vocab_start, group)
