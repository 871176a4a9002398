"""Communication analysis: bus-bandwidth conventions, the alpha-beta fit, per-strategy volumes
against hand counts, the share/what-if model, and the benchmark under real torchrun."""

import json
import math
import re
import threading
import time

import numpy as np
import pandas as pd
import psutil
import pytest

from helpers import TEST_EXPERIMENT
from shardlab.costs.alpha_beta import AlphaBeta, fit_alpha_beta, fit_table, models_from_table
from shardlab.costs.collectives import COLLECTIVES, bus_factor, busbw
from shardlab.costs.comm_volume import bytes_per_rank
from shardlab.costs.network import LINKS, MEASURED_LINK
from shardlab.costs.plan import Workload
from shardlab.costs.predict import collectives
from shardlab.costs.shapes import ModelShape
from shardlab.errors import ConfigError
from shardlab.runner.process import run_processes
from shardlab.strategies import REGISTRY, get_spec
from shardlab.tables import TableInputs
from shardlab.tables.communication import build, projection_table

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


# --- volumes against hand counts (the tests' tiny model: h=64, 2 layers, i=256, V=256) --------------
TINY = ModelShape.from_dict(TEST_EXPERIMENT["model"])

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


def plan(strategy: str, world: int, options: dict | None = None, dtype: str = "fp32"):
    """The collectives of the strategy's Plan (batch 8 x 32 tokens), as the tables ask for them."""
    spec = get_spec(strategy)
    exp = {"training": dict(TEST_EXPERIMENT["training"], dtype=dtype), "strategy_options": {strategy: options or {}}}
    return collectives(spec.run_model(TINY, exp), spec.run_plan(exp, world), Workload.from_training(exp["training"]))


def test_data_parallel_volume_is_one_gradient_all_reduce():
    for strategy in ("dp_naive", "ddp", "zero0"):
        (call,) = plan(strategy, world=2)
        assert (call.collective, call.size_bytes, call.count) == ("all_reduce", PARAMS * 4, 1)
    # Interleaved DP: the same bytes in one all-reduce per layer group (more latency, same volume).
    buckets = plan("dp_interleaved", world=2)
    assert {c.collective for c in buckets} == {"all_reduce"} and sum(c.count for c in buckets) > 1
    assert bytes_per_rank(buckets) == bytes_per_rank(plan("dp_naive", 2))
    # Ring all-reduce: each rank's link carries 2(n-1)/n of the gradient bytes.
    assert bytes_per_rank(plan("ddp", 2)) == PARAMS * 4
    assert bytes_per_rank(plan("ddp", 4)) == PARAMS * 4 * 1.5
    assert plan("single", 1) == [] and bytes_per_rank([]) == 0


def test_zero_volumes_relative_to_dp():
    dp = bytes_per_rank(plan("dp_naive", 4))
    for strategy in ("zero1", "zero2", "zero2_offload", "fsdp2_grad_op"):
        assert bytes_per_rank(plan(strategy, 4)) == pytest.approx(dp)  # RS + AG = AR
    for strategy in ("zero3", "zero3_offload", "fsdp2_full"):
        assert bytes_per_rank(plan(strategy, 4)) == pytest.approx(1.5 * dp)


def test_tensor_parallel_volume_per_layer():
    """Two all-reduces forward and two backward per layer, each of b*s*h fp32 elements."""
    tp = plan("tp", world=2)
    message = 8 * 32 * 64 * 4
    assert {c.collective for c in tp} == {"all_reduce"} and {c.size_bytes for c in tp} == {message}
    assert sum(c.count for c in tp) == 4 * 2  # 4 per layer, 2 layers
    assert bytes_per_rank(tp) == 8 * message  # factor 2(n-1)/n = 1 on 2 ranks
    # SP: all-gather + reduce-scatter in place of each all-reduce, the same bus bytes.
    assert bytes_per_rank(plan("tp_sp", 2)) == bytes_per_rank(tp)
    assert bytes_per_rank(plan("tp_sp_dtensor", 4)) == bytes_per_rank(plan("tp_dtensor", 4))
    # bf16 autocast halves activation traffic.
    assert bytes_per_rank(plan("tp", 2, dtype="bf16")) == bytes_per_rank(tp) / 2


