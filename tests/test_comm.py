"""Communication analysis: bus-bandwidth conventions, the alpha-beta fit, per-strategy volumes
against hand counts, the share/what-if model, and the benchmark under real torchrun."""

import math

import numpy as np
import pandas as pd
import pytest

from conftest import TEST_EXPERIMENT
from shardlab.costs.alpha_beta import AlphaBeta, fit_alpha_beta, fit_table, models_from_table
from shardlab.costs.collectives import COLLECTIVES, bus_factor, busbw
from shardlab.costs.comm_volume import ModelShape, StepShape, bytes_per_rank, comm_plan
from shardlab.tables.communication import LINKS, MEASURED_LINK, projection_table, share_table, whatif_table
from shardlab.errors import ConfigError

# --- bus bandwidth (nccl-tests PERFORMANCE.md) --------------------------------------------------


@pytest.mark.parametrize("collective, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75),
    ("all_gather", 2, 0.5), ("reduce_scatter", 4, 0.75), ("all_to_all", 8, 0.875),
    ("broadcast", 8, 1.0), ("sendrecv", 2, 1.0),
])
def test_bus_factor_hand_cases(collective, n, factor):
    assert bus_factor(collective, n) == pytest.approx(factor)


def test_busbw_from_time_and_size():
    # 1 GB all-reduced over 4 ranks in 0.5 s: algbw 2 GB/s, each link carries 2*(3/4) of it.
    assert busbw("all_reduce", 1e9, 0.5, 4) == pytest.approx(3e9)
    assert busbw("all_gather", 1e9, 0.5, 4) == pytest.approx(1.5e9)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("all_reduce_fancy", 2)


# --- alpha-beta fit -----------------------------------------------------------------------------
SIZES = np.array([2.0**k for k in range(10, 27, 2)])  # 1 KiB .. 64 MiB


def test_fit_recovers_known_parameters_from_noisy_timings():
    alpha, beta = 40e-6, 3e9
    rng = np.random.default_rng(0)
    times = (alpha + SIZES / beta) * (1 + rng.uniform(-0.03, 0.03, len(SIZES)))  # +-3 % timing noise
    model, quality = fit_alpha_beta(SIZES, times)
    assert model.alpha_s == pytest.approx(alpha, rel=0.05)
    assert model.beta_Bps == pytest.approx(beta, rel=0.05)
    assert quality.rel_err_max < 0.06 and quality.r2 > 0.99


def test_fit_is_exact_on_exact_timings_and_flags_a_bad_model():
    model, quality = fit_alpha_beta(SIZES, 1e-5 + SIZES / 1e10)
    assert model.alpha_s == pytest.approx(1e-5, rel=1e-9) and model.beta_Bps == pytest.approx(1e10, rel=1e-9)
    assert quality.rel_err_max < 1e-9
    # Times quadratic in size are not alpha-beta: the quality columns must say so.
    _, bad = fit_alpha_beta(SIZES, 1e-5 + (SIZES / 1e6) ** 2)
    assert bad.rel_err_max > 0.5


def test_fit_table_fits_bus_bytes_per_collective():
    """beta is BUS bandwidth: an all-gather over 4 ranks moving 3/4 of each size at 2 GB/s."""
    world, alpha, beta = 4, 20e-6, 2e9
    rows = [{"collective": c, "size_bytes": s, "world_size": world, "backend": "gloo", "device": "cpu",
             "device_name": "cpu", "time_s": alpha + s * bus_factor(c, world) / beta, "status": "ok"}
            for c in ("all_gather", "all_reduce") for s in SIZES]
    rows.append({"collective": "broadcast", "world_size": world, "status": "failed: boom"})
    fits = fit_table(pd.DataFrame(rows))
    models = models_from_table(fits)
    assert set(models) == {"all_gather", "all_reduce"}
    for model in models.values():
        assert model.alpha_s == pytest.approx(alpha, rel=1e-6) and model.beta_Bps == pytest.approx(beta, rel=1e-6)
    assert fits.set_index("collective").loc["broadcast", "status"] == "failed: boom"


