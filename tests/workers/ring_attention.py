"""Run under torchrun: ring attention vs full attention, outputs and gradients, on every rank.

`torchrun --nproc-per-node=N tests/workers/ring_attention.py OUT.json`: every rank builds the same
full q, k, v (same seed), runs plain softmax attention on the full sequence as the reference,
runs ring attention on its zig-zag shard, and compares its shard of the output and of dq, dk, dv.
Rank 0 writes the worst errors per case, and the error message for lengths that cannot be sharded.
"""

import json
import sys

import torch
import torch.distributed as dist

from shardlab.strategies.context_parallel import zigzag
from shardlab.strategies.context_parallel.ring_attention import ring_attention
from shardlab.strategies.context_parallel.comms import Ring


def full_attention(q, k, v, causal):
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def check(ring, seq_len, causal):
    gen = torch.Generator().manual_seed(seq_len)
    q, k, v, grad_out = (torch.randn(2, 3, seq_len, 8, generator=gen, dtype=torch.float64).float() for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = full_attention(*full, causal)
    reference.backward(grad_out)

    def mine(t):  # this rank's shard of a full [B, H, S, D] tensor
        return zigzag.shard(t.detach(), ring.rank, ring.size, dim=2)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, ring=ring, causal=causal)
    out.backward(mine(grad_out))
    errors = {"out": (out - mine(reference)).abs().max().item()}
    for name, t, ref in zip(("dq", "dk", "dv"), local, full):
        errors[name] = (t.grad - mine(ref.grad)).abs().max().item()
    worst = torch.tensor([max(errors.values()), max(t.abs().max().item() for t in (reference, *(f.grad for f in full)))])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"seq_len": seq_len, "causal": causal, "max_abs_error": worst[0].item(), "scale": worst[1].item(),
            "rank0_errors": errors}


def main(out_path):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ring = Ring()
    c = ring.size
    results = {"cp_size": c, "cases": [], "rejected": []}
    # Chunk sizes 1, 3 and 5 tokens: odd and uneven lengths the zig-zag design allows.
    for seq_len in (2 * c, 6 * c, 10 * c):
        for causal in (True, False):
            results["cases"].append(check(ring, seq_len, causal))
    for seq_len in (2 * c + 1, 2 * c + c):  # not multiples of 2c: must be refused with a clear message
        try:
            zigzag.shard(torch.zeros(1, seq_len), ring.rank, c)
            results["rejected"].append({"seq_len": seq_len, "error": None})
        except zigzag.ShardingError as err:
            results["rejected"].append({"seq_len": seq_len, "error": str(err)})
    if ring.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
