"""Pipeline parallelism with torch.distributed.pipelining: GPipe, 1F1B and interleaved 1F1B.

`build_pipeline` cuts a model into pp x v stages (`stages.py`, the cut of `costs.shapes.stage_units`)
and returns this rank's share as a `Pipeline`: its stage modules (rank r holds stages r, r+p, ...)
and the schedule that runs them. The schedule owns micro-batching: `Pipeline.step` hands it the
whole local batch, and `schedule.step` splits it into `n_microbatches`, runs forward/backward in the
schedule's order and sends activations/gradients between neighbours (point-to-point, gloo or nccl).
Each micro-batch's loss is a mean and the schedule divides gradients by the number of micro-batches
(`scale_grads=True`), so gradients equal the whole-batch mean gradients.

Every rank sees the whole local batch: the first stage reads the tokens, the last the labels. Only
the last stage knows the loss.

This file is the technique only: the strategies that run it are `strategy.py` (alone),
`hybrid_dp_pp.py` (with data parallelism) and `composed/` (with everything), and what a pipeline
run measures beyond the shared loop is `probe.PipelineProbe`, which wraps a built `Pipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from shardlab.costs.shapes import stage_units
from shardlab.strategies.base import causal_lm_loss
from shardlab.strategies.pipeline_parallel.stages import NeoXStage

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


@dataclass
class Pipeline:
    """This rank's stages of a cut model, and the schedule that runs them over the pipeline group."""

    modules: nn.ModuleList  # this rank's stage modules: what the optimizer steps
    stages: list[PipelineStage]
    group: object  # the pipeline's process group (None: the world)
    rank: int  # this rank's position in the pipeline
    size: int
    n_stages: int
    stage_ids: list[int]
    stage_units: list[list]
    n_microbatches: int
    virtual_stages: int
    hf_names: dict[int, str]  # id(parameter) -> its name in the unsplit model
    schedule: object = None
    loss_fn: object = field(default=causal_lm_loss)  # what `loss` computes (a probe may wrap it)

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def loss(self, logits, labels):
        """The schedule's loss function: looked up on each call, so a wrapper set later takes effect."""
        return self.loss_fn(logits, labels)

    def _schedule_args(self, inputs, labels):
        return ((inputs,) if self.holds_first else ()), (labels if self.holds_last else None)

    def step(self, inputs, labels, precision) -> torch.Tensor:
        """One schedule step: every micro-batch forward and backward in the schedule's order, under
        `precision` (bf16: every stage's forward under autocast, as one device runs). The mean of the
        micro-batch losses on the last stage, zero elsewhere."""
        args, target = self._schedule_args(inputs, labels)
        losses: list[torch.Tensor] = []
        with precision:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())

    @torch.no_grad()
    def evaluate(self, inputs, labels, precision) -> torch.Tensor:
        args, target = self._schedule_args(inputs, labels)
        losses: list[torch.Tensor] = []
        with precision:
            self.schedule.eval(*args, target=target, losses=losses)
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def metrics(self) -> dict:
        return {"pp_schedule": type(self.schedule).__name__, "pp_size": self.size,
                "pp_virtual_stages": self.virtual_stages, "pp_n_microbatches": self.n_microbatches,
                "pp_stage_ids": self.stage_ids, "pp_stage_units": [[str(u) for u in us] for us in self.stage_units]}


def build_pipeline(model: nn.Module, group, rank: int, size: int, schedule: str, virtual_stages: int,
                   n_microbatches: int, device: torch.device, make_stage=NeoXStage) -> Pipeline:
    """Cut `model` into size x virtual_stages stages, keep this rank's (looped: r, r + size, ...), and build
    the named schedule over them. `make_stage(model, units)` builds one stage module."""
    hf_names = {id(p): name for name, p in model.named_parameters()}  # before the stages rename them
    n_stages = size * virtual_stages
    units = stage_units(model.config.num_hidden_layers, n_stages)
    stage_ids = [rank + k * size for k in range(virtual_stages)]
    modules = nn.ModuleList([make_stage(model, units[s]) for s in stage_ids])
    stages = [PipelineStage(module, s, n_stages, device, group=group) for module, s in zip(modules, stage_ids)]
    pipeline = Pipeline(modules, stages, group, rank, size, n_stages, stage_ids, [units[s] for s in stage_ids],
                        n_microbatches, virtual_stages, hf_names)
    pipeline.schedule = _schedule(schedule, stages, n_microbatches, pipeline.loss)
    return pipeline


def _schedule(name: str, stages: list[PipelineStage], n_microbatches: int, loss_fn):
    if name == "interleaved":  # the looped schedule takes all of this rank's stages
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn)
    return SCHEDULES[name](stages[0], n_microbatches, loss_fn=loss_fn)
