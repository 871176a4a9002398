"""The one training loop every strategy runs through: timing, memory probes, progress, records."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from shardlab.core.data import TokenBatches
from shardlab.runner.checkpoint import Checkpointer
from shardlab.runner.memory import ActivationProbe, peak_memory, reset_peak
from shardlab.runner.faults import inject_fault
from shardlab.runner.metrics import StepLog
from shardlab.strategies.base import Strategy


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_rank(seconds: float) -> float:
    """A step is as slow as its slowest rank."""
    t = torch.tensor([seconds], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def validation_loss(strategy: Strategy, batches: TokenBatches, n_batches: int) -> float:
    losses = []
    for inputs, labels in batches.validation(n_batches):
        inputs, labels = strategy.local_batch(inputs, labels)
        device = strategy.topo.device
        losses.append(strategy.reduce_loss(strategy.evaluate(inputs.to(device), labels.to(device))))
    return sum(losses) / len(losses)


def train(strategy: Strategy, batches: TokenBatches, training: dict, log: StepLog, label: str = "",
          start_step: int = 0, checkpoint: Checkpointer | None = None, resumes: list | None = None) -> dict:
    """Run optimizer steps `start_step`..`training.steps - 1` (a resumed run starts past 0), saving a
    checkpoint when one is due; returns this rank's memory measurements."""
    topo, device = strategy.topo, strategy.topo.device
    tokens_per_step = training["global_batch_size"] * training["seq_len"]
    measured: dict = {}
    reset_peak(device)
    started = time.perf_counter()
    for step in range(start_step, training["steps"]):
        inputs, labels = strategy.local_batch(*batches.global_batch(step))
        micro = strategy.micro_batches(inputs.to(device), labels.to(device))
        first = step == start_step  # the probe step (step 0, or the first step after a resume)

        inject_fault(training["fault_injection"], step, topo.rank, resumed=start_step > 0)
        _synchronize(device)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro):
            # The first step (step 0: a warm-up step, never timed) also counts activations of its first micro-batch.
            probe = ActivationProbe(strategy.probe_module) if first and i == 0 else contextlib.nullcontext()
            with strategy.accumulating(last=i == len(micro) - 1), probe:
                loss_sum += strategy.forward_backward(x, y, scale=1.0 / len(micro))
            if isinstance(probe, ActivationProbe):
                measured["activation_bytes"] = probe.total_bytes
                measured["activation_by_module"] = probe.bytes_by_module()
        strategy.sync_gradients()
        strategy.optimizer_step()
        _synchronize(device)
        step_time = time.perf_counter() - t0

        if first:
            measured.update(strategy.state_bytes())  # gradients and optimizer state exist now
        strategy.zero_grad()
        comm = strategy.comm_seconds()
        loss = strategy.reduce_loss(loss_sum / len(micro))
        step_time = _slowest_rank(step_time)
        record = {"step": step, "loss": loss, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                  "comm_time_s": comm, "elapsed_s": time.perf_counter() - started}
        if first and step > 0:  # after a resume: the probe and the reload ran in this step, it is not timed
            record["untimed"] = True
        if (training["eval_every"] and (step + 1) % training["eval_every"] == 0) or step == training["steps"] - 1:
            with strategy.comm.paused():  # evaluation traffic is no step's communication time
                record["val_loss"] = validation_loss(strategy, batches, training["eval_batches"])
        if topo.is_main:
            log.append(record)
            if step % training["log_every"] == 0 or step == training["steps"] - 1:
                print(f"[{label}] step {step + 1}/{training['steps']} loss {loss:.4f} "
                      f"{record['tokens_per_s']:,.0f} tokens/s ({step_time * 1e3:.1f} ms/step)", flush=True)
        if checkpoint and checkpoint.due(step, training["steps"] - 1):
            checkpoint.save(strategy, step, {"records": log.records, "resumes": resumes or []})
    measured.update(peak_memory(device))
    measured.update(strategy.extra_metrics())
    if checkpoint and checkpoint.seconds:
        measured.update(checkpoint_s=checkpoint.seconds, checkpoint_bytes=checkpoint.bytes)
    return measured
