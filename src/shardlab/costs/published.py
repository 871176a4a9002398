"""The planner against published large-scale measurements (`published.yaml`), with ONE hardware
description per accelerator for every point: nothing is fitted per point.

- Korthikanti et al. 2022 (A100, Megatron): eight iteration times and sixteen memory values.
- MosaicML's MPT benchmarks (H100, PyTorch FSDP): tokens per second per GPU, 760M-70B, 8-64 GPUs.
- Llama 3 405B (H100, Meta's 4D parallelism): MFU of three reported configurations.

Like for like: the paper's Figure 1 counts the transformer layers of the first pipeline stage
only (12h^2 parameters per layer at 18 bytes: fp16 weights, fp32 gradients, fp32 master copy and
Adam moments; no embedding, no logits), so the comparison takes the same part of the prediction.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

from shardlab.costs import predict, rank_memory
from shardlab.costs.plan import Cluster, Plan, Workload, rejection
from shardlab.costs.search import Space, candidates, rank_key
from shardlab.costs.shapes import ModelShape

POINTS = Path(__file__).with_name("published.yaml")
GIB = 2**30
MODES = {"full_recompute": dict(recompute="full", sp=False), "sp_selective": dict(recompute="selective", sp=True),
         "plain": dict(recompute="none", sp=False)}


@lru_cache(maxsize=1)
def reference() -> dict:
    return yaml.safe_load(POINTS.read_text())


def setting(point: dict, mode: str) -> tuple[ModelShape, Plan, Cluster, Workload]:
    """The model, plan, cluster and batch of one published point under `mode` (MODES)."""
    ref = reference()
    h = point["hidden"]
    model = ModelShape(ref["vocab_size"], h, point["layers"], point["heads"], 4 * h, residual="sequential",
                       tied_embeddings=True)
    plan = Plan(dp=point["gpus"] // (point["tp"] * point["pp"]), tp=point["tp"], pp=point["pp"],
                schedule="interleaved" if point["chunks"] > 1 else "1f1b", virtual_stages=point["chunks"],
                micro_batch=point["micro_batch"], dtype="fp16", attention="eager", framework="megatron",
                **MODES[mode])
    cluster = Cluster(ref["accelerator"], nodes=point["gpus"] // 8)
    return model, plan, cluster, Workload(point["global_batch"], ref["seq_len"])


def rows(cluster_overrides: dict | None = None) -> list[dict]:
    """One row per published value: quantity, published, predicted, error (%)."""
    out = []
    for point in reference()["models"]:
        for mode, key in (("full_recompute", "time_full_recompute_s"), ("sp_selective", "time_sp_selective_s")):
            model, plan, cluster, workload = setting(point, mode)
            if cluster_overrides:
                cluster = Cluster(cluster.accelerator, cluster.nodes, overrides=cluster_overrides)
            pred = predict.evaluate(model, plan, cluster, workload, dropout=True)
            out.append(_row(point, "iteration_time_s", mode, point[key], pred.step_s, pred.bottleneck))
        model, plan, _, workload = setting(point, "plain")
        layers = rank_memory.rank_layers(model.num_layers, plan.pp, plan.virtual_stages)[0]
        layer_params = layers * 12 * model.hidden_size**2 / plan.tp  # the figure's count (see module doc)
        states = rank_memory.model_states(plan, layer_params, 0)
        out.append(_row(point, "params_optimizer_gib", "plain", point["params_optimizer_gib"],
                        (states.param_bytes + states.grad_bytes + states.optimizer_bytes) / GIB))
        for mode, key in (("plain", "activations_plain_gib"), ("sp_selective", "activations_sp_selective_gib")):
            model, plan, _, workload = setting(point, mode)
            predicted = rank_memory.layer_activation_bytes(model, plan, workload, 0, dropout=True)
            out.append(_row(point, "activations_gib", mode, point[key], predicted / GIB))
    return out


def _row(point: dict, quantity: str, mode: str, published: float, predicted: float, bottleneck: str = "") -> dict:
    return {"model": point["name"], "quantity": quantity, "mode": mode, "published": published,
            "predicted": predicted, "error_pct": 100 * (predicted - published) / published, "bottleneck": bottleneck}


def summary(table: list[dict], by: str = "quantity") -> dict:
    """Mean and worst absolute error (%) per value of the column `by` (a quantity, a split)."""
    out = {}
    for key in dict.fromkeys(r[by] for r in table):
        errors = [abs(r["error_pct"]) for r in table if r[by] == key]
        out[key] = {"mean": sum(errors) / len(errors), "worst": max(errors), "n": len(errors)}
    return out


def predict_device(figure: str) -> float:
    """A figure of the one hardware description every point is predicted with."""
    from shardlab.costs.hardware import by_name

    return by_name(reference()["accelerator"])[figure]


# --- PyTorch FSDP on H100 (MosaicML's MPT benchmarks): calibration and held-out rows -----------------
def fsdp_setting(point: dict) -> tuple[ModelShape, Plan, Cluster, Workload]:
    """The MPT shape, the FSDP FULL_SHARD plan, the H100 nodes and the batch of one benchmark row."""
    ref = reference()["fsdp_h100"]
    d, layers, heads = ref["shapes"][point["model"]]
    model = ModelShape(ref["vocab_size"], d, layers, heads, 4 * d, residual="sequential", tied_embeddings=True)
    gpus = point["gpus"]
    plan = Plan(dp=gpus, zero=3, framework="fsdp2", micro_batch=point["micro_batch"],
                recompute="full" if point["ckpt"] else "none", dtype="bf16", attention="flash")
    workload = Workload(point["micro_batch"] * point["grad_accum"] * gpus, point["seq_len"])
    return model, plan, Cluster(ref["accelerator"], nodes=gpus // 8), workload


def fsdp_rows(overrides: dict | None = None) -> list[dict]:
    """One row per benchmark: published and predicted tokens/s per GPU, the error, whether the row
    calibrates the H100 efficiencies or is held out (`calibration_models`)."""
    ref = reference()["fsdp_h100"]
    out = []
    for point in ref["points"]:
        model, plan, cluster, workload = fsdp_setting(point)
        if overrides:
            cluster = Cluster(cluster.accelerator, cluster.nodes, overrides=overrides)
        pred = predict.evaluate(model, plan, cluster, workload)
        predicted = pred.tokens_per_s / cluster.gpus
        published_rate = point["tokens_per_s_per_gpu"]
        out.append({"model": point["model"], "seq_len": point["seq_len"], "gpus": point["gpus"],
                    "micro_batch": point["micro_batch"], "grad_accum": point["grad_accum"],
                    "recompute": plan.recompute,
                    "split": "calibration" if point["model"] in ref["calibration_models"] else "held_out",
                    "published": published_rate, "predicted": predicted,
                    "error_pct": 100 * (predicted - published_rate) / published_rate,
                    "published_mfu_pct": point["mfu_pct"], "predicted_mfu_pct": 100 * pred.mfu,
                    "fits": pred.fits, "memory_gb": pred.device_bytes / 1e9, "bottleneck": pred.bottleneck})
    return out



# --- Llama 3 405B on H100 (Meta's 4D parallelism): one calibration row, two held out -----------------
def llama3_setting(config: dict) -> tuple[ModelShape, Cluster, Workload, Space]:
    """The model, the H100 nodes, the 16M-token batch and the plans Meta's description leaves open
    (`choices`) of one reported configuration, its degrees fixed."""
    from shardlab.costs.planner import model_shape  # the CLI module; imported where used

    ref = reference()["llama3_405b"]
    choices = ref["choices"]
    space = Space(tp=(config["tp"],), pp=(config["pp"],), dp=(config["dp"],), cp=(config["cp"],),
                  schedule=tuple(choices["schedule"]), virtual_stages=tuple(choices["virtual_stages"]),
                  micro_batch=tuple(choices["micro_batch"]), shardings=tuple(map(tuple, choices["shardings"])))
    workload = Workload(ref["tokens_per_batch"] // config["seq_len"], config["seq_len"])
    return model_shape(ref["model"]), Cluster(ref["accelerator"], nodes=config["gpus"] // 8), workload, space


@lru_cache(maxsize=8)
def _llama3_fitting(index: int) -> tuple[Plan, ...]:
    """The plans of configuration `index` that fit in memory (efficiencies do not change memory, so a
    calibration re-times these and nothing else)."""
    model, cluster, workload, space = llama3_setting(reference()["llama3_405b"]["configurations"][index])
    return tuple(p for p in candidates(model, cluster, workload, space)
                 if rejection(model, p, cluster, workload) is None
                 and predict.evaluate(model, p, cluster, workload, with_time=False).fits)


def llama3_rows(overrides: dict | None = None) -> list[dict]:
    """One row per reported configuration: reported and predicted MFU of the planner's best plan
    within the configuration's degrees, the error, and the split."""
    ref = reference()["llama3_405b"]
    out = []
    for index, config in enumerate(ref["configurations"]):
        model, cluster, workload, _ = llama3_setting(config)
        if overrides:
            cluster = Cluster(cluster.accelerator, cluster.nodes, overrides=overrides)
        device = cluster.device_figures()
        predictions = [predict.evaluate(model, p, cluster, workload, device=device) for p in _llama3_fitting(index)]
        best = min(predictions, key=rank_key) if predictions else None
        mfu = 100 * best.mfu if best else float("nan")
        out.append({"gpus": config["gpus"], "tp": config["tp"], "cp": config["cp"], "pp": config["pp"],
                    "dp": config["dp"], "seq_len": config["seq_len"], "split": config["split"],
                    "published": config["mfu_pct"], "predicted": mfu,
                    "error_pct": 100 * (mfu - config["mfu_pct"]) / config["mfu_pct"],
                    "published_tflops_per_gpu": config["tflops_per_gpu"],
                    "predicted_tflops_per_gpu": best.tflops_per_gpu if best else float("nan"),
                    "best_plan": best.plan.label() if best else "no plan fits",
                    "bottleneck": best.bottleneck if best else ""})
    return _rank_and_band(out)


def llama3_agreement(rows: list[dict]) -> dict:
    """Whether every prediction lands in the reported band and in the reported order (`llama3_rows`'
    columns), and the held-out rows' worst error."""
    held_out = [abs(r["error_pct"]) for r in rows if r["split"] == "held_out"]
    return {"in_band": all(r["in_reported_band"] for r in rows),
            "in_order": all(r["predicted_rank"] == r["reported_rank"] for r in rows),
            "held_out_worst_pct": max(held_out) if held_out else float("nan")}


def _rank_and_band(rows: list[dict]) -> list[dict]:
    """Each row's rank by reported and by predicted MFU (1 = highest), and whether its prediction lies
    in the reported band (Meta reports whole percents, so a prediction counts at that precision)."""
    low, high = min(r["published"] for r in rows), max(r["published"] for r in rows)
    ranks = lambda key: {id(r): k + 1 for k, r in enumerate(sorted(rows, key=lambda r: -r[key]))}  # noqa: E731
    by_reported, by_predicted = ranks("published"), ranks("predicted")
    return [{**r, "reported_rank": by_reported[id(r)], "predicted_rank": by_predicted[id(r)],
             "in_reported_band": low <= round(r["predicted"]) <= high} for r in rows]
