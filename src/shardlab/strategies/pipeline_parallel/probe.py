"""What a pipeline run measures beyond the shared loop: per-stage busy time and live activations,
recorded by `PipelineProbe`, which wraps a built pipeline and the step that runs it.

- `OpTimeline`: start/end of every forward, loss and backward op a rank computes during a schedule
  step, relative to the step's start (all ranks start together after a barrier). Idle time is the
  step span minus busy time: the bubble, plus the waits on send/recv.
- `LiveSavedBytes`: bytes autograd holds saved for backward, tracked over the whole schedule with
  saved_tensors_hooks: a storage counts from its first pack until the graph that saved it is freed
  (after that micro-batch's backward). Its peak is what a stage really has to hold: GPipe keeps all
  m micro-batches' activations, 1F1B only those in flight (up to p on the first stage, 1 on the last).
  `total` sums every storage saved during the step (a storage freed by a backward and reused later
  counts again), i.e. what the step saves in all; the loop's ActivationProbe, which keeps no
  reference, can miss storages reused after a free, so it undercounts under 1F1B.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

#: Steps whose op timeline and live saved bytes are recorded (medians over them): the untimed warm-up
#: steps after step 0, topped up with extra untimed steps after training when warm-up has fewer.
MEASURED_STEPS = 5


class OpTimeline:
    """Per-step lists of (op, stage, micro-batch, start_s, end_s) while `recording` is on."""

    def __init__(self):
        self.recording = False
        self.steps: list[dict] = []  # {"ops": [...], "end_s": float}
        self._t0 = 0.0

    def begin_step(self) -> None:
        self._t0 = time.perf_counter()
        self.steps.append({"ops": [], "end_s": None})

    def end_step(self) -> None:
        self.steps[-1]["end_s"] = time.perf_counter() - self._t0

    def timed(self, op: str, stage: int, micro: int, fn, *args, **kwargs):
        if not self.recording:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.steps[-1]["ops"].append((op, stage, micro, start - self._t0, time.perf_counter() - self._t0))

    def busy_s(self, step: dict) -> float:
        return sum(end - start for _, _, _, start, end in step["ops"])


class _Saved:
    """What autograd stores instead of a saved tensor; its deletion marks the tensor's release."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor, key, tracker):
        self.tensor, self.key, self.tracker = tensor, key, tracker

    def __del__(self):
        self.tracker._release(self.key)


