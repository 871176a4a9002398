"""Context parallelism: zig-zag sharding, ring attention vs full attention (2-rank torchrun), config
checks, and `cp_ring` (2 ranks) against the single-device reference under real torchrun."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import TEST_EXPERIMENT, TEST_TOKENS_PER_STEP, assert_losses_match, assert_within
from shardlab.config import deep_merge
from shardlab.errors import ConfigError
from shardlab.tables.parity import tolerance
from shardlab.strategies.context_parallel import zigzag
from shardlab.strategies import get_spec
from shardlab.strategies.context_parallel.ring_attention import _visible_pairs

HERE = Path(__file__).parent


def test_zigzag_round_trip_and_positions():
    x = torch.arange(2 * 24).view(2, 24)
    shards = [zigzag.shard(x, r, 3) for r in range(3)]
    assert torch.equal(zigzag.unshard(shards), x)
    assert zigzag.positions(24, 0, 3).tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    with pytest.raises(zigzag.ShardingError, match="not divisible by 2 x context-parallel size = 6"):
        zigzag.shard(x[:, :21], 0, 3)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_zigzag_balances_causal_work(cp_size):
    """Every rank computes the same number of chunk pairs (2c+1) over a full ring turn."""
    work = [sum(1 for owner in range(cp_size) for _ in _visible_pairs(r, owner, cp_size, causal=True))
            for r in range(cp_size)]
    assert work == [2 * cp_size + 1] * cp_size


@pytest.mark.parity
@pytest.mark.torchrun
def test_ring_attention_matches_full_attention(tmp_path):
    """Outputs and dq/dk/dv shards vs plain softmax attention, causal and not, chunk sizes 1, 3, 5."""
    out = tmp_path / "ring.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(HERE / "workers" / "ring_attention.py"), str(out)], check=True, timeout=300)
    results = json.loads(out.read_text())
    assert results["cp_size"] == 2
    assert {(c["seq_len"], c["causal"]) for c in results["cases"]} == {(n, m) for n in (4, 12, 20) for m in (True, False)}
    for case in results["cases"]:  # one forward and backward; the longest sums run over the sequence
        assert_within(f"attention: s={case['seq_len']} causal={case['causal']}", case["max_abs_error"],
                      tolerance(case["scale"], case["seq_len"]))
    assert [r["seq_len"] for r in results["rejected"]] == [5, 6]
    for rejected in results["rejected"]:
        assert rejected["error"] and "not divisible by 2 x context-parallel size = 4" in rejected["error"]


def test_config_check_rejects_unshardable_sequence_length():
    exp = deep_merge(TEST_EXPERIMENT, {"strategies": ["cp_ring"]})
    get_spec("cp_ring").check(exp, "experiments.t", 2)  # 32 = 8 chunks of 4: fine
    exp["training"]["seq_len"] = 30
    with pytest.raises(ConfigError, match=r"experiments\.t\.launch\.world_size.*sequence 30 is not divisible by 2 x cp = 4"):
        get_spec("cp_ring").check(exp, "experiments.t", 2)


@pytest.mark.parity
@pytest.mark.torchrun
def test_cp_ring_matches_single_device_and_halves_activations(run_once):
    reference, ref_steps = run_once("single")
    summary, steps = run_once("cp_ring")
    assert reference["status"] == "ok", reference["reason"]
    assert summary["status"] == "ok", summary["reason"]
    assert summary["world_size"] == 2
    assert_losses_match([s["loss"] for s in steps], [s["loss"] for s in ref_steps])
    # Validation runs through the ring too.
    assert_within("validation loss", abs(summary["final_val_loss"] - reference["final_val_loss"]),
                  tolerance(reference["final_val_loss"], TEST_TOKENS_PER_STEP, steps=len(ref_steps)))

    single_act = reference["ranks"][0]["activation_bytes"]
    for rank in summary["ranks"]:
        assert rank["local_seq_len"] == 16
        assert rank["param_bytes"] == reference["ranks"][0]["param_bytes"]  # parameters replicated
        # Every saved activation is per local token: c = 2 should halve them (small fixed extras allowed).
        assert 0.45 <= rank["activation_bytes"] / single_act <= 0.55, (rank["activation_bytes"], single_act)
