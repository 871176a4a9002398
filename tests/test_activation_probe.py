"""The activation probe (shardlab.runner.probes.ActivationProbe): tensors saved for backward, parameters
left out in every form a strategy gives them. Data parallelism only changes where model states live,
so for the same per-rank batch every DP-family strategy must save exactly the same activations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardlab.runner.probes import ActivationProbe

# DP-family strategies measured under torchrun. ZeRO-3 gathers each weight into a fresh storage for its
# module's forward and frees it after; fsdp2_full all-gathers into unsharded parameters per block.
DP_FAMILY = ["ddp", "zero1", "zero3", "fsdp2_full"]
TEST_MLP = (4, 32, 256)  # per-rank batch x seq_len x intermediate_size of TEST_EXPERIMENT on 2 ranks


def probed(module: nn.Module, x: torch.Tensor) -> ActivationProbe:
    with ActivationProbe(module) as probe:
        module(x)
    return probe


def mlp(seed: int = 0, layers: int = 6) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.GELU())])


def test_probe_counts_what_autograd_saves_and_no_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    probe = probed(model, torch.randn(4, 8))
    # The input (4x8) saved by the first Linear, the ReLU output (4x16) saved by ReLU and reused by the
    # second Linear (one storage); the weights, saved as transposed views, are not activations.
    assert probe.bytes_by_module() == {"0": 4 * 8 * 4, "1": 4 * 16 * 4}


class _GatherLinear(torch.autograd.Function):
    """DeepSpeed ZeRO-3's linear: saves the Parameter object itself, whose `.data` is swapped later."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return x @ weight.t() + bias


def _gather(module, args):
    for p in module.parameters():
        p.data = p.full.clone()  # the all-gather output: a fresh storage


def _release(module, args, output):
    for p in module.parameters():
        p.data = torch.empty(0)  # the gathered storage is freed once nothing else holds it


def zero3_like(model: nn.Sequential) -> nn.Sequential:
    """At rest each weight is an empty placeholder plus a partition (`ds_tensor`); a pre-forward hook
    gathers it into a fresh storage and a post-forward hook frees it, as ZeRO-3 does."""
    for linear in model:
        if isinstance(linear, nn.Linear):
            for p in linear.parameters():
                p.full, p.ds_tensor, p.ds_id = p.data.clone(), p.data.flatten()[: p.numel() // 2].clone(), id(p)
                p.data = torch.empty(0)
            linear.register_forward_pre_hook(_gather)
            linear.register_forward_hook(_release)
            linear.forward = (lambda m: lambda x: _GatherLinear.apply(x, m.weight, m.bias))(linear)
    return model


def test_zero3_gathered_weights_are_not_activations_and_freed_placeholders_do_not_hide_any():
    x = torch.randn(4, 8, 16)
    plain = probed(mlp(), x)
    zero3 = probed(zero3_like(mlp()), x)
    assert zero3.bytes_by_module() == plain.bytes_by_module()
    assert zero3.total_bytes == plain.total_bytes == 12 * x.numel() * 4  # each Linear and GELU saves its input


class _ShardedLinear(nn.Linear):
    """FSDP2-like: at rest `weight` is a shard; a pre-forward hook swaps in a new unsharded Parameter and
    a post-forward hook swaps the shard back. Forward saves a transposed view, not the Parameter."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features)
        self.unsharded = linear.weight.detach().clone()
        self.weight = nn.Parameter(self.unsharded[: self.out_features // 2].clone())
        self.bias = linear.bias
        self.register_forward_pre_hook(_ShardedLinear._unshard)
        self.register_forward_hook(_ShardedLinear._reshard)

    def _unshard(self, args):
        self.sharded, self.weight = self.weight, nn.Parameter(self.unsharded.clone())  # all-gather output

    def _reshard(self, args, output):
        self.weight = self.sharded

    def forward(self, x):
        return torch.mm(x.flatten(0, -2), self.weight.t()).view(*x.shape[:-1], -1) + self.bias


def test_unsharded_view_of_a_swapped_in_parameter_is_excluded():
    x = torch.randn(4, 8, 16)
    plain = probed(mlp(), x)
    model = mlp()
    sharded = nn.Sequential(*[_ShardedLinear(m) if isinstance(m, nn.Linear) else m for m in model])
    # Our Linear saves the flattened input (same storage as x's view) instead of x: same bytes.
    assert probed(sharded, x).bytes_by_module() == plain.bytes_by_module()


def test_a_freed_parameter_storage_key_is_never_taken_by_a_new_tensor():
    from shardlab.runner.probes import parameter_storages

    p = nn.Parameter(torch.randn(256))
    keys = parameter_storages([p])
    p.data = torch.randn(256)  # the old storage is freed (as ZeRO-3 releases a gathered weight)
    new = [torch.randn(256) for _ in range(200)]  # without a pin, the allocator soon reuses the address
    assert not keys.keys() & {t.untyped_storage()._cdata for t in new}


@pytest.fixture(scope="module")
def dp_family_runs(run_once):
    """Per-rank records of each DP-family run: the healthy runs other tests share (the probe measures step 0)."""
    runs = {}
    for strategy in DP_FAMILY:
        summary, _ = run_once(strategy)
        assert summary["status"] == "ok", (strategy, summary.get("reason"))
        runs[strategy] = summary["ranks"]
    return runs


@pytest.mark.torchrun
def test_dp_family_saves_the_same_activations_per_rank(dp_family_runs):
    """ddp is the reference: replicated weights, nothing gathered. ZeRO-1/3 and FSDP2 must match it on
    every rank, in total and per module (a gathered weight counted, or an activation dropped because
    it reused a freed parameter storage's address, shows as a difference)."""
    reference = dp_family_runs["ddp"][0]
    b, s, h = TEST_MLP
    assert reference["activation_by_module"]["gpt_neox.layers.0.mlp.act"] == b * s * h * 4  # fp32 GELU input
    measured = {(strategy, rank["rank"]): (rank["activation_bytes"], rank["activation_by_module"])
                for strategy, ranks in dp_family_runs.items() for rank in ranks}
    assert len(measured) == 2 * len(DP_FAMILY)
    expected = (reference["activation_bytes"], reference["activation_by_module"])
    assert {key: value for key, value in measured.items() if value != expected} == {}