class LiveSavedBytes:
    """Peak bytes saved for backward and not yet released, deduplicated by storage; parameters excluded,
    in the form they have when saved (FSDP2 gathers a stage's weights into fresh storages for its forward)."""

    def __init__(self, module):
        self.module = module
        self.refs: dict[int, list[int]] = {}  # storage key -> [references held by graphs, bytes]
        self.live = 0
        self.peak = 0
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key in self.parameter_keys():
            return t
        entry = self.refs.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self.refs[key] = [1, nbytes]
            self.live += nbytes
            self.total += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        return _Saved(t, key, self)

    def parameter_keys(self) -> set[int]:
        """The storages of the module's parameters now (a DTensor's by its local shard)."""
        return {getattr(p, "_local_tensor", p).untyped_storage()._cdata for p in self.module.parameters()}

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def time_chunks(stage: PipelineStage, timeline: OpTimeline) -> None:
    """Wrap a built stage so that each forward and backward chunk it computes is timestamped."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
    stage.forward_one_chunk = lambda chunk, *args, **kwargs: timeline.timed(
        "forward", stage.stage_index, chunk, forward, chunk, *args, **kwargs)
    stage.backward_one_chunk = lambda chunk, *args, **kwargs: timeline.timed(
        "backward", stage.stage_index, chunk, backward, chunk, *args, **kwargs)


class PipelineProbe:
    """Wraps a built `pipeline.Pipeline` and the step that runs it, and records, on untimed steps only,
    the rank's op timeline and live saved bytes; `metrics` reports the medians over them: the warm-up
    steps after the probe step, topped up to MEASURED_STEPS with extra steps after training. Timed
    steps run the bare schedule, so a pipeline's step time compares fairly with every other strategy's.
    A barrier aligns the stages' clocks at the start of each measured step.

    The strategy that holds it routes its calls through it: `step` for each training step (`run_step(inputs,
    labels)` runs the schedule once), `evaluated` before a validation, `resume_at` after a checkpoint."""

    def __init__(self, pipeline, run_step, warmup_steps: int):
        self.pipeline, self.run_step, self.warmup_steps = pipeline, run_step, warmup_steps
        self.timeline = OpTimeline()
        for stage in pipeline.stages:
            time_chunks(stage, self.timeline)
        loss_fn = pipeline.loss_fn
        pipeline.loss_fn = lambda logits, labels: self.timeline.timed("loss", pipeline.n_stages - 1, -1, loss_fn,
                                                                      logits, labels)
        self.calls = 0  # schedule steps run: the loop's step index (the schedule takes one whole batch per step)
        self.probe_step = 0  # the loop's activation-probe step (0, or the first step after a resume)
        self.live_peaks: list[int] = []
        self.saved_totals: list[int] = []
        self.instrumented_steps: list[int] = []  # loop step indices (>= training.steps: extra steps)
        self.after_eval = False  # the last schedule call was an evaluation
        self.last_batch = None

    def resume_at(self, step: int) -> None:
        self.calls = self.probe_step = step

    def evaluated(self) -> None:
        self.after_eval = True

    def _instruments(self, step: int) -> bool:
        """Instrument only untimed steps: the warm-up steps after the probe step (the loop's ActivationProbe
        uses it, and saved-tensor hooks do not nest). Not a step right after an evaluation: switching the
        schedule from eval back to training re-runs its set-up (P2P warm-up, shape inference) inside that
        step, adding idle time and saved bytes."""
        return self.probe_step < step < self.warmup_steps and not self.after_eval

    def step(self, inputs, labels):
        """One training step of the loop, through the wrapped `run_step`."""
        step = self.calls
        self.calls += 1
        self.last_batch = (inputs, labels)
        return self._run(inputs, labels, instrumented=self._instruments(step), step=step)

    def _run(self, inputs, labels, instrumented: bool, step: int):
        """One schedule step; when `instrumented`, record its op timeline and live saved bytes."""
        self.after_eval = False
        if not instrumented:
            return self.run_step(inputs, labels)
        tracker = LiveSavedBytes(self.pipeline.modules)
        dist.barrier(group=self.pipeline.group)  # stages start the step together: timestamps share an origin
        self.timeline.begin_step()
        self.timeline.recording = True
        try:
            with tracker:
                loss = self.run_step(inputs, labels)
        finally:
            self.timeline.recording = False
        self.timeline.end_step()
        self.live_peaks.append(tracker.peak)
        self.saved_totals.append(tracker.total)
        self.instrumented_steps.append(step)
        return loss

    def measure_after_training(self, zero_grad) -> None:
        """Top the warm-up measurements up to MEASURED_STEPS with extra schedule steps on the last batch
        after training (forward and backward only: no optimizer step, gradients dropped by `zero_grad`;
        untimed, and after the loop has read peak memory)."""
        missing = MEASURED_STEPS - len(self.instrumented_steps)
        if missing <= 0 or self.last_batch is None:
            return
        steps = [self.calls + k for k in range(missing + self.after_eval)]
        for k, step in enumerate(steps):  # after the final evaluation, one bare step re-sets up the schedule
            self._run(*self.last_batch, instrumented=k >= len(steps) - missing, step=step)
            zero_grad()

    def metrics(self) -> dict:
        """The medians over the measured steps (collective over the pipeline group); {} if none."""
        steps = self.timeline.steps
        if not steps:
            return {}
        # A step lasts until the slowest stage finishes; idle = span - this rank's compute.
        spans = torch.tensor([s["end_s"] for s in steps], dtype=torch.float64)
        dist.all_reduce(spans, op=dist.ReduceOp.MAX, group=self.pipeline.group)
        busy = [self.timeline.busy_s(s) for s in steps]
        idle = [span - b for span, b in zip(spans.tolist(), busy)]
        last = steps[-1]
        return dict(
            pp_measured_steps=len(steps),
            pp_instrumented_steps=list(self.instrumented_steps),
            pp_step_span_s=statistics.median(spans.tolist()),
            pp_busy_s=statistics.median(busy),
            pp_idle_fraction=statistics.median(i / s for i, s in zip(idle, spans.tolist())),
            pp_bubble_ratio=statistics.median(i / b for i, b in zip(idle, busy)),
            pp_peak_live_activation_bytes=max(self.live_peaks),
            pp_saved_activation_bytes=max(self.saved_totals),
            # One step's ops (for a timeline chart): [op, stage, micro-batch, start_s, end_s].
            pp_timeline=[[op, stage, mb, round(a, 6), round(b, 6)] for op, stage, mb, a, b in last["ops"]],
            pp_timeline_span_s=float(spans[-1]),
        )
