"""Pipeline parallelism with torch.distributed.pipelining: GPipe, 1F1B and interleaved 1F1B.

Each rank holds one stage (or `virtual_stages` of them, looped: rank r holds stages r, r+p, ...)
of the hand-cut model (`stages.py`). The strategy owns micro-batching: the loop hands it the
whole local batch, and `schedule.step` splits it into `n_microbatches`, runs forward/backward in
the schedule's order and sends activations/gradients between neighbours (point-to-point, gloo or
nccl). Each micro-batch's loss is a mean and the schedule divides gradients by the number of
micro-batches (`scale_grads=True`), so gradients equal the whole-batch mean gradients.

Every rank sees the whole local batch: the first stage reads the tokens, the last the labels.
Only the last stage knows the loss; `reduce_losses` shares it with every rank.

This file is the technique only; what a pipeline run measures beyond the shared loop (its op
timeline and live activations, for the bubble and per-stage memory) is `probe.PipelineProbe`,
which the registered strategies (`strategies.py`) put around it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from shardlab.costs.shapes import stage_units
from shardlab.strategies.base import Strategy, causal_lm_loss
from shardlab.strategies.pipeline_parallel.options import DEFAULT_MICROBATCHES
from shardlab.strategies.pipeline_parallel.stages import NeoXStage


class GPipe(Strategy):
    """GPipe: all micro-batches forward, then all backward; every stage holds m micro-batches' activations."""

    schedule_class = ScheduleGPipe
    virtual_stages = 1

    # --- topology: which ranks form this rank's pipeline (the hybrid overrides this) --------
    def pipeline_group(self):
        """(process group, this rank's position in the pipeline, pipeline length)."""
        return None, self.topo.rank, self.topo.world_size

    # Every rank sees the whole global batch: no data-parallel split.
    dp_rank, dp_size = 0, 1

    # --- set-up -------------------------------------------------------------------------
    def wrap(self, model):
        self.hf_names = {id(p): name for name, p in model.named_parameters()}  # before the stages rename them
        self.pp_group, self.pp_rank, self.pp_size = self.pipeline_group()
        self.n_microbatches = int(self.options.get("n_microbatches", DEFAULT_MICROBATCHES))
        self.n_stages = self.pp_size * self.virtual_stages
        units = stage_units(model.config.num_hidden_layers, self.n_stages)
        self.stage_ids = [self.pp_rank + k * self.pp_size for k in range(self.virtual_stages)]
        self.stage_units = [units[s] for s in self.stage_ids]
        self.holds_first = 0 in self.stage_ids
        self.holds_last = self.n_stages - 1 in self.stage_ids
        modules = [self.make_stage(model, units[s]) for s in self.stage_ids]
        stages = [self.pipeline_stage(module, s) for module, s in zip(modules, self.stage_ids)]
        self.schedule = self.build_schedule(stages)
        return nn.ModuleList(modules)

    def make_stage(self, model, units: list) -> NeoXStage:
        return NeoXStage(model, units)

    def pipeline_stage(self, module: nn.Module, stage: int) -> PipelineStage:
        return PipelineStage(module, stage, self.n_stages, self.topo.device, group=self.pp_group)

    def loss(self, logits, labels):
        return causal_lm_loss(logits, labels)

    def build_schedule(self, stages):
        return self.schedule_class(stages[0], self.n_microbatches, loss_fn=self.loss)

    def state_namespace(self):
        return f"stage_rank{self.pp_rank}"  # this rank's stages; data-parallel replicas of them share it

    def whole_parameter(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as the unsplit model holds it (a composed run's TP shards are gathered here)."""
        return tensor

    def full_state_dict(self):
        """The whole model on the main rank, under the Hugging Face names: each rank's stages gathered
        (collective; data-parallel replicas send the same tensors, kept once)."""
        mine = {}
        for p in self.model.parameters():
            name = self.hf_names[id(p)]
            mine[name] = self.whole_parameter(name, p.detach()).cpu().clone()
        everyone = [None] * dist.get_world_size() if self.topo.is_main else None
        dist.gather_object(mine, everyone, dst=0)
        return {name: t for part in everyone for name, t in part.items()} if self.topo.is_main else None

    # --- one step -----------------------------------------------------------------------
    def micro_batches(self, inputs, labels):
        return [(inputs, labels)]  # the schedule cuts micro-batches itself

    def _schedule_args(self, inputs, labels):
        return ((inputs,) if self.holds_first else ()), (labels if self.holds_last else None)

    def forward_backward(self, inputs, labels, scale):
        """One schedule step: every micro-batch forward and backward in the schedule's order. The mean of
        the micro-batch losses on the last stage, zero elsewhere."""
        args, target = self._schedule_args(inputs, labels)
        losses: list[torch.Tensor] = []
        with self.autocast():  # bf16: every stage's forward under autocast, as one device runs
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())

    @torch.no_grad()
    def evaluate(self, inputs, labels):
        args, target = self._schedule_args(inputs, labels)
        losses: list[torch.Tensor] = []
        with self.autocast():
            self.schedule.eval(*args, target=target, losses=losses)
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def reduce_losses(self, losses):
        """Every rank gets the global mean losses: the last stage of each data-parallel replica holds its
        replica's means, the other ranks contribute zeros, and the sum over the world is divided by dp."""
        losses = losses.detach().float().clone() if self.holds_last else torch.zeros_like(losses, dtype=torch.float32)
        dist.all_reduce(losses)
        return losses / self.dp_size

    def extra_metrics(self) -> dict:
        return {"pp_schedule": type(self.schedule).__name__, "pp_size": self.pp_size,
                "pp_virtual_stages": self.virtual_stages, "pp_n_microbatches": self.n_microbatches,
                "pp_stage_ids": self.stage_ids, "pp_stage_units": [[str(u) for u in us] for us in self.stage_units]}


class OneForwardOneBackward(GPipe):
    """1F1B: after a warm-up of forwards, each stage alternates one forward and one backward, so stage s
    holds at most p - s micro-batches' activations (same bubble as GPipe)."""

    schedule_class = Schedule1F1B


class Interleaved1F1B(GPipe):
    """Interleaved 1F1B: each rank holds `virtual_stages` non-adjacent stages, shrinking the bubble v-fold."""

    virtual_stages = 2

    def build_schedule(self, stages):
        return ScheduleInterleaved1F1B(stages, self.n_microbatches, loss_fn=self.loss)