# --- volumes against hand counts (the conftest tiny model: h=64, 2 layers, i=256, V=256) --------------
TINY = ModelShape.from_dict(TEST_EXPERIMENT["model"])
STEP = StepShape.from_training(TEST_EXPERIMENT["training"])  # batch 8 x 32 tokens, fp32
# Hand count. Per layer: 2 LayerNorms 4*64; QKV 64*192+192; dense 64*64+64; MLP 64*256+256 and 256*64+64.
LAYER = 4 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
PARAMS = 256 * 64 + 2 * LAYER + 2 * 64 + 64 * 256  # embedding, layers, final LayerNorm, untied head


def test_parameter_count_matches_hand_count_and_the_real_model():
    from transformers import GPTNeoXForCausalLM

    from shardlab.core.model import tiny_neox_config

    assert LAYER == 49_984 and PARAMS == 132_864
    assert TINY.parameters() == PARAMS
    real = GPTNeoXForCausalLM(tiny_neox_config(TEST_EXPERIMENT["model"]))
    assert sum(p.numel() for p in real.parameters()) == PARAMS


def test_data_parallel_volume_is_one_gradient_all_reduce():
    for strategy in ("dp_naive", "dp_interleaved", "ddp", "zero0"):
        (call,) = comm_plan(strategy, TINY, STEP, world=2)
        assert (call.collective, call.size_bytes, call.count) == ("all_reduce", PARAMS * 4, 1)
    # Ring all-reduce: each rank's link carries 2(n-1)/n of the gradient bytes.
    assert bytes_per_rank(comm_plan("ddp", TINY, STEP, 2)) == PARAMS * 4
    assert bytes_per_rank(comm_plan("ddp", TINY, STEP, 4)) == PARAMS * 4 * 1.5
    assert comm_plan("single", TINY, STEP, 1) == [] and bytes_per_rank([]) == 0


def test_zero_volumes_relative_to_dp():
    dp = bytes_per_rank(comm_plan("dp_naive", TINY, STEP, 4))
    for strategy in ("zero1", "zero2", "fsdp2_grad_op"):
        assert bytes_per_rank(comm_plan(strategy, TINY, STEP, 4)) == pytest.approx(dp)  # RS + AG = AR
    for strategy in ("zero3", "fsdp2_full"):
        assert bytes_per_rank(comm_plan(strategy, TINY, STEP, 4)) == pytest.approx(1.5 * dp)


def test_tensor_parallel_volume_per_layer():
    """Two all-reduces forward and two backward per layer, each of b*s*h fp32 elements."""
    plan = comm_plan("tp", TINY, STEP, world=2)
    message = 8 * 32 * 64 * 4
    assert {c.collective for c in plan} == {"all_reduce"} and {c.size_bytes for c in plan} == {message}
    assert sum(c.count for c in plan) == 4 * 2  # 4 per layer, 2 layers
    assert bytes_per_rank(plan) == 8 * message  # factor 2(n-1)/n = 1 on 2 ranks
    # SP: all-gather + reduce-scatter in place of each all-reduce, the same bus bytes.
    assert bytes_per_rank(comm_plan("tp_sp", TINY, STEP, 2)) == bytes_per_rank(plan)
    assert bytes_per_rank(comm_plan("tp_sp_dtensor", TINY, STEP, 4)) == bytes_per_rank(comm_plan("tp_dtensor", TINY, STEP, 4))
    # bf16 autocast halves activation traffic.
    bf16 = StepShape(8, 32, None, 2)
    assert bytes_per_rank(comm_plan("tp", TINY, bf16, 2)) == bytes_per_rank(plan) / 2


def test_pipeline_context_expert_and_hybrid_volumes():
    # PP, 2 stages, 4 micro-batches of 2 rows: each rank sends or receives 4 activations and 4 gradients of 2*32*64*4.
    pp = comm_plan("pp_1f1b", TINY, STEP, 2, {"n_microbatches": 4})
    assert bytes_per_rank(pp) == 8 * (2 * 32 * 64 * 4)
    # Ring attention on 2 ranks: per layer one K/V hop forward, two backward, of 2*8*16*64*4 bytes; plus DP.
    cp = comm_plan("cp_ring", TINY, STEP, 2)
    assert bytes_per_rank(cp) == 2 * 3 * (2 * 8 * 16 * 64 * 4) + PARAMS * 4
    # EP, top-1, 2 ranks: per layer 4 all-to-alls of the local 4*32*64*4 bytes (half crosses), dense grads all-reduced.
    ep = comm_plan("ep_moe", TINY, STEP, 2)
    dense = PARAMS - 2 * ((64 * 256 + 256) + (256 * 64 + 64))
    assert bytes_per_rank(ep) == 2 * 4 * (4 * 32 * 64 * 4) * 0.5 + dense * 4
    # Hybrid FSDP(dp=2) x TP(tp=2): ZeRO-3 volume of half the parameters plus TP on a half batch.
    hyb = comm_plan("hybrid", TINY, STEP, 4, {"dp": 2, "tp": 2})
    assert bytes_per_rank(hyb) == pytest.approx(1.5 * PARAMS * 4 / 2 + 8 * (4 * 32 * 64 * 4))


