"""Pipeline parallelism: GPT-NeoX cut into stages by hand (`stages`, the cut of
`shardlab.costs.shapes.stage_units`), run by torch.distributed.pipelining's GPipe, 1F1B and
interleaved 1F1B schedules (`pipeline`), and replicated over data parallelism (`hybrid_dp_pp`)."""

from __future__ import annotations

from shardlab.strategies.pipeline_parallel.options import DEFAULT_MICROBATCHES, checker, pipeline_size
from shardlab.strategies.spec import Family, StrategySpec

TOPIC = "pipeline"


def micro_batches(options: dict) -> int:
    return int(options.get("n_microbatches", DEFAULT_MICROBATCHES))


def _plan(schedule: str, virtual_stages: int, hybrid: bool):
    """(dp, pp) mesh, schedule, chunks per rank, and the micro-batches per step (from which the Plan's
    rows per micro-batch follow)."""
    def plan(world: int, options: dict) -> dict:
        pp = pipeline_size(world, options, hybrid)
        return {"dp": world // pp, "pp": pp, "schedule": schedule, "virtual_stages": virtual_stages,
                "micro_batches": micro_batches(options)}

    return plan


def _spec(name: str, cls: str, family: Family, summary: str, virtual_stages: int = 1, hybrid: bool = False,
          schedule: str = "1f1b") -> StrategySpec:
    module = "hybrid_dp_pp" if hybrid else "strategy"
    # The options behind the Plan fields a rejection names: the micro-batches, and the hybrid's stage count.
    stages = (("pp", "pp_size"), ("dp", "pp_size"), ("world", "pp_size")) if hybrid else ()
    plan_options = (("micro_batch", "n_microbatches"), *stages)
    return StrategySpec(name, f"shardlab.strategies.pipeline_parallel.{module}:{cls}", family, TOPIC, summary,
                        plan=_plan(schedule, virtual_stages, hybrid), check_options=checker(hybrid),
                        plan_options=plan_options,
                        comm_timed_in_full=not hybrid)  # the hybrid times its dp all-reduce, not the sends


SPECS = [
    _spec("pp_gpipe", "GPipeStrategy", Family.PIPELINE_PARALLEL,
          "Hand-cut stages, torch.distributed.pipelining GPipe: all forwards, then all backwards.",
          schedule="gpipe"),
    _spec("pp_1f1b", "OneFOneBStrategy", Family.PIPELINE_PARALLEL,
          "Hand-cut stages, 1F1B schedule: one forward, one backward; fewer micro-batches in flight."),
    _spec("pp_interleaved", "InterleavedStrategy", Family.PIPELINE_PARALLEL,
          "Interleaved 1F1B: two looped virtual stages per rank, a smaller bubble for more sends.",
          virtual_stages=2, schedule="interleaved"),
    _spec("hybrid_dp_pp", "HybridDataPipeline", Family.HYBRID,
          "2-D mesh (pp, dp): 1F1B pipelines replicated over dp, stage gradients all-reduced over dp.", hybrid=True),
]
