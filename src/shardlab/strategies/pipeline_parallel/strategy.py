"""The registered pipeline strategies: a pipeline of `pipeline.py` over the whole world, run by the
shared loop, with the probe of `probe.py` wrapping its step (bubble and per-stage memory measured on
untimed steps). One class per schedule; the dp x pp hybrid (`hybrid_dp_pp.py`) extends the first."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlab.strategies.base import Strategy
from shardlab.strategies.portable import as_held
from shardlab.strategies.pipeline_parallel.options import DEFAULT_MICROBATCHES
from shardlab.strategies.pipeline_parallel.pipeline import build_pipeline
from shardlab.strategies.pipeline_parallel.probe import PipelineProbe


class GPipeStrategy(Strategy):
    """GPipe: all micro-batches forward, then all backward; every stage holds m micro-batches' activations."""

    schedule_name = "gpipe"
    virtual_stages = 1
    replicas = None  # the 1-D mesh of this pipeline's data-parallel replicas (None: every rank sees the whole batch)

    def pipeline_group(self):
        """(process group, this rank's position in the pipeline, pipeline length): the whole world."""
        return None, self.topo.rank, self.topo.world_size

    @property
    def dp_rank(self) -> int:
        return 0 if self.replicas is None else self.replicas.get_local_rank()

    @property
    def dp_size(self) -> int:
        return 1 if self.replicas is None else self.replicas.size()

    def wrap(self, model):
        group, rank, size = self.pipeline_group()
        self.pipeline = build_pipeline(model, group, rank, size, self.schedule_name, self.virtual_stages,
                                       int(self.options.get("n_microbatches", DEFAULT_MICROBATCHES)), self.topo.device)
        self.probe = PipelineProbe(self.pipeline, self._schedule_step, self.training["warmup_steps"])
        return self.pipeline.modules

    # --- one step: the probe wraps the schedule's step -----------------------------------
    def micro_batches(self, inputs, labels):
        return [(inputs, labels)]  # the schedule cuts micro-batches itself

    def _schedule_step(self, inputs, labels):
        return self.pipeline.step(inputs, labels, self.autocast())

    def forward_backward(self, inputs, labels, scale):
        return self.probe.step(inputs, labels)

    def evaluate(self, inputs, labels):
        self.probe.evaluated()
        return self.pipeline.evaluate(inputs, labels, self.autocast())

    def reduce_losses(self, losses):
        """Every rank gets the global mean losses: the last stage of each data-parallel replica holds its
        replica's means, the other ranks contribute zeros, and the sum over the world is divided by dp."""
        losses = losses.detach().float().clone() if self.pipeline.holds_last \
            else torch.zeros_like(losses, dtype=torch.float32)
        dist.all_reduce(losses)
        return losses / self.dp_size

    # --- checkpoints and results ----------------------------------------------------------
    def resume_at(self, step):
        self.probe.resume_at(step)

    holds_every_parameter = False  # each rank its stages

    def held_parameters(self):
        return [as_held(self.pipeline.hf_names[id(p)], p) for p in self.pipeline.modules.parameters()]

    def extra_metrics(self) -> dict:
        self.probe.measure_after_training(self.zero_grad)
        return {**self.pipeline.metrics(), **self.probe.metrics()}


class OneFOneBStrategy(GPipeStrategy):
    """1F1B: after a warm-up of forwards, each stage alternates one forward and one backward, so stage s
    holds at most p - s micro-batches' activations (same bubble as GPipe)."""

    schedule_name = "1f1b"


class InterleavedStrategy(GPipeStrategy):
    """Interleaved 1F1B: each rank holds `virtual_stages` non-adjacent stages, shrinking the bubble v-fold."""

    schedule_name = "interleaved"
    virtual_stages = 2
