"""Ring attention over zig-zag sequence shards, with a hand-written backward.

Each rank holds the queries, keys and values of its two sequence chunks (see `zigzag`). Forward:
K/V blocks travel once round the ring; every rank attends its queries to each block as it passes
and merges the partial softmax results with the log-sum-exp rule, so no rank ever holds the full
sequence. Backward runs the ring again: K/V travel with their gradient accumulators, every rank adds
its queries' contribution, and after a full turn each block's dK/dV are back home, complete.
Only the local q, k, v, output and log-sum-exp are saved for backward (activation memory ~ 1/c).

Under a causal mask, a query chunk attends fully to earlier chunks, triangularly to its own, and
not at all to later ones; skipped pairs are never computed, which is where zig-zag balances work.
"""

from __future__ import annotations

import torch

from shardlab.strategies.context_parallel.comms import Ring
from shardlab.strategies.context_parallel.zigzag import ShardingError, chunk_ids

FULL, DIAGONAL = "full", "diagonal"


def chunk_relation(q_chunk: int, kv_chunk: int, causal: bool) -> str | None:
    """How a query chunk sees a key chunk: fully, through the causal triangle, or not at all (None)."""
    if not causal or kv_chunk < q_chunk:
        return FULL
    return DIAGONAL if kv_chunk == q_chunk else None


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, relation: str) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if relation == DIAGONAL:
        n = scores.shape[-1]
        future = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _visible_pairs(rank: int, kv_owner: int, cp_size: int, causal: bool):
    """(query half, key half, relation) for the chunk pairs this rank computes against `kv_owner`'s block."""
    for a, q_chunk in enumerate(chunk_ids(rank, cp_size)):
        for b, kv_chunk in enumerate(chunk_ids(kv_owner, cp_size)):
            relation = chunk_relation(q_chunk, kv_chunk, causal)
            if relation is not None:
                yield a, b, relation


class RingAttention(torch.autograd.Function):
    """softmax(q kᵀ · scale + mask) v over the whole sequence; q, k, v are this rank's [B, H, S/c, D] shards."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring | None, causal: bool, scale: float):
        rank, size = (ring.rank, ring.size) if ring else (0, 1)
        dtype = q.dtype
        q, k, v = q.float().contiguous(), k.float().contiguous(), v.float().contiguous()
        q_halves = q.chunk(2, dim=2)
        out = [torch.zeros_like(h) for h in q_halves]
        lse = [torch.full(h.shape[:-1], float("-inf"), device=q.device) for h in q_halves]
        kv, owner = [k, v], rank
        for step in range(size):
            # Start moving the block on before computing with it: the transfer overlaps the maths.
            pending = ring.start_shift(kv) if step < size - 1 else None
            k_halves, v_halves = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for a, b, relation in _visible_pairs(rank, owner, size, causal):
                scores = _scores(q_halves[a], k_halves[b], scale, relation)
                block_lse = scores.logsumexp(dim=-1)
                block_out = torch.matmul(torch.exp(scores - block_lse.unsqueeze(-1)), v_halves[b])
                merged = torch.logaddexp(lse[a], block_lse)  # log-sum-exp rule: rescale both partial results
                out[a] = out[a] * torch.exp(lse[a] - merged).unsqueeze(-1) + block_out * torch.exp(block_lse - merged).unsqueeze(-1)
                lse[a] = merged
            if pending is not None:
                kv, owner = pending.wait(), (owner - 1) % size
        out, lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.dtype = ring, causal, scale, dtype
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        rank, size = (ring.rank, ring.size) if ring else (0, 1)
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(dim=-1)  # rowsum(dO ∘ O): the softmax Jacobian's correction term
        dq = torch.zeros_like(q)
        q_h, do_h, delta_h, lse_h, dq_h = (t.chunk(2, dim=2) for t in (q, grad_out, delta, lse, dq))
        kv, dkv, owner = [k, v], [torch.zeros_like(k), torch.zeros_like(v)], rank
        for step in range(size):
            k_h, v_h = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            dk_h, dv_h = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)
            for a, b, relation in _visible_pairs(rank, owner, size, causal):
                probs = torch.exp(_scores(q_h[a], k_h[b], scale, relation) - lse_h[a].unsqueeze(-1))
                dv_h[b].add_(torch.matmul(probs.transpose(-1, -2), do_h[a]))
                dscores = probs * (torch.matmul(do_h[a], v_h[b].transpose(-1, -2)) - delta_h[a].unsqueeze(-1))
                dq_h[a].add_(torch.matmul(dscores, k_h[b]) * scale)
                dk_h[b].add_(torch.matmul(dscores.transpose(-1, -2), q_h[a]) * scale)
            if size == 1:
                break
            if step < size - 1:  # pass the block on with its gradient accumulators
                received = ring.start_shift([*kv, *dkv]).wait()
                kv, dkv, owner = received[:2], received[2:], (owner - 1) % size
            else:  # last hop: only the finished dK/dV travel, back to the block's owner
                dkv = ring.start_shift(dkv).wait()
        dtype = ctx.dtype
        return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype), None, None, None


def ring_attention(q, k, v, ring: Ring | None, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's query shard over the whole (ring-distributed) sequence; [B, H, S/c, D]."""
    size = ring.size if ring else 1
    local = q.shape[2]
    if local % 2 or k.shape[2] != local or v.shape[2] != local:
        raise ShardingError(
            f"ring attention needs equal q/k/v shards of an even length (two zig-zag chunks), got "
            f"q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]} tokens with context-parallel size {size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, ring, causal, scale)
