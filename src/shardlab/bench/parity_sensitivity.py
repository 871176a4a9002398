"""How small an error the parity check catches: errors injected on purpose into correct strategies,
each to be held against its reference by the rule of `tables.parity`, per dtype.

    python -m shardlab parity-sensitivity --experiment-config results/E/experiment.json \
        --model-dir M --tokens T --out parity_sensitivity_losses.csv [--dtypes fp32,bf16]

launches one `torchrun` job of 2 ranks (this module with `--worker`) that trains, for each dtype, on
the experiment's model, data and training settings through the study's own loop (`runner.loop.train`):
the reference and its reordered repeat (the noise floor), the correct data-parallel, tensor-parallel
and pipeline strategies, and the same strategies with one error each:

- gradients summed over the ranks instead of averaged (the mean gradient doubled);
- rank 1's gradient scaled by 1 + e before the average, e = 1 % and 0.1 % (e/2 of the mean; the
  second is a probe below what the check is meant to catch: either outcome is information);
- tensor parallelism with one layer's all-reduce skipped: the one after layer 0's row-parallel MLP
  output (Megatron's g), so each rank goes on with its own shard's partial sum;
- a pipeline that drops the last micro-batch's gradient (its loss is still reported).

The errors are applied from outside the strategies (a wrapped backward scale, a replaced forward, a
replaced loss function), so no technique carries test code. The output is every case's loss per step
(a failed launch: one row per dtype with status 'failed' and its reason; failure is data);
`tables.parity.sensitivity_rows` judges each case by the parity rule. Give the experiment SGD: Adam's
normalisation hides a uniform gradient scale.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from shardlab import cli
from shardlab.bench.driver import bench_parser, run_worker, write_rows
from shardlab.runner.failures import record
from shardlab.strategies import REGISTRY, Family
from shardlab.strategies.roles import hand_written_data_parallel, reference_of, tp_pair

WORLD = 2
MICROBATCHES = 4  # of the pipeline cases
COLUMNS = ["experiment", "dtype", "case", "strategy", "injected", "gradient_error", "expected", "status", "reason",
           "step", "loss"]


@dataclass(frozen=True)
class Case:
    name: str
    strategy: str
    fault: str | None = None
    size: float = 0.0  # the fault's parameter (a scale error)
    gradient_error: float | None = None  # relative error of the mean gradient, where one number says it
    options: dict = field(default_factory=dict)
    probe: bool = False  # an error below what the check is meant to catch: either outcome is information

    @property
    def expected(self) -> str:
        return "either" if self.probe else "fail" if self.fault else "pass"


def one_f_one_b_pipeline() -> str:
    """The pipeline-only strategy on the 1F1B schedule, from the registry."""
    (name,) = [name for name, spec in REGISTRY.items()
               if spec.family == Family.PIPELINE_PARALLEL and spec.plan_fields(WORLD, {}).get("schedule") == "1f1b"]
    return name


def cases() -> list[Case]:
    """The strategies by their role in the registry: production data parallelism (the hand-written one's
    twin), hand-written tensor parallelism without SP (its all-reduces are the study's own, so one can be
    skipped), the 1F1B pipeline, and their reference with its reordered repeat (the noise floor)."""
    data_parallel, tensor_parallel = hand_written_data_parallel(bucketed=False)[1], tp_pair()[0]
    pipeline, reference = one_f_one_b_pipeline(), reference_of(data_parallel)
    micro = {"n_microbatches": MICROBATCHES}
    scaled = [Case(f"rank 1's gradient x {1 + e:g}", data_parallel, "grad_scaled_rank1", e, e / WORLD, probe=e < 0.01)
              for e in (0.01, 0.001)]
    return [Case("reference", reference), Case("noise floor", REGISTRY[reference].reordered),
            Case("correct", data_parallel), Case("correct", tensor_parallel), Case("correct", pipeline, options=micro),
            Case("gradients summed, not averaged", data_parallel, "grads_summed", gradient_error=WORLD - 1.0),
            *scaled,
            Case("one layer's all-reduce skipped", tensor_parallel, "tp_allreduce_skipped"),
            Case("one micro-batch dropped", pipeline, "microbatch_dropped", gradient_error=1 / MICROBATCHES,
                 options=micro)]


def strategies() -> list[str]:
    """The strategies the cases run (their source files are the benchmark's inputs)."""
    return sorted({case.strategy for case in cases()})


# --- the injected errors: each alters a built strategy from outside --------------------------------
def _scale_backward(strategy, factor) -> None:
    forward_backward = strategy.forward_backward
    strategy.forward_backward = lambda x, y, scale: forward_backward(x, y, scale * factor)


def grads_summed(strategy, size: float) -> None:
    """An all-reduce that sums without dividing by the ranks."""
    _scale_backward(strategy, strategy.dp_size)


def grad_scaled_rank1(strategy, size: float) -> None:
    """Rank 1's gradient off by a factor 1 + size before the average (e.g. a wrong loss scale there)."""
    _scale_backward(strategy, 1 + size if strategy.dp_rank == 1 else 1.0)


def tp_allreduce_skipped(strategy, size: float) -> None:
    """Layer 0's MLP output without the all-reduce after its row-parallel layer: each rank goes on with its
    own shard's partial sum."""
    import torch.nn.functional as F

    linear = strategy.model.gpt_neox.layers[0].mlp.dense_4h_to_h
    linear.forward = lambda x: F.linear(x, linear.weight, linear.bias)


def microbatch_dropped(strategy, size: float) -> None:
    """The last micro-batch of every step contributes its loss value but no gradient."""
    schedule = strategy.pipeline.schedule
    if not (hasattr(schedule, "_loss_fn") and hasattr(schedule, "_n_microbatches")):
        raise RuntimeError("torch's pipeline schedule no longer keeps its loss function and micro-batch count in "
                           "_loss_fn and _n_microbatches")
    loss_fn, calls, m = schedule._loss_fn, itertools.count(), schedule._n_microbatches

    def dropping(output, target):
        loss = loss_fn(output, target)
        return loss.detach() + 0 * loss if next(calls) % m == m - 1 else loss

    schedule._loss_fn = dropping


FAULTS = {f.__name__: f for f in (grads_summed, grad_scaled_rank1, tp_allreduce_skipped, microbatch_dropped)}


# --- the worker: every case, every dtype, on each rank -----------------------------------------------
def trajectory(case: Case, exp: dict, training: dict, topo, model_dir: Path, tokens: Path) -> list[float]:
    """The per-step losses of one case, trained by the study's loop (on rank 0; [] on the others)."""
    from shardlab.core.data import TokenBatches
    from shardlab.core.model import load_model
    from shardlab.runner.loop import train
    from shardlab.runner.metrics import StepLog
    from shardlab.runner.worker import make_reproducible
    from shardlab.strategies import get_spec

    make_reproducible(training)
    strategy = get_spec(case.strategy).build(load_model(model_dir), topo, training, case.options)
    if case.fault:
        FAULTS[case.fault](strategy, case.size)
    log = StepLog(None)
    label = f"{training['dtype']} {case.strategy}: {case.name}"
    train(strategy, TokenBatches.from_file(tokens, training, exp["data"]), training, log, label=label)
    return [r["loss"] for r in log.records]


@record  # an exception escaping a rank becomes torchrun's error file (runner.failures)
def worker(args) -> None:
    from shardlab.core.topology import init_topology, shutdown

    exp = json.loads(args.experiment_config.read_text())
    topo = init_topology(exp["launch"])
    try:
        results = {}
        for dtype in args.dtypes:
            training = dict(exp["training"], dtype=dtype, fault_injection="none", checkpoint_every=0, save_model=False,
                            save_model_every=0)
            for case in cases():
                results[f"{dtype}/{case.name}/{case.strategy}"] = trajectory(case, exp, training, topo, args.model_dir,
                                                                             args.tokens)
        if topo.is_main:
            args.worker_out.write_text(json.dumps(results))
    finally:
        shutdown()


# --- the driver: launch, then one row per (case, step) for the table (`tables.parity.sensitivity_rows`) ---
def loss_rows(dtypes: list[str], losses: dict[str, list[float]]) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for case in cases():
            for step, loss in enumerate(losses[f"{dtype}/{case.name}/{case.strategy}"]):
                rows.append({"dtype": dtype, "case": case.name, "strategy": case.strategy,
                             "injected": case.fault or "none", "gradient_error": case.gradient_error,
                             "expected": case.expected, "status": "ok", "step": step, "loss": loss})
    return rows


def launch(args) -> tuple[dict | None, str]:
    """Every case's losses (keyed as `loss_rows` reads them), or None and why the launch failed."""
    return run_worker(WORLD, "shardlab.bench.parity_sensitivity",
                      ["--dtypes", ",".join(args.dtypes), "--experiment-config", str(args.experiment_config),
                       "--model-dir", str(args.model_dir), "--tokens", str(args.tokens)], args.timeout_s)


def dtype_list(text: str) -> list[str]:
    """'fp32,bf16' -> ['fp32', 'bf16']: the dtypes the study trains in."""
    values = text.split(",")
    unknown = [v for v in values if v not in ("fp32", "bf16")]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a dtype the study trains in (fp32, bf16)")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("shardlab parity-sensitivity", __doc__)
    parser.add_argument("--dtypes", type=cli.argument(dtype_list), default=["fp32", "bf16"], help="comma separated")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    exp = json.loads(args.experiment_config.read_text())
    losses, reason = launch(args)
    rows = (loss_rows(args.dtypes, losses) if losses is not None
            else [{"dtype": d, "status": "failed", "reason": reason} for d in args.dtypes])
    write_rows(exp["name"], rows, COLUMNS, args.out)
    print(f"[parity_sensitivity] {exp['name']}: {len(cases())} cases x {len(args.dtypes)} dtypes -> {args.out}"
          + (f" (failed: {reason})" if losses is None else ""))


if __name__ == "__main__":
    main()