def test_pipeline_context_and_expert_volumes():
    # PP, 2 stages, 4 micro-batches of 2 rows: each rank sends or receives 4 activations and 4 gradients of 2*32*64*4.
    pp = plan("pp_1f1b", 2, {"n_microbatches": 4})
    assert bytes_per_rank(pp) == 8 * (2 * 32 * 64 * 4)
    # Ring attention on 2 ranks: per layer one K/V hop forward, two backward, of 2*8*16*64*4 bytes; plus DP.
    cp = plan("cp_ring", 2)
    assert bytes_per_rank(cp) == 2 * 3 * (2 * 8 * 16 * 64 * 4) + PARAMS * 4
    # EP on 2 ranks with the MoE default top_k = 2: each of the local 4*32 tokens goes to 2 experts, so
    # per layer 4 all-to-alls (dispatch + combine, forward + backward) of 4*32*64*4 * 2 bytes, half of which
    # crosses to the other rank; the dense (non-expert) gradients are all-reduced.
    ep = plan("ep_moe", 2)
    dense = PARAMS - 2 * ((64 * 256 + 256) + (256 * 64 + 64)) + 2 * 64 * 4  # no dense MLPs; the routers (h x 4 experts)
    assert bytes_per_rank(ep) == 2 * 4 * (4 * 32 * 64 * 4 * 2) * 0.5 + dense * 4
    assert bytes_per_rank(plan("ep_moe", 2, {"top_k": 1})) == 2 * 4 * (4 * 32 * 64 * 4) * 0.5 + dense * 4


def test_hybrid_data_pipeline_volume_by_hand():
    """dp=2 replicas of a 2-stage 1F1B pipeline on 4 ranks: each replica pipelines half the batch (4 rows)
    in 4 micro-batches of 1 row, so the busiest rank sends or receives 4 activations and 4 gradients of
    1*32*64*4 bytes; then each stage all-reduces its gradients over its dp peer (factor 1 on 2 ranks).
    The largest stage is the second: layer 1 + final LayerNorm + head (66,496 parameters vs 66,368)."""
    hybrid = plan("hybrid_dp_pp", 4, {"pp_size": 2, "n_microbatches": 4})
    largest_stage = LAYER + 2 * 64 + 64 * 256
    assert largest_stage == 66_496 and 256 * 64 + LAYER < largest_stage
    sends = [c for c in hybrid if c.collective == "sendrecv"]
    assert {c.size_bytes for c in sends} == {1 * 32 * 64 * 4} and sum(c.count for c in sends) == 8
    (reduce,) = [c for c in hybrid if c.collective == "all_reduce"]
    assert (reduce.size_bytes, reduce.group_size) == (largest_stage * 4, 2)
    assert bytes_per_rank(hybrid) == 8 * (32 * 64 * 4) + largest_stage * 4


def test_unknown_strategy_has_no_plan():
    with pytest.raises(KeyError, match="unknown strategy 'warp_drive'"):
        get_spec("warp_drive")
    assert bytes_per_rank(None) is None


# --- share and what-if (the table builder on synthetic runs) ---------------------------------------


def _inputs() -> TableInputs:
    """Experiment "e" (the tiny local model) and "hub" (a hub model with no record: its plans are unknown)."""
    hub = dict(TEST_EXPERIMENT, name="hub", model={"name": "no-record", "source": "hub"})
    runs = pd.DataFrame([
        {"experiment": "e", "strategy": "single", "status": "ok", "world_size": 1, "step_time_median_s": 0.05},
        {"experiment": "e", "strategy": "dp_naive", "status": "ok", "world_size": 2, "step_time_median_s": 0.10,
         "comm_time_median_s": 0.04},
        {"experiment": "e", "strategy": "ddp", "status": "ok", "world_size": 2, "step_time_median_s": 0.08,
         "comm_time_median_s": math.nan},
        {"experiment": "e", "strategy": "tp", "status": "oom", "world_size": 2},
        {"experiment": "hub", "strategy": "ddp", "status": "ok", "world_size": 2, "step_time_median_s": 0.2,
         "comm_time_median_s": math.nan},
    ])
    fits = pd.DataFrame([{"collective": c, "world_size": 2, "bus_factor": bus_factor(c, 2), "alpha_s": 1e-4,
                          "beta_GBps": 0.1, "min_bytes": 1024, "max_bytes": 2**20, "status": "ok"}
                         for c in COLLECTIVES])
    return TableInputs(experiments={"e": dict(TEST_EXPERIMENT, name="e"), "hub": hub},
                       tables={"runs": runs, "comm_fit": fits})


