"""The one training loop every strategy runs through: timing, memory probes, progress, records."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardlab.core.data import TokenBatches
from shardlab.runner.checkpoint import Checkpointer
from shardlab.runner.probes import ActivationProbe, peak_memory, reset_peak
from shardlab.runner.faults import inject_fault
from shardlab.runner.metrics import StepLog
from shardlab.strategies.base import Strategy


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_ranks(seconds: list[float], device: torch.device) -> list[float]:
    """A step is as slow as its slowest rank: the per-step maximum over ranks, in one collective."""
    t = torch.tensor(seconds, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class PendingSteps:
    """Steps measured but not yet reduced over the ranks. Their losses and step times are reduced
    together when the loop needs them (a log line, an evaluation, a checkpoint, the last step):
    two small collectives per flush instead of two per step, which on gloo cost ~1-2 % of a step
    each (bench/instrumentation.py)."""

    def __init__(self, strategy: Strategy):
        self.strategy = strategy
        self.steps: list[dict] = []

    def add(self, step: int, loss: torch.Tensor, step_time: float, comm: float | None, **extra) -> None:
        self.steps.append(dict(extra, step=step, loss=loss, step_time_s=step_time, comm_time_s=comm))

    def flush(self) -> list[dict]:
        """The pending steps with the global mean loss and the slowest rank's step time, in order."""
        if not self.steps:
            return []
        losses = self.strategy.reduce_losses(torch.stack([s["loss"].reshape(()) for s in self.steps])).tolist()
        times = _slowest_ranks([s["step_time_s"] for s in self.steps], self.strategy.topo.device)
        flushed = [dict(s, loss=loss, step_time_s=t) for s, loss, t in zip(self.steps, losses, times)]
        self.steps = []
        return flushed


def learning_rate(training: dict, step: int) -> float:
    """training.lr at `step`: constant, or (lr_schedule: cosine) a linear warm-up over lr_warmup_steps, then
    a cosine decay to a tenth of it at the last step. A function of the step alone, so a resumed run
    continues the schedule exactly."""
    peak, warmup, last = training["lr"], training.get("lr_warmup_steps", 0), training["steps"] - 1
    if training.get("lr_schedule", "constant") == "constant":
        return peak
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, last - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def validation_loss(strategy: Strategy, batches: TokenBatches, n_batches: int) -> float:
    losses = []
    for inputs, labels in batches.validation(n_batches):
        inputs, labels = strategy.local_batch(inputs, labels)
        device = strategy.topo.device
        losses.append(strategy.reduce_loss(strategy.evaluate(inputs.to(device), labels.to(device))))
    return sum(losses) / len(losses)


def step_work(strategy: Strategy, micro: list, measured: dict, probe: bool = False) -> torch.Tensor:
    """The optimizer step itself, nothing measured but, with `probe`, the first micro-batch's
    activations (into `measured`): the sum of the micro-batches' losses."""
    loss_sum = torch.zeros((), device=strategy.topo.device)
    for i, (x, y) in enumerate(micro):
        activations = ActivationProbe(strategy.probe_module) if probe and i == 0 else contextlib.nullcontext()
        with strategy.accumulating(last=i == len(micro) - 1), activations:
            loss_sum += strategy.forward_backward(x, y, scale=1.0 / len(micro))
        if isinstance(activations, ActivationProbe):
            measured["activation_bytes"] = activations.total_bytes
            measured["activation_by_module"] = activations.bytes_by_module()
    strategy.sync_gradients()
    strategy.optimizer_step()
    return loss_sum


def measured_step(strategy: Strategy, micro: list, measured: dict,
                  probe: bool = False) -> tuple[torch.Tensor, float, float | None]:
    """One step with everything the study records around it: (this rank's mean loss, its step time,
    its blocked communication), to be reduced over ranks by `PendingSteps`. Timed from the device
    being idle to the optimizer's update being done."""
    device = strategy.topo.device
    _synchronize(device)
    t0 = time.perf_counter()
    loss_sum = step_work(strategy, micro, measured, probe)
    _synchronize(device)
    step_time = time.perf_counter() - t0
    if probe:
        measured.update(strategy.state_bytes())  # gradients and optimizer state exist now
    strategy.zero_grad()
    return loss_sum.detach() / len(micro), step_time, strategy.comm_seconds()


