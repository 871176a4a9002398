"""Single device: the reference. Everything is the default behaviour of `Strategy`."""

from shardlab.strategies.base import Strategy


class SingleDevice(Strategy):
    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1
