"""Interleaved (overlapped) data parallelism, hand-written.

Each transformer layer's gradients are all-reduced with a non-blocking collective as soon as
backward has produced all of them (`register_post_accumulate_grad_hook`), so communication for
layer L overlaps the backward of layers L-1..0. The optimizer step waits for all of them.
Option `bucket_mb` merges consecutive layers into buckets of up to that many MiB (fewer, larger
collectives, as DDP's buckets; `comms.size_buckets`); without it, one bucket per layer (the study's).
Communication time recorded here is the time blocked in those waits, i.e. what overlap did not hide.
"""

import contextlib

from shardlab.strategies.base import Strategy
from shardlab.strategies.data_parallel.comms import size_buckets


class InterleavedDataParallel(Strategy):
    measures_comm = True

    def wrap(self, model):
        self._buckets = size_buckets(model, self.options.get("bucket_mb"))
        self._pending: dict[int, int] = {}
        self._sync_this_backward = True
        for index, bucket in enumerate(self._buckets):
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._grad_ready_hook(index))
        return model

    def _grad_ready_hook(self, index: int):
        bucket = self._buckets[index]

        def hook(_param):
            if self._sync_this_backward:
                self.bucket_ready(index, bucket)

        return hook

    def bucket_ready(self, index: int, bucket) -> None:
        """One more of the bucket's gradients is ready: launch its all-reduce once all of them are."""
        ready = self._pending.get(index, 0) + 1
        if ready == len(bucket.params):
            bucket.launch(async_op=True)  # overlaps with the rest of backward
            ready = 0
        self._pending[index] = ready

    @contextlib.contextmanager
    def accumulating(self, last: bool):
        # Only the last micro-batch's backward launches all-reduces; earlier ones just accumulate.
        self._sync_this_backward = last
        try:
            yield
        finally:
            self._sync_this_backward = True

    def sync_gradients(self) -> None:
        self.average_replica_gradients()

    def average_replica_gradients(self) -> None:
        with self.comm.blocked():
            for bucket in self._buckets:
                if bucket.work is None:
                    raise RuntimeError(f"gradient bucket {bucket.name} was never launched; did every parameter get a gradient?")
                bucket.finish(self.dp_size)
        self._pending.clear()
