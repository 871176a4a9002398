"""What a pipeline run measures beyond the shared loop: per-stage busy time and live activations.

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

import time

import torch


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
    """Peak bytes saved for backward and not yet released, deduplicated by storage; parameters excluded."""

    def __init__(self, params):
        self.exclude = {p.untyped_storage()._cdata for p in params}
        self.refs: dict[int, list[int]] = {}  # storage key -> [references held by graphs, bytes]
        self.live = 0
        self.peak = 0
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key in self.exclude:
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
