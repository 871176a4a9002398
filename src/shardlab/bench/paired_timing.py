"""Paired timing: the speed of an experiment's strategies compared side by side, so that a shared
machine's background load hits each of them alike.

    python -m shardlab bench-paired --experiment-config results/E/experiment.json --model-dir M \
        --tokens T --out results/E/paired_timing.csv

launches one `torchrun` job (this module with `--worker`) on the experiment's world size that builds
every multi-process strategy of the experiment (each on its own copy of the model) and times them in
rounds (`paired_timing.rounds`): in each, a block of steps per strategy (`paired_timing.steps` timed
after one untimed step), the order rotated from round to round. A step takes as long as its slowest
rank. The output is one row per (round, strategy) with the block's median step time; a failed launch
is one row with status 'failed' and its reason (failure is data). `tables.verdicts` decides the speed
claims on the per-round ratios, and their spread is the run-to-run noise it reports.
"""

from __future__ import annotations

import gc
import json
import statistics
from pathlib import Path

from shardlab.bench.driver import bench_parser, run_worker, write_rows
from shardlab.runner.failures import record
from shardlab.strategies import get_spec

COLUMNS = ["experiment", "round", "position", "strategy", "step_s", "tokens_per_s", "steps", "status", "reason"]


def compared(exp: dict) -> list[str]:
    """The experiment's strategies that run on its world size (the single-device reference is not timed here)."""
    return [name for name in exp["strategies"] if not get_spec(name).single_process]


def rotated(names: list[str], round_: int) -> list[str]:
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


# --- the worker: every strategy built once, then timed in rotated blocks ----------------------------------
def timed_block(strategy, batches, training: dict, first_step: int, steps: int) -> list[float]:
    """Step times of `steps` steps after one untimed step, each the slowest rank's."""
    import torch
    import torch.distributed as dist

    from shardlab.runner.loop import measured_step

    device, times = strategy.topo.device, []
    for k in range(steps + 1):
        inputs, labels = strategy.local_batch(*batches.global_batch((first_step + k) % training["steps"]))
        _, seconds, _ = measured_step(strategy, strategy.micro_batches(inputs.to(device), labels.to(device)), {})
        if k:
            times.append(seconds)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def timed_rounds(exp: dict, topo, model_dir: Path, tokens: Path) -> list[dict]:
    """Every strategy built once, then timed block by block in rotated rounds: one row per block."""
    from shardlab.core.data import TokenBatches
    from shardlab.core.model import load_model
    from shardlab.runner.worker import make_reproducible

    training = dict(exp["training"], fault_injection="none", checkpoint_every=0, save_model=False, save_model_every=0)
    make_reproducible(training)
    batches = TokenBatches.from_file(tokens, training, exp["data"])
    names, setting = compared(exp), exp["paired_timing"]
    built = {name: get_spec(name).build(load_model(model_dir), topo, training, get_spec(name).options(exp))
             for name in names}
    rows, step = [], 0
    for round_ in range(setting["rounds"]):
        for position, name in enumerate(rotated(names, round_)):
            times = timed_block(built[name], batches, training, step, setting["steps"])
            step += setting["steps"] + 1
            rows.append({"round": round_, "position": position, "strategy": name,
                         "step_s": statistics.median(times), "steps": len(times)})
        if topo.is_main:
            print(f"[paired_timing] {exp['name']}: round {round_ + 1}/{setting['rounds']} "
                  + ", ".join(f"{r['strategy']} {r['step_s'] * 1e3:.1f} ms" for r in rows[-len(names):]), flush=True)
    return rows


@record  # an exception escaping a rank becomes torchrun's error file (runner.failures)
def worker(args) -> None:
    from shardlab.core.topology import init_topology, shutdown

    exp = json.loads(args.experiment_config.read_text())
    topo = init_topology(exp["launch"])
    try:
        rows = timed_rounds(exp, topo, args.model_dir, args.tokens)
        if topo.is_main:
            args.worker_out.write_text(json.dumps(rows))
    finally:
        # The strategies (DDP's reducer holds a process group) go before the process groups: a reducer
        # freed after them waits forever for the group's worker thread.
        gc.collect()
        shutdown()


# --- the driver: launch, then the table rows ------------------------------------------------------------
def measure(args, exp: dict) -> tuple[list[dict] | None, str]:
    """Every (round, strategy)'s median step time, or None and why the launch failed."""
    return run_worker(exp["launch"]["world_size"], "shardlab.bench.paired_timing",
                      ["--experiment-config", str(args.experiment_config), "--model-dir", str(args.model_dir),
                       "--tokens", str(args.tokens)], args.timeout_s)


def main(argv: list[str] | None = None) -> None:
    args = bench_parser("shardlab bench-paired", __doc__).parse_args(argv)
    if args.worker:
        return worker(args)
    exp = json.loads(args.experiment_config.read_text())
    rows, reason = measure(args, exp)
    tokens_per_step = exp["training"]["global_batch_size"] * exp["training"]["seq_len"]
    rows = ([dict(r, tokens_per_s=tokens_per_step / r["step_s"], status="ok") for r in rows] if rows is not None
            else [{"status": "failed", "reason": reason}])
    write_rows(exp["name"], rows, COLUMNS, args.out)
    print(f"[paired_timing] {exp['name']}: {len(rows)} rows -> {args.out}" + (f" (failed: {reason})" if reason else ""))


if __name__ == "__main__":
    main()
