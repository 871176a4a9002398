"""Pipeline parallelism with torch.distributed.pipelining: GPipe, 1F1B and interleaved 1F1B.

Each rank holds one stage (or `virtual_stages` of them, looped: rank r holds stages r, r+p, ...)
of the hand-cut model (`stages.py`). The strategy owns micro-batching: the loop hands it the
whole local batch, and `schedule.step` splits it into `n_microbatches`, runs forward/backward in
the schedule's order and sends activations/gradients between neighbours (point-to-point, gloo or
nccl). Each micro-batch's loss is a mean and the schedule divides gradients by the number of
micro-batches (`scale_grads=True`), so gradients equal the whole-batch mean gradients.

Every rank sees the whole local batch: the first stage reads the tokens, the last the labels.
Only the last stage knows the loss; `reduce_losses` shares it with every rank.

Measurement (`measure.py`: op timeline, live saved bytes, and the barrier that aligns the stages'
clocks) runs only on steps the loop does not time: the warm-up steps after step 0, topped up to
`MEASURED_STEPS` with extra steps after training. Timed steps run the bare schedule, so a pipeline's
step time compares fairly with every other strategy's.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from shardlab.strategies.base import Strategy, causal_lm_loss
from shardlab.strategies.pipeline_parallel.measure import LiveSavedBytes, OpTimeline
from shardlab.strategies.pipeline_parallel.options import DEFAULT_MICROBATCHES
from shardlab.costs.shapes import stage_units
from shardlab.strategies.pipeline_parallel.stages import NeoXStage

#: Steps whose op timeline and live saved bytes are recorded (medians over them): the untimed warm-up
#: steps after step 0, topped up with extra untimed steps after training when warm-up has fewer.
MEASURED_STEPS = 5


class TimedStage(PipelineStage):
    """A PipelineStage that timestamps each forward and backward chunk it computes."""

    def __init__(self, *args, timeline: OpTimeline, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeline = timeline

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self.timeline.timed("forward", self.stage_index, fwd_chunk_id,
                                   super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        return self.timeline.timed("backward", self.stage_index, bwd_chunk_id,
                                   super().backward_one_chunk, bwd_chunk_id, *args, **kwargs)


class PipelineParallel(Strategy):
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
        self.pp_group, self.pp_rank, self.pp_size = self.pipeline_group()
        self.n_microbatches = int(self.options.get("n_microbatches", DEFAULT_MICROBATCHES))
        self.n_stages = self.pp_size * self.virtual_stages
        units = stage_units(model.config.num_hidden_layers, self.n_stages)
        self.stage_ids = [self.pp_rank + k * self.pp_size for k in range(self.virtual_stages)]
        self.stage_units = [units[s] for s in self.stage_ids]
        self.holds_first = 0 in self.stage_ids
        self.holds_last = self.n_stages - 1 in self.stage_ids
        self.timeline = OpTimeline()
        modules = [self.make_stage(model, units[s]) for s in self.stage_ids]
        stages = [TimedStage(module, s, self.n_stages, self.topo.device, group=self.pp_group, timeline=self.timeline)
                  for module, s in zip(modules, self.stage_ids)]
        self.schedule = self.build_schedule(stages)
        self._calls = 0  # schedule steps run: the loop's step index (the schedule takes one whole batch per step)
        self._probe_step = 0  # the loop's activation-probe step (0, or the first step after a resume)
        self._live_peaks: list[int] = []
        self._saved_totals: list[int] = []
        self._instrumented_steps: list[int] = []  # loop step indices (>= training.steps: extra steps)
        self._after_eval = False  # the last schedule call was an evaluation
        return nn.ModuleList(modules)

    def make_stage(self, model, units: list) -> NeoXStage:
        return NeoXStage(model, units)

    def state_namespace(self):
        return f"stage_rank{self.pp_rank}"  # this rank's stages; data-parallel replicas of them share it

    def resume_at(self, step):
        self._calls = self._probe_step = step

    def build_schedule(self, stages):
        return self.schedule_class(stages[0], self.n_microbatches, loss_fn=self._timed_loss)

    def _timed_loss(self, logits, labels):
        return self.timeline.timed("loss", self.n_stages - 1, -1, causal_lm_loss, logits, labels)

    # --- one step -----------------------------------------------------------------------
    def micro_batches(self, inputs, labels):
        return [(inputs, labels)]  # the schedule cuts micro-batches itself

    def _schedule_args(self, inputs, labels):
        return ((inputs,) if self.holds_first else ()), (labels if self.holds_last else None)

    def forward_backward(self, inputs, labels, scale):
        step = self._calls
        self._calls += 1
        self._last_batch = (inputs, labels)
        return self._run_schedule(inputs, labels, instrumented=self._instruments(step), step=step)

    def _instruments(self, step: int) -> bool:
        """Instrument only untimed steps: the warm-up steps after the probe step (the loop's ActivationProbe
        uses it, and saved-tensor hooks do not nest). Timed steps run exactly like every other strategy's.
        Not a step right after an evaluation: switching the schedule from eval back to training re-runs
        its set-up (P2P warm-up, shape inference) inside that step, adding idle time and saved bytes."""
        return self._probe_step < step < self.training["warmup_steps"] and not self._after_eval

    def _run_schedule(self, inputs, labels, instrumented: bool, step: int) -> torch.Tensor:
        """One schedule step; when `instrumented`, record its op timeline and live saved bytes."""
        args, target = self._schedule_args(inputs, labels)
        losses: list[torch.Tensor] = []
        tracker = LiveSavedBytes(self.model.parameters()) if instrumented else contextlib.nullcontext()
        if instrumented:
            dist.barrier(group=self.pp_group)  # stages start the step together: timestamps share an origin
            self.timeline.begin_step()
        self.timeline.recording = instrumented
        try:
            with tracker, self.autocast():  # bf16: every stage's forward under autocast, as one device runs
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        finally:
            self.timeline.recording = False
        self._after_eval = False
        if instrumented:
            self.timeline.end_step()
            self._live_peaks.append(tracker.peak)
            self._saved_totals.append(tracker.total)
            self._instrumented_steps.append(step)
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())

    def _measure_after_training(self) -> None:
        """Top the warm-up measurements up to MEASURED_STEPS with extra schedule steps on the last batch
        after training (forward and backward only: no optimizer step, gradients dropped; untimed, and
        after the loop has read peak memory)."""
        missing = MEASURED_STEPS - len(self._instrumented_steps)
        if missing <= 0 or not hasattr(self, "_last_batch"):
            return
        steps = [self._calls + k for k in range(missing + self._after_eval)]
        for k, step in enumerate(steps):  # after the final evaluation, one bare step re-sets up the schedule
            self._run_schedule(*self._last_batch, instrumented=k >= len(steps) - missing, step=step)
            self.zero_grad()

    @torch.no_grad()
    def evaluate(self, inputs, labels):
        args, target = self._schedule_args(inputs, labels)
        losses: list[torch.Tensor] = []
        with self.autocast():
            self.schedule.eval(*args, target=target, losses=losses)
        self._after_eval = True
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def reduce_losses(self, losses):
        """Every rank gets the global mean losses: the last stage of each data-parallel replica holds its
        replica's means, the other ranks contribute zeros, and the sum over the world is divided by dp."""
        losses = losses.detach().float().clone() if self.holds_last else torch.zeros_like(losses, dtype=torch.float32)
        dist.all_reduce(losses)
        return losses / self.dp_size

    # --- measurement --------------------------------------------------------------------
    def extra_metrics(self) -> dict:
        self._measure_after_training()
        steps = self.timeline.steps
        out = {"pp_schedule": type(self.schedule).__name__, "pp_size": self.pp_size,
               "pp_virtual_stages": self.virtual_stages, "pp_n_microbatches": self.n_microbatches,
               "pp_stage_ids": self.stage_ids, "pp_stage_units": [[str(u) for u in us] for us in self.stage_units]}
        if not steps:
            return out
        # A step lasts until the slowest stage finishes; idle = span - this rank's compute.
        spans = torch.tensor([s["end_s"] for s in steps], dtype=torch.float64)
        dist.all_reduce(spans, op=dist.ReduceOp.MAX, group=self.pp_group)
        busy = [self.timeline.busy_s(s) for s in steps]
        idle = [span - b for span, b in zip(spans.tolist(), busy)]
        last = steps[-1]
        out.update(
            pp_measured_steps=len(steps),
            pp_instrumented_steps=list(self._instrumented_steps),
            pp_step_span_s=statistics.median(spans.tolist()),
            pp_busy_s=statistics.median(busy),
            pp_idle_fraction=statistics.median(i / s for i, s in zip(idle, spans.tolist())),
            pp_bubble_ratio=statistics.median(i / b for i, b in zip(idle, busy)),
            pp_peak_live_activation_bytes=max(self._live_peaks),
            pp_saved_activation_bytes=max(self._saved_totals),
            # One step's ops (for a timeline chart): [op, stage, micro-batch, start_s, end_s].
            pp_timeline=[[op, stage, mb, round(a, 6), round(b, 6)] for op, stage, mb, a, b in last["ops"]],
            pp_timeline_span_s=float(spans[-1]),
        )
        return out


class OneForwardOneBackward(PipelineParallel):
    """1F1B: after a warm-up of forwards, each stage alternates one forward and one backward, so stage s
    holds at most p - s micro-batches' activations (same bubble as GPipe)."""

    schedule_class = Schedule1F1B


class InterleavedPipeline(PipelineParallel):
    """Interleaved 1F1B: each rank holds `virtual_stages` non-adjacent stages, shrinking the bubble v-fold."""

    virtual_stages = 2

    def build_schedule(self, stages):
        return ScheduleInterleaved1F1B(stages, self.n_microbatches, loss_fn=self._timed_loss)
