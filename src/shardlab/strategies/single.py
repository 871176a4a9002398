"""Single device: the reference. Everything is the default behaviour of `Strategy`."""

from shardlab.strategies.base import Strategy


class SingleDevice(Strategy):
    dp_rank, dp_size = 0, 1  # one process holds the whole global batch
