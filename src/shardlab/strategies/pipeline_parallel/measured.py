"""The registered pipeline strategies: each schedule of `pipeline.py` with the pipeline probe of
`probe.py` around it (bubble and per-stage memory measured on untimed steps)."""

from __future__ import annotations

from shardlab.strategies.pipeline_parallel.probe import PipelineProbe
from shardlab.strategies.pipeline_parallel.pipeline import GPipe, Interleaved1F1B, OneForwardOneBackward


class MeasuredGPipe(PipelineProbe, GPipe):
    """GPipe, measured."""


class Measured1F1B(PipelineProbe, OneForwardOneBackward):
    """1F1B, measured."""


class MeasuredInterleaved1F1B(PipelineProbe, Interleaved1F1B):
    """Interleaved 1F1B, measured."""
