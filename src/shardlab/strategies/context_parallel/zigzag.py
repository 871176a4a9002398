"""Zig-zag (load-balanced) sequence sharding for causal context parallelism.

The sequence is cut into 2·c equal chunks; rank r holds chunks r and 2c-1-r. Under a causal
mask a query chunk i attends to chunks 0..i, so a plain contiguous split gives the last rank c
times the work of the first; pairing an early chunk with a late one gives every rank 2c+1 chunk
pairs of work.
"""

from __future__ import annotations

import torch


class ShardingError(ValueError):
    """The sequence cannot be sharded this way (the message says why and what would work)."""


def check_shardable(seq_len: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ShardingError(f"context-parallel size must be >= 1, got {cp_size}")
    if seq_len % (2 * cp_size):
        raise ShardingError(
            f"sequence length {seq_len} is not divisible by 2 x context-parallel size = {2 * cp_size} "
            f"(zig-zag sharding gives each rank two equal chunks); use a multiple of {2 * cp_size}")


def chunk_ids(rank: int, cp_size: int) -> tuple[int, int]:
    """The two sequence chunks rank `rank` holds."""
    return rank, 2 * cp_size - 1 - rank


def shard(x: torch.Tensor, rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's zig-zag shard of `x` along `dim` (the sequence dimension)."""
    check_shardable(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def positions(seq_len: int, rank: int, cp_size: int) -> torch.Tensor:
    """Global token positions of this rank's shard (the model's position ids for RoPE)."""
    return shard(torch.arange(seq_len).unsqueeze(0), rank, cp_size).squeeze(0)


def unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard`: rebuild the full sequence from every rank's shard (in rank order)."""
    cp_size = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, piece in enumerate(shards):
        first, second = chunk_ids(rank, cp_size)
        chunks[first], chunks[second] = piece.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