def test_share_uses_measured_time_where_recorded_and_predicts_elsewhere():
    share = build(_inputs())["comm_share"].set_index(["experiment", "strategy"])
    assert list(share.index) == [("e", "single"), ("e", "dp_naive"), ("e", "ddp"), ("hub", "ddp")]  # no OOM step time
    predicted = 1e-4 + PARAMS * 4 / 0.1e9
    naive, ddp = share.loc["e", "dp_naive"], share.loc["e", "ddp"]
    assert naive["comm_source"].startswith("measured") and naive["comm_share"] == pytest.approx(0.4)
    assert naive["comm_predicted_s"] == pytest.approx(predicted)
    assert naive["predicted_share"] == pytest.approx(predicted / 0.10)
    # DDP's communication: the idle prediction times the in-training factor, here dp_naive's measured/predicted
    factor = 0.04 / predicted
    assert ddp["comm_source"] == "predicted (alpha-beta, in-training factor)"
    assert ddp["comm_share"] == pytest.approx(predicted * factor / 0.08)
    assert ddp["predicted_share"] == pytest.approx(predicted / 0.08)
    assert naive["comm_whole"] and naive["model_rel_err"] == pytest.approx(predicted / 0.04 - 1)
    assert pd.isna(naive["training_ratio"])  # no other run to calibrate on: nothing held out
    single = share.loc["e", "single"]
    assert single["comm_source"].startswith("none") and single["comm_share"] == 0
    unknown = share.loc["hub", "ddp"]
    assert unknown["comm_source"] == "unknown" and pd.isna(unknown["comm_share"]) and pd.isna(unknown["bytes_per_rank"])


def test_the_in_training_calibration_is_held_out_and_judged_against_the_fit_error():
    """Each run that times all its communication is predicted with the factor of the *other* such runs;
    a strategy timing only part of it (interleaved DP: what overlap left) is neither judged nor used."""
    runs = pd.DataFrame([
        {"experiment": e, "strategy": s, "status": "ok", "world_size": 2, "step_time_median_s": 0.1,
         "comm_time_median_s": c}
        for e, s, c in [("a", "dp_naive", 0.02), ("b", "dp_naive", 0.03), ("c", "dp_naive", 0.04),
                        ("a", "dp_interleaved", 0.001)]])
    inputs = _inputs()
    fits = inputs.tables["comm_fit"].assign(rel_err_max=0.3)
    experiments = {e: dict(TEST_EXPERIMENT, name=e) for e in "abc"}
    share = build(TableInputs(experiments=experiments, tables={"runs": runs, "comm_fit": fits}))["comm_share"]
    share = share.set_index(["experiment", "strategy"])
    predicted = share.loc[("a", "dp_naive"), "comm_predicted_s"]
    assert share.loc[("a", "dp_naive"), "training_ratio"] == pytest.approx(np.median([0.03, 0.04]) / predicted)
    assert share.loc[("c", "dp_naive"), "calibrated_rel_err"] == pytest.approx(0.025 / 0.04 - 1)
    assert list(share["rel_err_within_tolerance"].iloc[:3]) == [False, True, False]  # +75 %, 0 %, -38 % vs 30 %
    interleaved = share.loc["a", "dp_interleaved"]
    assert not interleaved["comm_whole"] and pd.isna(interleaved["model_rel_err"]) and pd.isna(interleaved["calibrated_rel_err"])


def test_volume_lists_each_runs_calls_and_marks_unknown_plans():
    volume = build(_inputs())["comm_volume"]
    naive = volume[(volume.experiment == "e") & (volume.strategy == "dp_naive")]
    assert list(naive["plan"]) == ["known"] and float(naive["bus_bytes"].iloc[0]) == PARAMS * 4
    assert list(volume[volume.experiment == "hub"]["plan"]) == ["unknown"]
    assert (volume[volume.strategy == "single"]["plan"] == "unknown").sum() == 0  # an empty plan has no rows


