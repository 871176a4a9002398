"""The interface between a parallelism strategy and the one shared training loop.

The loop (`shardlab.runner.loop`) calls, for every step:

    for each micro-batch:  with strategy.accumulating(last=...): strategy.forward_backward(x, y, scale)
    strategy.sync_gradients(); strategy.optimizer_step(); strategy.zero_grad()

A strategy overrides only what its technique changes. Strategies that own the whole step
(DeepSpeed's engine, pipeline schedules) override `forward_backward` / `optimizer_step` and keep
the rest.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlab.core.topology import Topology
from shardlab.strategies import portable
from shardlab.strategies.portable import Held, as_held, local_tensor
from shardlab.strategies.recompute import apply_recompute


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; `labels` are already shifted by the data loader."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


def build_optimizer(params, training: dict) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if training["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=training["lr"], weight_decay=training["weight_decay"])
    return torch.optim.AdamW(params, lr=training["lr"], weight_decay=training["weight_decay"])


def tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = local_tensor(t)
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(state.values()) for state in optimizer.state.values())


class CommTimer:
    """Wall time this rank spends blocked in communication it issues itself.

    On CUDA a collective call (even a "synchronous" NCCL one) returns once it is enqueued, so the
    timer synchronizes the device at both ends: before, so that compute still queued is not
    counted as communication; after, so that the collective has completed. On CPU (gloo) the call
    returns when it is done and nothing is added.
    """

    def __init__(self, device: torch.device | None = None):
        self.seconds = 0.0
        self.enabled = True  # off: blocks run untimed and unsynchronized (the instrumentation benchmark)
        on_cuda = device is not None and device.type == "cuda"
        self._synchronize = (lambda: torch.cuda.synchronize(device)) if on_cuda else (lambda: None)

    @contextlib.contextmanager
    def blocked(self):
        if not self.enabled:
            yield
            return
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def paused(self):
        """Communication inside this block is not counted (e.g. validation between two steps)."""
        before = self.seconds
        try:
            yield
        finally:
            self.seconds = before

    def pop(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class Strategy:
    """Default behaviour: one process, plain autograd, the whole batch on this rank."""

    #: False when the strategy cannot measure its communication separately (e.g. DDP overlaps it inside backward).
    measures_comm = False

    def __init__(self, model: nn.Module, topo: Topology, training: dict, options: dict, name: str = ""):
        self.name = name  # the registry entry that built it (StrategySpec.build): its Plan fields are the run's
        self.topo = topo
        self.training = training
        self.options = options
        self.comm = CommTimer(topo.device)
        self.model = self.wrap(model.to(topo.device))
        apply_recompute(model, self.recompute)  # on the layers the wrapped model runs
        self.optimizer = self.make_optimizer()

    # --- set-up -------------------------------------------------------------------------
    @property
    def recompute(self) -> str:
        """What the run recomputes in backward: none, selective (the attention core) or full (each layer)."""
        return self.training.get("recompute", "none")

    def wrap(self, model: nn.Module) -> nn.Module:
        """Return the module the loop trains (wrapped, sharded or as is)."""
        return model

    def make_optimizer(self):
        """The optimizer the loop steps (engines that build their own, e.g. DeepSpeed's, return theirs)."""
        return build_optimizer(self.model.parameters(), self.training)

    def artifacts(self) -> dict[str, object]:
        """Files (name -> JSON-able content) to save beside the run's results, e.g. an engine's config."""
        return {}

    @property
    def dp_rank(self) -> int:
        return self.topo.rank

    @property
    def dp_size(self) -> int:
        return self.topo.world_size

    @property
    def dp_group(self):
        return None  # the default (world) group

    # --- one step -----------------------------------------------------------------------
    def local_batch(self, inputs: torch.Tensor, labels: torch.Tensor):
        """This rank's rows of the global batch (contiguous slice per data-parallel rank)."""
        rows = inputs.shape[0] // self.dp_size
        sl = slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        return inputs[sl], labels[sl]

    def micro_batches(self, inputs: torch.Tensor, labels: torch.Tensor):
        """Split the local batch for gradient accumulation (pipeline schedules keep it whole)."""
        return split_micro_batches(inputs, labels, self.training.get("micro_batch_size"))

    def autocast(self):
        enabled = self.training["dtype"] == "bf16"
        return torch.autocast(self.topo.device.type, dtype=torch.bfloat16, enabled=enabled)

    def accumulating(self, last: bool):
        """Context for one micro-batch; strategies suppress gradient sync when `last` is False."""
        return contextlib.nullcontext()

    def position_ids(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The tokens' positions when they are not 0..S-1 (context parallelism's shards); None: the model's own."""
        return None

    def compute_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = self.position_ids(inputs)
        extra = {} if positions is None else {"position_ids": positions}
        with self.autocast():
            return causal_lm_loss(self.model(input_ids=inputs, **extra).logits, labels)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        loss = self.compute_loss(inputs, labels)
        (loss * scale).backward()
        return loss.detach()

    def sync_gradients(self) -> None:
        """Make every rank's gradients the global-batch gradients (no-op for one process)."""

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the coming step (training.lr_schedule)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss of this rank's share of a validation batch (reduce with `reduce_loss`)."""
        return self.compute_loss(inputs, labels)

    def reduce_losses(self, losses: torch.Tensor) -> torch.Tensor:
        """Global-batch mean losses on every rank (mean of the data-parallel ranks' means), for a
        vector of this rank's losses (several steps in one collective)."""
        losses = losses.detach().float().clone()
        if self.dp_size > 1:
            dist.all_reduce(losses, group=self.dp_group)
            losses /= self.dp_size
        return losses

    def reduce_loss(self, loss: torch.Tensor) -> float:
        """The global-batch mean of one loss (`reduce_losses` of one value)."""
        return float(self.reduce_losses(loss.reshape(1))[0])

    # --- the whole training state: checkpoints and the trained model ----------------------------
    #: False where ranks hold different parameters (pipeline stages, experts): `portable.gather` collects them.
    holds_every_parameter = True

    def held_parameters(self) -> list[Held]:
        """Every parameter this rank holds, under its name in the whole model, with how it is split
        (`portable.Held`). Default: the module's own parameters, whole or DTensors."""
        module = getattr(self.model, "module", self.model)  # DDP's wrapper
        return [as_held(name, p) for name, p in module.named_parameters()]

    def optimizer_states(self, held: list[Held]) -> list[dict]:
        """This rank's optimizer state of each held parameter (its piece, shaped like the parameter's)."""
        return [dict(self.optimizer.state.get(h.param, {})) for h in held]

    def set_optimizer_states(self, held: list[Held], states: list[dict]) -> None:
        for h, state in zip(held, states):
            if state:
                self.optimizer.state[h.param] = state

    def whole_state(self, held: list[Held], with_optimizer: bool = True) -> list[tuple[torch.Tensor, dict]]:
        """Each held parameter and its optimizer states, whole (collective over the ranks that split them)."""
        return portable.whole_state(held, self.optimizer_states(held) if with_optimizer else [{}] * len(held))

    def restore(self, held: list[Held], read) -> None:
        """Set each held parameter and its optimizer state to this rank's piece of the whole ones that
        `read(name)` returns as (parameter, {state key: tensor}): loading is resharding."""
        states = []
        with torch.no_grad():
            for h in held:
                param, optimizer = read(h.name)
                local_tensor(h.param).copy_(local_tensor(h.cut(param)))
                states.append(portable.cut_states(h, optimizer))
        self.set_optimizer_states(held, states)

    def resume_at(self, step: int) -> None:
        """Called after a restore with the first step the loop will run (for strategies that count steps)."""

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The complete, unsharded model state on the main rank (None elsewhere); call on every rank."""
        state = portable.gather(self, with_optimizer=False)
        return state.parameters if state else None

    # --- measurement --------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer state (call before zero_grad)."""
        params = list(self.model.parameters())
        return {
            "param_bytes": tensor_bytes(params),
            "grad_bytes": tensor_bytes(p.grad for p in params),
            "optimizer_bytes": optimizer_state_bytes(self.optimizer),
        }

    def comm_seconds(self) -> float | None:
        return self.comm.pop() if self.measures_comm else None

    def extra_metrics(self) -> dict:
        """Technique-specific measurements merged into this rank's summary entry after training.

        Called once on every rank after the last step, so it may run collectives (e.g. a pipeline's
        per-stage timings reduced over its group). Keys must be JSON-serialisable.
        """
        return {}

    @property
    def probe_module(self) -> nn.Module:
        """The module tree whose forward the activation probe tags by submodule name."""
        return self.model


def split_micro_batches(inputs: torch.Tensor, labels: torch.Tensor, micro_batch_size: int | None):
    if not micro_batch_size or micro_batch_size >= inputs.shape[0]:
        return [(inputs, labels)]
    return list(zip(inputs.split(micro_batch_size), labels.split(micro_batch_size)))