def test_unknown_strategy_gives_no_plan():
    assert comm_plan("warp_drive", TINY, STEP, 2) is None
    assert bytes_per_rank(None) is None


# --- share and what-if ---------------------------------------------------------------------------


def _tables():
    exp = dict(TEST_EXPERIMENT, name="e")
    runs = pd.DataFrame([
        {"experiment": "e", "strategy": "single", "status": "ok", "world_size": 1, "step_time_median_s": 0.05},
        {"experiment": "e", "strategy": "dp_naive", "status": "ok", "world_size": 2, "step_time_median_s": 0.10,
         "comm_time_median_s": 0.04},
        {"experiment": "e", "strategy": "ddp", "status": "ok", "world_size": 2, "step_time_median_s": 0.08,
         "comm_time_median_s": math.nan},
        {"experiment": "e", "strategy": "warp_drive", "status": "ok", "world_size": 2, "step_time_median_s": 0.2,
         "comm_time_median_s": math.nan},
        {"experiment": "e", "strategy": "tp", "status": "oom", "world_size": 2},
    ])
    fits = pd.DataFrame([{"collective": c, "alpha_s": 1e-4, "beta_GBps": 0.1, "status": "ok"} for c in COLLECTIVES])
    return runs, {"e": exp}, fits


def test_share_uses_measured_time_where_recorded_and_predicts_elsewhere(tmp_path):
    runs, experiments, fits = _tables()
    share = share_table(runs, experiments, fits, tmp_path).set_index("strategy")
    assert list(share.index) == ["single", "dp_naive", "ddp", "warp_drive"]  # the OOM run has no step time
    predicted = 1e-4 + PARAMS * 4 / 0.1e9
    assert share.loc["dp_naive", "comm_source"].startswith("measured")
    assert share.loc["dp_naive", "comm_share"] == pytest.approx(0.4)
    assert share.loc["dp_naive", "comm_predicted_s"] == pytest.approx(predicted)
    assert share.loc["ddp", "comm_source"].startswith("predicted")
    assert share.loc["ddp", "comm_share"] == pytest.approx(predicted / 0.08)
    assert share.loc["single", "comm_source"].startswith("none") and share.loc["single", "comm_share"] == 0
    assert share.loc["warp_drive", "comm_source"] == "unknown" and pd.isna(share.loc["warp_drive", "comm_share"])


def test_whatif_faster_links_and_overlap_never_slow_a_step(tmp_path):
    runs, experiments, fits = _tables()
    share = share_table(runs, experiments, fits, tmp_path)
    whatif = whatif_table(share, experiments, fits, tmp_path)
    assert set(whatif["strategy"]) == {"single", "dp_naive", "ddp"}
    assert (whatif[whatif.strategy == "single"]["predicted_step_s"] == 0.05).all()  # no communication to swap
    assert set(whatif["link"]) == {MEASURED_LINK, *(link.name for link in LINKS)}
    for (_, overlap), group in whatif[whatif["link"] != MEASURED_LINK].groupby(["strategy", "overlap"]):
        steps = group.sort_values("bandwidth_GBps")["predicted_step_s"].to_numpy()
        assert np.all(np.diff(steps) <= 0)
    pivot = whatif.pivot_table(index=["strategy", "link"], columns="overlap", values="predicted_step_s")
    assert np.all(pivot["perfect"] <= pivot["none"])
    # On this machine's own fit with measured compute, no overlap reproduces dp_naive's measured step when the fit
    # predicts the measured communication: compute 0.06 s + the predicted 0.0054 s.
    naive = whatif[(whatif.strategy == "dp_naive") & (whatif.link == MEASURED_LINK) & (whatif.overlap == "none")]
    assert float(naive["predicted_step_s"].iloc[0]) == pytest.approx(0.06 + 1e-4 + PARAMS * 4 / 0.1e9)