def test_whatif_faster_links_and_overlap_never_slow_a_step():
    whatif = build(_inputs())["comm_whatif"]
    assert set(whatif["strategy"]) == {"single", "dp_naive", "ddp"} and set(whatif["experiment"]) == {"e"}
    assert (whatif[whatif.strategy == "single"]["predicted_step_s"] == 0.05).all()  # no communication to swap
    assert set(whatif["link"]) == {MEASURED_LINK, *(link.name for link in LINKS)}
    assert list(whatif.drop_duplicates("link").sort_values("link_order")["link"]) == [
        MEASURED_LINK, *(link.name for link in LINKS)]
    kinds = {link.name: link.kind for link in LINKS}
    modelled = whatif[whatif["link"] != MEASURED_LINK].assign(kind=lambda w: w["link"].map(kinds))
    for _, group in modelled.groupby(["strategy", "overlap", "kind"]):  # links of one kind share a latency per step
        steps = group.sort_values("bandwidth_GBps")["predicted_step_s"].to_numpy()
        assert np.all(np.diff(steps) <= 0)
    pivot = whatif.pivot_table(index=["strategy", "link"], columns="overlap", values="predicted_step_s")
    assert np.all(pivot["perfect"] <= pivot["none"])
    # On this machine's own fit, no overlap: dp_naive's measured compute 0.06 s + the predicted communication.
    naive = whatif[(whatif.strategy == "dp_naive") & (whatif.link == MEASURED_LINK) & (whatif.overlap == "none")]
    assert float(naive["predicted_step_s"].iloc[0]) == pytest.approx(0.06 + 1e-4 + PARAMS * 4 / 0.1e9)


def test_fit_curve_spans_each_fit_and_follows_alpha_beta():
    curve = build(_inputs())["comm_fit_curve"]
    assert set(curve["collective"]) == set(COLLECTIVES)
    reduce = curve[curve.collective == "all_reduce"]
    assert reduce["size_bytes"].min() == pytest.approx(1024) and reduce["size_bytes"].max() == pytest.approx(2**20)
    assert np.allclose(reduce["time_s"], 1e-4 + reduce["size_bytes"] * 1.0 / 0.1e9)


def test_projection_at_the_study_scale():
    """Pythia-6.9B shape: ~6.86e9 parameters, so DDP all-reduces 2*(7/8)*4 bytes of each per step."""
    table = projection_table()
    multi = {name for name, spec in REGISTRY.items() if not spec.single_process}
    assert set(table["strategy"]) == multi and len(table) == len(multi) * len(LINKS)
    ddp = table[(table.strategy == "ddp")].set_index("link")
    params = ddp["bytes_per_rank"].iloc[0] / (4 * 2 * 7 / 8)
    assert 6.8e9 < params < 6.9e9
    # 10 GbE: 1.75 * 27.4 GB at the 1.1 GB/s NCCL reaches is ~44 s of gradient traffic per step (a ring of 14
    # network steps adds ~0.2 ms); NVLink 4 more than 300 x less.
    slow, fast = (next(link for link in LINKS if link.name.startswith(p)) for p in ("10 Gb/s", "NVLink 4"))
    assert ddp.loc[slow.name, "comm_s"] == pytest.approx(ddp["bytes_per_rank"].iloc[0] / 1.1e9, rel=1e-3)
    assert ddp.loc[slow.name, "comm_s"] > 300 * ddp.loc[fast.name, "comm_s"]
    # ZeRO-3 gathers the parameters twice and reduce-scatters the gradients once per micro-batch (4 of one
    # sequence per rank), all in DeepSpeed's bf16: 4 x 1.5 x 2/4 = 3 x DDP's fp32 all-reduce; ZeRO-0 is
    # DDP's all-reduce in bf16, half its bytes.
    zero3, zero0 = (table[table.strategy == s]["bytes_per_rank"].iloc[0] for s in ("zero3", "zero0"))
    assert zero3 == pytest.approx(3 * ddp["bytes_per_rank"].iloc[0])
    assert zero0 == pytest.approx(ddp["bytes_per_rank"].iloc[0] / 2)
    assert table["comm_s"].notna().all()
    # Strategies with the same plan share a group, drawn once by its first member.
    groups = table.drop_duplicates("strategy").set_index("strategy")
    assert groups.loc["ddp", "plan_group"] == groups.loc["dp_naive", "plan_group"] != groups.loc["zero3", "plan_group"]
    assert groups.loc["dp_naive", "group_representative"] and not groups.loc["ddp", "group_representative"]
    assert groups.groupby("plan_group")["group_representative"].sum().eq(1).all()


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
    """A failed torchrun job leaves failure rows (with the reason) and failed fits; main still returns 0."""
    from shardlab.bench import comm as bench

    def failed(world, module, module_args, run_dir, output, timeout_s, timeout_setting, env=None):
        assert (world, module, timeout_setting) == (2, "shardlab.bench.comm", "comm_bench.timeout_s")
        assert str(run_dir) in module_args[module_args.index("--out") + 1]  # the ranks name their run folder
        return "rank 1: RuntimeError: gloo exploded"

    monkeypatch.setattr(bench, "launch_module", failed)
    bench_csv, fit_csv = tmp_path / "comm_bench.csv", tmp_path / "comm_fit.csv"
    assert bench.main(["--settings", "{}", "--bench-out", str(bench_csv), "--fit-out", str(fit_csv)]) == 0
    table, fits = pd.read_csv(bench_csv), pd.read_csv(fit_csv)
    assert len(table) == len(COLLECTIVES) and table["status"].str.contains("gloo exploded").all()
    assert fits["status"].str.startswith("failed").all()


