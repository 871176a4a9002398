"""Independent jobs of one rule over the cores the rule was given (its `threads`)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor


def ordered_map(fn, jobs: list, workers: int, initializer=None) -> list:
    """`[fn(job) for job in jobs]`, in this process when `workers` < 2 (or one job), else in up to `workers`
    forked processes, each started by `initializer`. Fork: the workers inherit what this process has
    imported; fork only before this process runs a torch op, so that no thread pool is copied half-alive."""
    if workers < 2 or len(jobs) < 2:
        return [fn(job) for job in jobs]
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context, initializer=initializer) as pool:
        return list(pool.map(fn, jobs))