def test_projection_at_the_study_scale():
    """Pythia-6.9B shape: ~6.86e9 parameters, so DDP all-reduces 2*(7/8)*4 bytes of each per step."""
    table = projection_table()
    ddp = table[(table.strategy == "ddp")].set_index("link")
    params = ddp["bytes_per_rank"].iloc[0] / (4 * 2 * 7 / 8)
    assert 6.8e9 < params < 6.9e9
    # 10 GbE: 1.75 * 27.4 GB at 1.25 GB/s is ~38 s of gradient traffic per step; NVLink 100x less.
    assert ddp.loc["10 Gb/s Ethernet", "comm_s"] == pytest.approx(ddp["bytes_per_rank"].iloc[0] / 1.25e9 + 30e-6)
    zero3 = table[table.strategy == "zero3"]["bytes_per_rank"].iloc[0]
    assert zero3 == pytest.approx(1.5 * ddp["bytes_per_rank"].iloc[0])
    assert table["comm_s"].notna().all()


def test_alpha_beta_predicts_nothing_on_one_rank():
    assert AlphaBeta(1e-3, 1e9).seconds_for("all_reduce", 1e6, 1) == 0.0


# --- the benchmark --------------------------------------------------------------------------------


def test_settings_defaults_come_from_the_schema_and_errors_name_the_field():
    from shardlab.bench.comm import message_sizes, resolve_settings

    settings = resolve_settings({"max_bytes": 4096})
    assert settings["min_bytes"] == 1024 and settings["repeats"] >= 1 and set(settings["collectives"]) == set(COLLECTIVES)
    assert message_sizes(1024, 64 * 2**20, 4) == [1024 * 4**k for k in range(9)]
    with pytest.raises(ConfigError, match="comm_bench.repeats"):
        resolve_settings({"repeats": 0})
    with pytest.raises(ConfigError, match="comm_bench.max_bytes"):
        resolve_settings({"min_bytes": 4096, "max_bytes": 1024})


@pytest.mark.torchrun
def test_benchmark_runs_under_torchrun_and_produces_the_tables(tmp_path):
    from shardlab.bench.comm import main

    bench_csv, fit_csv = tmp_path / "comm_bench.csv", tmp_path / "comm_fit.csv"
    settings = '{"max_bytes": 16384, "warmup": 1, "repeats": 3, "world_size": 2, "device": "cpu"}'
    assert main(["--settings", settings, "--bench-out", str(bench_csv), "--fit-out", str(fit_csv)]) == 0
    bench = pd.read_csv(bench_csv)
    assert (bench["status"] == "ok").all(), bench["status"].unique()
    assert sorted(bench["collective"].unique()) == sorted(COLLECTIVES)
    assert sorted(bench["size_bytes"].unique()) == [1024, 4096, 16384]
    assert (bench["world_size"] == 2).all() and (bench["time_s"] > 0).all()
    factors = bench["collective"].map(lambda c: bus_factor(c, 2))
    assert np.allclose(bench["algbw_GBps"], bench["size_bytes"] / bench["time_s"] / 1e9)
    assert np.allclose(bench["busbw_GBps"], bench["algbw_GBps"] * factors)
    fits = pd.read_csv(fit_csv)
    assert sorted(fits["collective"]) == sorted(COLLECTIVES) and (fits["status"] == "ok").all()
    assert (fits["alpha_s"] >= 0).all() and (fits["n_points"] == 3).all()


def test_a_failed_benchmark_is_recorded_not_raised(tmp_path, monkeypatch):
    """A crashed torchrun job leaves failure rows (with the reason) and failed fits; main still returns 0."""
    import subprocess

    from shardlab.bench import comm as bench

    def crashed(cmd, **kwargs):
        assert "torch.distributed.run" in cmd and "--nproc-per-node=2" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="RuntimeError: gloo exploded\n")

    monkeypatch.setattr(bench.subprocess, "run", crashed)
    bench_csv, fit_csv = tmp_path / "comm_bench.csv", tmp_path / "comm_fit.csv"
    assert bench.main(["--settings", "{}", "--bench-out", str(bench_csv), "--fit-out", str(fit_csv)]) == 0
    table, fits = pd.read_csv(bench_csv), pd.read_csv(fit_csv)
    assert len(table) == len(COLLECTIVES) and table["status"].str.contains("gloo exploded").all()
    assert fits["status"].str.startswith("failed").all()
