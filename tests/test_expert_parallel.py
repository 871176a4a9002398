"""Mixture of experts: the layer against a per-token loop, the capacity rule, config checks, and
expert parallelism (`ep_moe`, 2 ranks) against the unsharded MoE reference (`moe_single`) under torchrun."""

import dataclasses

import pytest
import torch

from helpers import MOE_OVERRIDES, TEST_EXPERIMENT, assert_losses_match
from shardlab.config import deep_merge
from shardlab.errors import ConfigError
from shardlab.tables import TableInputs
from shardlab.tables.context_expert import build
from shardlab.strategies.expert_parallel.moe import MoEConfig, MoEMLP, capacity_plan, expert_capacity
from shardlab.strategies import get_spec
from shardlab.strategies.expert_parallel.options import MOE_DEFAULTS


def _model_config():
    from shardlab.core.model import tiny_neox_config

    return tiny_neox_config(TEST_EXPERIMENT["model"])


def _per_token_reference(layer: MoEMLP, x: torch.Tensor, capacity: int) -> torch.Tensor:
    """The MoE written the slow, obvious way: visit assignments slot by slot, token by token."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = layer.router(tokens).softmax(-1)
    top_p, top_e = probs.topk(layer.cfg.top_k, dim=-1)
    weights = top_p / top_p.sum(-1, keepdim=True)
    used = [0] * layer.cfg.num_experts
    out = torch.zeros_like(tokens)
    for slot in range(layer.cfg.top_k):
        for t in range(tokens.shape[0]):
            e = int(top_e[t, slot])
            if used[e] < capacity:
                used[e] += 1
                out[t] += weights[t, slot] * layer.experts[e](tokens[t])
    return out.view(x.shape)


@pytest.mark.parametrize("capacity_factor", [8.0, 0.5])
def test_moe_layer_matches_per_token_loop(capacity_factor):
    """Routing, capacity (first choices before second choices, then batch order) and mixing."""
    cfg = MoEConfig(num_experts=4, top_k=2, capacity_factor=capacity_factor, seed=3)
    layer = MoEMLP(_model_config(), cfg, layer=0)
    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(0))
    capacity = expert_capacity(capacity_factor, 30, 2, 4)
    with torch.no_grad():
        expected = _per_token_reference(layer, x, capacity)
        got = layer(x)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    if capacity_factor < 1:  # the small capacity must actually drop something for this case to mean anything
        with torch.enable_grad():
            layer(x)
        assert int((layer.routed - layer.kept).sum()) > 0


def test_capacity_plan_queues_slots_then_ranks():
    # 2 ranks, top-2, 2 experts; counts[rank, slot, expert]
    counts = torch.tensor([[[3, 1], [1, 3]], [[2, 2], [2, 2]]])
    offsets, kept = capacity_plan(counts, capacity=4)
    # Expert 0 queue: rank0 slot0 (3), rank1 slot0 (2) -> only 1 of rank1's fits; slot-1 choices all dropped.
    assert kept[:, :, 0].tolist() == [[3, 0], [1, 0]]
    assert offsets[1, 1, 0] == 6  # all 5 first choices and rank 0's second choice queue before it
    # Expert 1 queue: slot0 rank0 (1), rank1 (2), slot1 rank0 (3 -> 1 fits), rank1 (0 fit)
    assert kept[:, :, 1].tolist() == [[1, 1], [2, 0]]


def test_options_defaults_match_the_model_config():
    defaults = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    assert {k: v for k, v in MOE_DEFAULTS.items() if k != "seed"} == {k: v for k, v in defaults.items() if k != "seed"}


def _exp(**options):
    return deep_merge(TEST_EXPERIMENT, {"strategies": ["moe_single", "ep_moe"], "strategy_options": options})


def test_config_checks_reject_bad_moe_settings():
    get_spec("ep_moe").check(_exp(ep_moe={"num_experts": 4}, moe_single={"num_experts": 4}), "experiments.t", 2)
    with pytest.raises(ConfigError, match="ep: 3 experts are not divisible by ep=2"):
        get_spec("ep_moe").check(_exp(ep_moe={"num_experts": 3}, moe_single={"num_experts": 3}), "experiments.t", 2)
    with pytest.raises(ConfigError, match="top_k"):
        get_spec("ep_moe").check(_exp(ep_moe={"top_k": 5}), "experiments.t", 2)
    with pytest.raises(ConfigError, match="must be the same model"):
        get_spec("ep_moe").check(_exp(ep_moe={"capacity_factor": 2.0}), "experiments.t", 2)


@pytest.mark.parity
@pytest.mark.torchrun
def test_ep_moe_matches_unsharded_moe(run_once):
    """Same MoE model, same seed, same global batch: 1 process vs experts split over 2 ranks.

    Capacity factor 1.0 so that tokens are dropped, and the drops must agree too."""
    reference, ref_steps = run_once("moe_single", MOE_OVERRIDES)
    sharded, steps = run_once("ep_moe", MOE_OVERRIDES)
    assert reference["status"] == "ok", reference["reason"]
    assert sharded["status"] == "ok", sharded["reason"]
    assert sharded["world_size"] == 2
    # fp32, SGD: sums over tokens in a different order only.
    assert_losses_match([s["loss"] for s in steps], [s["loss"] for s in ref_steps])

    ref_rank, ranks = reference["ranks"][0], sharded["ranks"]
    assert ref_rank["dropped_assignments"] > 0
    for rank in ranks:  # routing and drops are decided globally: identical counts on every rank
        assert rank["expert_routed"] == ref_rank["expert_routed"]
        assert rank["expert_kept"] == ref_rank["expert_kept"]
        assert rank["tokens_fully_dropped"] == ref_rank["tokens_fully_dropped"]
        # Each rank holds half of the experts, and everything else in full.
        assert rank["expert_param_bytes"] * 2 == ref_rank["expert_param_bytes"]
        assert ref_rank["param_bytes"] - rank["param_bytes"] == ref_rank["expert_param_bytes"] // 2
    assert [r["moe"]["first_expert"] for r in ranks] == [0, 2]
    assert sharded["comm_time_median_s"] > 0


def test_context_expert_tables_from_summaries():
    """The report's tables: per-rank CP memory with the experiment's sequence length, per-expert load."""
    settings = {"training": {"seq_len": 128, "global_batch_size": 8}}
    summaries = [
        {"experiment": "cp", "strategy": "single", "status": "ok", "tokens_per_s": 10.0,
         "ranks": [{"rank": 0, "activation_bytes": 100}]},
        {"experiment": "cp", "strategy": "cp_ring", "status": "ok", "tokens_per_s": 8.0, "ranks": [
            {"rank": 0, "activation_bytes": 50, "cp_size": 2}, {"rank": 1, "activation_bytes": 51, "cp_size": 2}]},
        {"experiment": "moe", "strategy": "ep_moe", "status": "ok", "world_size": 2, "ranks": [
            {"rank": r, "expert_routed": [[6, 2]], "expert_kept": [[4, 2]]} for r in (0, 1)]},
        {"experiment": "moe", "strategy": "moe_single", "status": "failed", "ranks": []},
    ]
    tables = build(TableInputs(summaries=summaries, experiments={"cp": dict(settings, name="cp"),
                                                                 "moe": dict(settings, name="moe")}))
    cp = tables["cp_memory"]
    assert cp[["strategy", "cp_size", "seq_len", "activation_bytes"]].values.tolist() == [
        ["single", 1, 128, 100], ["cp_ring", 2, 128, 50], ["cp_ring", 2, 128, 51]]
    load = tables["expert_load"]
    assert load[["expert", "routed", "kept", "dropped", "routed_share"]].values.tolist() == [[0, 6, 4, 2, 0.75], [1, 2, 2, 0, 0.25]]
    assert load[["processed_share", "dropped_share"]].values.tolist() == [[0.5, 0.25], [0.25, 0.0]]
