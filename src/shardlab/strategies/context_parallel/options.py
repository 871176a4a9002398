"""Option names of `cp_ring` (torch-free: the Snakefile validates configs before any run). The
sequence's zig-zag split (2 x cp equal chunks) is its Plan's question (`costs.plan.rejection`)."""

from __future__ import annotations

from shardlab.strategies.spec import only_options

check_cp_options = only_options()