def _ranks_seen(marker: str, seen: set, stop: threading.Event) -> None:
    """Collect the pids of benchmark ranks whose command line names `marker`, until `stop`."""
    while not stop.is_set():
        seen.update(p.pid for p in run_processes(marker) if "worker" in p.info["cmdline"])
        time.sleep(0.2)


@pytest.mark.torchrun
def test_a_benchmark_that_hits_its_timeout_leaves_no_rank_running(tmp_path, monkeypatch):
    """Ranks that would time collectives for hours are stopped at comm_bench.timeout_s, every one of them."""
    import tempfile

    from shardlab.bench.comm import resolve_settings, run_benchmark

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the launch's run folder: under tmp_path
    settings = dict(resolve_settings({"collectives": ["all_reduce"], "max_bytes": 1024}), repeats=10**9, timeout_s=18)
    seen, stop = set(), threading.Event()
    watcher = threading.Thread(target=_ranks_seen, args=(str(tmp_path), seen, stop), daemon=True)
    watcher.start()
    try:
        table = run_benchmark(settings, tmp_path / "comm_bench.csv")
    finally:
        stop.set()
        watcher.join()
    assert table["status"].tolist() == ["failed: timed out after 18 s (comm_bench.timeout_s); the run was stopped"]
    assert len(seen) >= 2, "the ranks never started before the deadline"
    assert not [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not run_processes(str(tmp_path))


@pytest.mark.torchrun
def test_a_rank_exception_is_read_from_torchruns_error_file(tmp_path):
    """Both ranks raise (an unknown collective); the reason is the exception as the error file holds it,
    type and message exactly, and stays so without the printed output."""
    from shardlab.bench.comm import resolve_settings
    from shardlab.runner.failures import failure_outcome
    from shardlab.runner.launch import launch_module
    from shardlab.runner.process import RANK_LOG_DIR, Outcome

    settings = dict(resolve_settings({"max_bytes": 1024}), collectives=["no_such_collective"])
    out = tmp_path / "comm_bench.csv"
    reason = launch_module(2, "shardlab.bench.comm", ["worker", "--settings", json.dumps(settings), "--out", str(out)],
                           tmp_path, out, 120, "comm_bench.timeout_s")
    assert re.fullmatch(r"rank [01]: ValueError: unknown collective 'no_such_collective'", reason), reason
    assert len(list((tmp_path / RANK_LOG_DIR).glob("*/attempt_0/*/error.json"))) == 2
    (tmp_path / "run.log").write_text("")  # the printed output gone: the files alone give the same reason
    recorded = failure_outcome(Outcome(tmp_path, 1, None, 120))
    assert recorded["reason"] == reason and len(recorded["failures"]) == 2
    assert "in collective_call" in recorded["traceback"]  # the rank's own traceback, not torchrun's
