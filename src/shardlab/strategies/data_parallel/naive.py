"""Naive data parallelism: full forward and backward, then ONE blocking all-reduce of all gradients.

Communication never overlaps computation: the whole gradient all-reduce sits on the critical path
after backward. This is the baseline the study's overlapped variants are measured against.
"""

from shardlab.strategies.base import Strategy
from shardlab.strategies.data_parallel.comms import GradientBucket


class NaiveDataParallel(Strategy):
    measures_comm = True

    def wrap(self, model):
        self._bucket = GradientBucket("all", [p for p in model.parameters() if p.requires_grad])
        return model

    def sync_gradients(self) -> None:
        self.average_replica_gradients()

    def average_replica_gradients(self) -> None:
        with self.comm.blocked():
            self._bucket.launch(async_op=False)
            self._bucket.finish(self.dp_size)
