"""The composed plan's run: one named mesh from the Plan (`(dp, tp)`, tp innermost so that a tensor-parallel
group sits inside a node), the hand-written TP (+SP) inside each `tp` group, and the data-parallel
replicas' gradients averaged over `dp`: every parameter is replicated over exactly the dp ranks, so
that is the only dimension its gradient is reduced over (SP's partial LayerNorm gradients are summed
over `tp` first, as in `tp_sp`)."""

from __future__ import annotations

from shardlab.strategies import get_spec
from shardlab.strategies.mesh import MeshDataParallel
from shardlab.strategies.tensor_parallel.tensor_parallel import HandTensorParallel


class ComposedPlan(MeshDataParallel, HandTensorParallel):
    def wrap(self, model):
        fields = get_spec(self.name).plan_fields(self.topo.world_size, self.options)
        self.mesh = self.topo.mesh(dp=fields["dp"], tp=fields["tp"])
        self.sequence_parallel = fields["sp"]
        return super().wrap(model)

    def tp_group(self):
        return self.mesh["tp"].get_group()

    def state_namespace(self):
        return f"dp{self.dp_rank}_tp{self.mesh['tp'].get_local_rank()}"

    def sync_gradients(self) -> None:
        super().sync_gradients()  # SP's partial sums over tp
        self.average_over_dp()
