"""A first hybrid: data parallel x pipeline parallel on a 2-D device mesh (dp, pp).

The composition is explicit. The mesh's `pp` dimension gives each data-parallel replica its own
pipeline (1F1B over `pp` ranks, from `strategy.py`); the `dp` dimension links the ranks that hold
the same stage in different replicas. Each replica trains on its own rows of the global batch;
after the schedule, each stage's gradients are averaged over its `dp` group (one blocking
all-reduce of a flat buffer, as naive DP does) before every rank steps its optimizer.
"""

from __future__ import annotations

from shardlab.strategies.mesh import average_gradients
from shardlab.strategies.pipeline_parallel.strategy import OneFOneBStrategy
from shardlab.strategies.pipeline_parallel.options import DEFAULT_HYBRID_PP


class HybridDataPipeline(OneFOneBStrategy):
    measures_comm = True  # the data-parallel all-reduce; pipeline sends happen inside the schedule

    def pipeline_group(self):
        pp = int(self.options.get("pp_size", DEFAULT_HYBRID_PP))
        self.mesh = self.topo.mesh(pp=pp, dp=self.topo.world_size // pp)  # Megatron order: dp inside pp
        self.replicas = self.mesh["dp"]  # the ranks that hold the same stages: dp rank and size come from it
        return self.mesh["pp"].get_group(), self.mesh["pp"].get_local_rank(), pp

    def sync_gradients(self) -> None:
        self.average_replica_gradients()

    def average_replica_gradients(self) -> None:
        """The replicas' gradients averaged over dp, timed as communication."""
        average_gradients(self.model.parameters(), self.replicas, self.comm)

    def extra_metrics(self) -> dict:
        return dict(super().extra_metrics(), dp_rank=self.dp_rank, dp_size=self.dp_size, pp_rank=self.pipeline.rank)
