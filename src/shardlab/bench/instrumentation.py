"""What the study's measuring costs: one strategy's steps with and without the instrumentation around
them, in one torchrun job (`python -m shardlab.runner.agent --standalone --nproc-per-node=N -m
shardlab.bench.instrumentation ...`; scripts/instrumentation-cost.py runs it per strategy).

The instrumented step is the one every run of the study takes (`runner.loop.measured_step`): device
synchronisation and the clock around the step, the blocked-communication timer inside the strategy,
and, once per `training.log_every` steps, the losses averaged over ranks and the slowest rank's step
times (`runner.loop.PendingSteps`: two small all-reduces per flush; a block is `log_every` steps
long unless told otherwise, and flushes once). The bare step is the same work (`runner.loop.step_work`) with the communication timer off and nothing
reduced. Blocks of steps alternate A B B A ... so that drift in the machine's speed hits both alike;
each block's wall time per step (ranks aligned by a barrier at both ends) is one sample, and the
overhead is the ratio of the two medians with a 95 % bootstrap interval over blocks. The activation
probe runs on the first (warm-up) step of a run only, never on a timed one, and is not part of it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from shardlab import cli
from shardlab.core.data import TokenBatches
from shardlab.core.model import load_model
from shardlab.core.step_stats import BOOTSTRAP_SAMPLES
from shardlab.core.topology import init_topology, shutdown
from shardlab.runner.failures import record
from shardlab.runner.loop import PendingSteps, measured_step, step_work
from shardlab.strategies import get_spec

MODES = ("instrumented", "bare")


def block_order(blocks: int) -> list[str]:
    """A B B A A B B A ...: each mode runs first as often as second."""
    return [MODES[(i + i // 2) % 2] for i in range(2 * blocks)]


def overhead(instrumented: list[float], bare: list[float], seed: int = 0) -> tuple[float, float, float]:
    """median(instrumented) / median(bare) - 1 with a 95 % bootstrap interval over blocks."""
    a, b = np.asarray(instrumented), np.asarray(bare)
    rng = np.random.default_rng(seed)
    ratios = (np.median(rng.choice(a, (BOOTSTRAP_SAMPLES, a.size)), axis=1)
              / np.median(rng.choice(b, (BOOTSTRAP_SAMPLES, b.size)), axis=1))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(np.median(a) / np.median(b) - 1), float(low - 1), float(high - 1)


def run_block(strategy, batches, step: int, steps: int, mode: str) -> float:
    """Wall seconds per step of `steps` steps in `mode`, ranks aligned at both ends; an instrumented
    block reduces its steps once at its end, as training does once per `log_every` steps."""
    device = strategy.topo.device
    pending = PendingSteps(strategy)
    dist.barrier()
    t0 = time.perf_counter()
    for k in range(step, step + steps):
        inputs, labels = strategy.local_batch(*batches.global_batch(k))
        micro = strategy.micro_batches(inputs.to(device), labels.to(device))
        if mode == "instrumented":
            pending.add(k, *measured_step(strategy, micro, {}))
        else:
            step_work(strategy, micro, {})
            strategy.zero_grad()
    pending.flush()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


@record  # an exception escaping a rank becomes torchrun's error file (runner.failures)
def main(argv: list[str] | None = None) -> None:
    parser = cli.Parser(prog="shardlab.bench.instrumentation", description=__doc__)
    parser.add_argument("--experiment-config", type=Path, required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=Path, required=True)
    parser.add_argument("--blocks", type=int, default=8, help="blocks per mode")
    parser.add_argument("--steps-per-block", type=int, help="default: the experiment's training.log_every")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="JSON result")
    args = parser.parse_args(argv)
    exp = json.loads(args.experiment_config.read_text())
    steps_per_block = args.steps_per_block or exp["training"]["log_every"]
    training = dict(exp["training"], steps=args.warmup_steps + 2 * args.blocks * steps_per_block)
    topo = init_topology(exp["launch"])
    try:
        strategy = get_spec(args.strategy).build(load_model(args.model_dir), topo, training,
                                                   exp.get("strategy_options", {}).get(args.strategy, {}))
        batches = TokenBatches.from_file(args.tokens, training, exp["data"])
        run_block(strategy, batches, 0, args.warmup_steps, "instrumented")
        samples: dict[str, list[float]] = {mode: [] for mode in MODES}
        step = args.warmup_steps
        for mode in block_order(args.blocks):
            strategy.comm.enabled = mode == "instrumented"
            samples[mode].append(run_block(strategy, batches, step, steps_per_block, mode))
            step += steps_per_block
        strategy.comm_seconds()  # drop what the instrumented blocks timed
        if topo.is_main:
            value, low, high = overhead(samples["instrumented"], samples["bare"])
            result = {"experiment": exp["name"], "strategy": args.strategy, "world_size": topo.world_size,
                      "blocks": args.blocks, "steps_per_block": steps_per_block,
                      "instrumented_step_s": float(np.median(samples["instrumented"])),
                      "bare_step_s": float(np.median(samples["bare"])), "overhead": value, "overhead_low": low,
                      "overhead_high": high, "samples": samples}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
            print(f"[instrumentation] {args.strategy}: {value:+.1%} (95 % {low:+.1%} to {high:+.1%}) "
                  f"per step, {result['bare_step_s'] * 1e3:.1f} ms bare", flush=True)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
