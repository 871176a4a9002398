"""Run under torchrun by tests/test_tensor_parallel.py: every TP strategy vs the single-device model.

Each rank builds the unsharded reference itself (same weights, same batch), so gradients can be
compared parameter by parameter after the strategy reassembles its shards. Writes one JSON on rank 0.
"""

import copy
import json
import sys
from pathlib import Path

import torch

from shardlab.core.model import load_model
from shardlab.strategies import get_spec
from shardlab.strategies.base import build_optimizer, causal_lm_loss
from shardlab.core.topology import init_topology, shutdown

STRATEGIES = ["tp", "tp_sp", "tp_dtensor", "tp_sp_dtensor"]
TRAINING = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "dtype": "fp32", "micro_batch_size": None}
STEPS, BATCH, SEQ_LEN = 3, 4, 32


def batches(vocab: int):
    g = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab, (BATCH, SEQ_LEN + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


def reference(model):
    """Losses per step and step-0 gradients of the plain model."""
    optimizer = build_optimizer(model.parameters(), TRAINING)
    losses, grads = [], None
    for x, y in batches(model.config.vocab_size):
        loss = causal_lm_loss(model(input_ids=x).logits, y)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def check(name, model, topo, ref_losses, ref_grads, broken=False, options=None):
    strategy = get_spec(name).load()(model, topo, TRAINING, options or {})
    if broken:  # skip SP's all-reduce of partial LayerNorm/bias gradients: the check must catch it
        strategy.sync_gradients = lambda: None
    losses, grad_error, param_bytes = [], None, strategy.state_bytes()["param_bytes"]
    for x, y in batches(model.config.vocab_size):
        loss = strategy.forward_backward(x, y, scale=1.0)
        strategy.sync_gradients()
        if grad_error is None:
            grads = strategy.full_gradients()
            assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
            grad_error = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
        strategy.optimizer_step()
        strategy.zero_grad()
        losses.append(strategy.reduce_loss(loss))
    sharded = {n: tuple(p.shape) for n, p in strategy.model.named_parameters()}
    return {"losses": losses, "max_grad_error": grad_error, "param_bytes": param_bytes,
            "local_shapes": sharded}


def main(model_dir: str, out: str) -> None:
    topo = init_topology({"device": "cpu", "backend": "gloo", "threads_per_rank": 1})
    try:
        torch.manual_seed(0)
        base = load_model(model_dir)
        ref_losses, ref_grads = reference(copy.deepcopy(base))
        result = {"world_size": topo.world_size, "reference_losses": ref_losses, "tokens_per_step": BATCH * SEQ_LEN,
                  "reference_grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
                  "full_shapes": {n: tuple(p.shape) for n, p in base.named_parameters()},
                  "full_param_bytes": sum(p.numel() * p.element_size() for p in base.parameters())}
        for name in STRATEGIES:
            result[name] = check(name, copy.deepcopy(base), topo, ref_losses, ref_grads)
        for name in ("tp", "tp_sp"):
            result[f"{name}_parallel_cross_entropy"] = check(name, copy.deepcopy(base), topo, ref_losses, ref_grads,
                                                             options={"parallel_cross_entropy": True})
        result["tp_sp_without_grad_sync"] = check("tp_sp", copy.deepcopy(base), topo, ref_losses, ref_grads,
                                                  broken=True)
        if topo.is_main:
            Path(out).write_text(json.dumps(result))
    finally:
        shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
