"""The planner against published large-scale measurements (`published.yaml`: Korthikanti et al.
2022's eight iteration times and sixteen memory values), with ONE hardware description for every
point (the catalog's A100 entry and shared efficiencies): nothing is fitted per point.

Like for like: the paper's Figure 1 counts the transformer layers of the first pipeline stage
only (12h^2 parameters per layer at 18 bytes: fp16 weights, fp32 gradients, fp32 master copy and
Adam moments; no embedding, no logits), so the comparison takes the same part of the prediction.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

from shardlab.costs import predict, rank_memory
from shardlab.costs.plan import Cluster, Plan, Workload
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