def snapshot_due(training: dict, step: int) -> bool:
    """training.save_model_every: a model snapshot after this step (not after the last: that is the model)."""
    every = training.get("save_model_every", 0)
    return bool(every) and (step + 1) % every == 0 and step < training["steps"] - 1


def train(strategy: Strategy, batches: TokenBatches, training: dict, log: StepLog, label: str = "",
          start_step: int = 0, checkpoint: Checkpointer | None = None, resumes: list | None = None,
          snapshot: Callable[[int], None] | None = None) -> dict:
    """Run optimizer steps `start_step`..`training.steps - 1` (a resumed run starts past 0), saving a
    checkpoint when one is due and calling `snapshot(steps done)` when a model snapshot is
    (`snapshot_due`); returns this rank's memory measurements."""
    topo, device = strategy.topo, strategy.topo.device
    tokens_per_step = training["global_batch_size"] * training["seq_len"]
    measured: dict = {}
    reset_peak(device)
    started = time.perf_counter()
    pending = PendingSteps(strategy)
    last = training["steps"] - 1
    for step in range(start_step, training["steps"]):
        inputs, labels = strategy.local_batch(*batches.global_batch(step))
        micro = strategy.micro_batches(inputs.to(device), labels.to(device))
        first = step == start_step  # the probe step (step 0, or the first step after a resume)
        if training.get("lr_schedule", "constant") != "constant":
            strategy.set_lr(learning_rate(training, step))

        inject_fault(training["fault_injection"], step, topo.rank, resumed=start_step > 0)
        # The first step (step 0: a warm-up step, never timed) also probes activations and state bytes.
        loss, step_time, comm = measured_step(strategy, micro, measured, probe=first)
        # After a resume the probe and the reload ran in the first step: it is not timed.
        pending.add(step, loss, step_time, comm, elapsed_s=time.perf_counter() - started,
                    **({"untimed": True} if first and step > 0 else {}))
        if snapshot is not None and snapshot_due(training, step):  # on its own schedule, not the log's
            saving = time.perf_counter()
            with strategy.comm.paused():  # gathering the weights is no step's communication time
                snapshot(step + 1)
            started += time.perf_counter() - saving  # nor training wall time: elapsed_s and time to target leave it out
        evaluate = (training["eval_every"] and (step + 1) % training["eval_every"] == 0) or step == last
        save = checkpoint is not None and checkpoint.due(step, last)
        if not (evaluate or save or step % training["log_every"] == 0 or step == last):
            continue
        records = pending.flush()
        for record in records:
            record["tokens_per_s"] = tokens_per_step / record["step_time_s"]
        if evaluate:
            with strategy.comm.paused():  # evaluation traffic is no step's communication time
                records[-1]["val_loss"] = validation_loss(strategy, batches, training["eval_batches"])
        if topo.is_main:
            for record in records:
                log.append(record)
        if topo.is_main and (step % training["log_every"] == 0 or step == last):
            r = records[-1]
            print(f"[{label}] step {step + 1}/{training['steps']} loss {r['loss']:.4f} "
                  f"{r['tokens_per_s']:,.0f} tokens/s ({r['step_time_s'] * 1e3:.1f} ms/step)", flush=True)
        if save:
            checkpoint.save(strategy, step, {"records": log.records, "resumes": resumes or []})
    measured.update(peak_memory(device))
    measured.update(strategy.extra_metrics())
    if checkpoint and checkpoint.seconds:
        measured.update(checkpoint_s=checkpoint.seconds, checkpoint_bytes=checkpoint.bytes)
    return measured
