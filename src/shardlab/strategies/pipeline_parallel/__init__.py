"""Pipeline parallelism: GPT-NeoX cut into stages by hand (`stages`, the cut of
`shardlab.costs.shapes.stage_units`), run by torch.distributed.pipelining's GPipe, 1F1B and
interleaved 1F1B schedules (`pipeline`), and replicated over data parallelism (`hybrid_dp_pp`)."""

from __future__ import annotations

from shardlab.costs.comm_volume import hybrid_data_pipeline, pipeline_parallel
from shardlab.costs.memory import unsharded
from shardlab.costs.shapes import pipeline_rank_parameters
from shardlab.strategies.pipeline_parallel.options import (DEFAULT_MICROBATCHES, checker, data_parallel_size,
                                                           pipeline_size)
from shardlab.strategies.spec import StrategySpec

TOPIC = "pipeline"


def micro_batches(options: dict) -> int:
    return int(options.get("n_microbatches", DEFAULT_MICROBATCHES))


def _states(virtual_stages: int, hybrid: bool):
    def states(model, world, options, dtype, optimizer):
        pp = pipeline_size(world, options, hybrid)
        per_stage_rank = pipeline_rank_parameters(model, pp, virtual_stages)
        return [unsharded(per_stage_rank[rank % pp], dtype, optimizer) for rank in range(world)]  # mesh (dp, pp)

    return states


def _pipeline_plan(model, step, world, options):
    return pipeline_parallel(model, step, world, micro_batches(options))


def _hybrid_plan(model, step, world, options):
    pp = pipeline_size(world, options, hybrid=True)
    return hybrid_data_pipeline(model, step, world // pp, pp, micro_batches(options))


def _layout(schedule: str, virtual_stages: int, hybrid: bool):
    """The planner's view: (dp, pp) mesh, schedule, and the micro-batches per step (`micro_batches`,
    which the planner turns into rows per micro-batch)."""
    def layout(world: int, options: dict) -> dict:
        pp = pipeline_size(world, options, hybrid)
        return {"dp": world // pp, "pp": pp, "schedule": schedule, "virtual_stages": virtual_stages,
                "micro_batches": micro_batches(options)}

    return layout


def _spec(name: str, cls: str, family: str, summary: str, virtual_stages: int = 1, hybrid: bool = False,
          needs_m_ge_stages: bool = True, schedule: str = "1f1b") -> StrategySpec:
    module = "hybrid_dp_pp" if hybrid else "pipeline"
    return StrategySpec(name, f"shardlab.strategies.pipeline_parallel.{module}:{cls}", family, TOPIC, summary,
                        _hybrid_plan if hybrid else _pipeline_plan, _states(virtual_stages, hybrid),
                        data_parallel_size=data_parallel_size(hybrid),
                        check_options=checker(virtual_stages, needs_m_ge_stages, virtual_stages > 1, hybrid),
                        comm_timed_in_full=not hybrid,  # the hybrid times its dp all-reduce, not the sends
                        layout=_layout(schedule, virtual_stages, hybrid))


SPECS = [
    _spec("pp_gpipe", "PipelineParallel", "pipeline parallel",
          "Hand-cut stages, torch.distributed.pipelining GPipe: all forwards, then all backwards.",
          needs_m_ge_stages=False, schedule="gpipe"),
    _spec("pp_1f1b", "OneForwardOneBackward", "pipeline parallel",
          "Hand-cut stages, 1F1B schedule: one forward, one backward; fewer micro-batches in flight."),
    _spec("pp_interleaved", "InterleavedPipeline", "pipeline parallel",
          "Interleaved 1F1B: two looped virtual stages per rank, a smaller bubble for more sends.",
          virtual_stages=2, needs_m_ge_stages=False, schedule="interleaved"),
    _spec("hybrid_dp_pp", "HybridDataPipeline", "hybrid",
          "2-D mesh (dp, pp): 1F1B pipelines replicated over dp, stage gradients all-reduced over dp.", hybrid=True),
]
