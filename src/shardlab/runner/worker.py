"""One run = one strategy, one process per rank: `torchrun ... -m shardlab.runner.worker --strategy S ...`.

Rank 0 writes `metrics.jsonl` and `summary.json`. An exception escaping a rank lands in torchrun's
error file (`@record`), which `shardlab.runner.launch` turns into a recorded failure.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports below: the launch-cost breakdown times them

import argparse
import json
import os
import random
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardlab import cli
from shardlab.config import config_hash
from shardlab.core.data import TokenBatches
from shardlab.core.step_stats import timed_steps
from shardlab.runner.checkpoint import Checkpointer, checkpoint_folder, trajectory
from shardlab.runner.failures import record
from shardlab.runner.faults import remove_reductions
from shardlab.runner.fork_server import exit_now
from shardlab.runner.metrics import RESUMES_FILE, StepLog, environment, now, write_json
from shardlab.core.model import count_parameters, load_model, snapshot_dir
from shardlab.strategies import NOISE_RUNS, get_spec, threads_per_rank
from shardlab.core.topology import init_topology, shutdown
from shardlab.runner.loop import train


def make_reproducible(training: dict) -> None:
    """Same seed, and torch's deterministic kernels where it has them, so that a run (above all the
    single-device reference) gives the same bits every time on one machine; the thread count, which
    also changes reduction order on CPU, is pinned by init_topology (launch.threads_per_rank). Where
    torch has none (warn_only; on CUDA, flash attention's backward) a run repeats only up to that
    kernel's rounding, which the measured noise floor (`single_reordered`) then includes."""
    random.seed(training["seed"])
    np.random.seed(training["seed"])
    torch.manual_seed(training["seed"])
    # float32 matrix products in float32 (torch's default, kept against any library that lowers it): on
    # GPUs TF32 would round to 10 mantissa bits, which the fp32 parity bound and the fp32 peak do not assume.
    torch.set_float32_matmul_precision("highest")
    if training.get("deterministic", True):
        torch.use_deterministic_algorithms(True, warn_only=True)


def compute(env: dict) -> dict:
    """What a run computed on, to compare throughputs fairly: GPUs, or the CPU cores its threads occupy."""
    if env["device_type"] == "cuda":
        return {"unit": "GPU", "count": env["world_size"]}
    return {"unit": "core", "count": min(env["world_size"] * env["threads_per_rank"], env["cpu_cores"] or 1)}


def summarize(exp: dict, strategy: str, records: list[dict], ranks: list[dict], env: dict, n_params: int) -> dict:
    training = exp["training"]
    timed = timed_steps(records, training["warmup_steps"])
    step_median = statistics.median(r["step_time_s"] for r in timed)
    comm = [r["comm_time_s"] for r in timed if r["comm_time_s"] is not None]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    spec = get_spec(strategy)
    return {
        "status": "ok",
        "reason": None,
        "experiment": exp["name"],
        "strategy": strategy,
        "family": spec.family,
        "world_size": env["world_size"],
        "config_hash": config_hash(exp),
        "model": {"name": exp["model"]["name"], "parameters": n_params},
        "steps": training["steps"],
        "tokens_per_step": training["global_batch_size"] * training["seq_len"],
        "step_time_median_s": step_median,
        "tokens_per_s": training["global_batch_size"] * training["seq_len"] / step_median,
        "comm_time_median_s": statistics.median(comm) if comm else None,
        "compute": compute(env),
        "final_loss": records[-1]["loss"],
        "final_val_loss": val[-1] if val else None,
        "ranks": ranks,
        "environment": env,
    }


def save_final_model(strategy, model, tokenizer_dir: Path, out: Path) -> None:
    """Rank 0 writes the trained weights (gathered by the strategy) and the corpus' tokenizer."""
    state = strategy.full_state_dict()  # collective for sharded strategies: every rank calls it
    if state is None:
        return
    # Every parameter under the model's own name (a tied head may come once); save_pretrained would write any
    # other names, and loading the model would leave its weights random.
    missing = {name for name, _ in model.named_parameters()} - set(state)
    unexpected = set(state) - set(model.state_dict())
    if missing or unexpected:
        raise RuntimeError(f"{strategy.name}: the gathered state dict does not name the model's weights: missing "
                           f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    from transformers import AutoTokenizer

    model.save_pretrained(out, state_dict=state)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)


def resume(args, exp: dict, topo, strategy, log: StepLog) -> tuple[Checkpointer, int, list[dict]]:
    """(checkpointer, first step to run, resumes so far): from the run's own latest complete checkpoint, else
    from `training.resume_from` (written by any plan: checked, then resharded), else from step 0."""
    training = exp["training"]
    checkpoint = Checkpointer(args.checkpoint_dir, training.get("checkpoint_every", 0), trajectory(exp, args.strategy),
                              topo.rank, topo.world_size, args.strategy)
    latest, source = checkpoint.latest(), training.get("resume_from")
    if latest is None and not source:
        return checkpoint, 0, []
    path = latest[1] if latest else checkpoint_folder(source)
    meta = checkpoint.load(strategy, path, foreign=latest is None,
                           optimizer=training["fault_injection"] != "drop_optimizer_state")
    log.restore(meta["records"])
    step = meta["step"]
    resumes = [*meta.get("resumes", []), {"from_step": step + 1, "at": now(), "world_size": topo.world_size,
                                           "restart": int(os.environ.get("SHARDLAB_RESTART", 0)),
                                           "written_by": {"strategy": meta.get("strategy"), "world_size": meta["world_size"]},
                                           **({} if latest else {"from": str(path)})}]
    if topo.is_main:
        print(f"[{args.strategy}] resuming: steps 0-{step} restored from {path} (written by {meta.get('strategy')} "
              f"on {meta['world_size']} rank(s))", flush=True)
        write_json(args.out / RESUMES_FILE, resumes)  # an attempt that then fails still says it resumed
    return checkpoint, step + 1, resumes


class Phases:
    """Seconds spent in each phase of a launch, for the launch-cost breakdown (`startup` in the summary):
    agent_start (the launcher starts torchrun: interpreter and torch import; SHARDLAB_LAUNCH_T0 to
    SHARDLAB_AGENT_T), rendezvous_and_spawn (until this rank's interpreter runs the worker module),
    worker_imports (torch and shardlab), then each phase of `run` marked with `done`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.time()
        marks = [os.environ.get("SHARDLAB_LAUNCH_T0"), os.environ.get("SHARDLAB_AGENT_T"), STARTED, self._last]
        if None not in marks:  # launched by shardlab.runner.launch through the agent
            marks = [float(m) for m in marks]
            names = ["agent_start_s", "rendezvous_and_spawn_s", "worker_imports_s"]
            self.seconds = {name: end - start for name, start, end in zip(names, marks, marks[1:])}

    def done(self, name: str) -> None:
        now_s = time.time()
        self.seconds[f"{name}_s"] = now_s - self._last
        self._last = now_s


def run(args: argparse.Namespace) -> None:
    phases = Phases()
    exp = json.loads(args.experiment_config.read_text())
    training = exp["training"]
    out = args.out
    try:
        topo = init_topology(dict(exp["launch"], threads_per_rank=threads_per_rank(exp, args.strategy)))
        phases.done("process_group")
        make_reproducible(training)
        model = load_model(args.model_dir)
        n_params = count_parameters(model)
        phases.done("model_load")
        options = exp.get("strategy_options", {}).get(args.strategy, {})
        strategy = get_spec(args.strategy).build(model, topo, training, options)
        remove_reductions(strategy, training["fault_injection"])  # test hook: none unless a numeric fault
        phases.done("strategy_setup")
        if topo.is_main and strategy.artifacts():
            (out / "artifacts").mkdir(exist_ok=True)
            for name, content in strategy.artifacts().items():
                write_json(out / "artifacts" / name, content)
        batches = TokenBatches.from_file(args.tokens, training, exp["data"])
        log = StepLog(out / "metrics.jsonl" if topo.is_main else None)
        if topo.is_main:
            print(f"[{args.strategy}] {exp['name']}: {n_params:,} parameters, {topo.world_size} rank(s), "
                  f"{topo.backend} on {topo.device.type}", flush=True)
        started = time.time()
        checkpoint, start_step, resumes = resume(args, exp, topo, strategy, log)
        phases.done("data_and_resume")
        keeps_model = args.strategy not in NOISE_RUNS  # a noise-floor run is compared by its losses alone
        snapshot = None
        if training.get("save_model_every") and keeps_model:  # the science evaluation's curves: a domain metric against step
            snapshot = lambda n: save_final_model(strategy, model, args.tokens.parent, snapshot_dir(out, n))  # noqa: E731
        measured = train(strategy, batches, training, log, label=args.strategy, start_step=start_step,
                         checkpoint=checkpoint, resumes=resumes, snapshot=snapshot)
        phases.done("training")
        if training.get("save_model") and keeps_model:
            save_final_model(strategy, model, args.tokens.parent, out / "model")
        measured["rank"] = topo.rank
        ranks = [None] * topo.world_size
        dist.all_gather_object(ranks, measured)
        phases.done("save_and_gather")
        if topo.is_main:
            summary = summarize(exp, args.strategy, log.records, ranks, environment(topo), n_params)
            summary.update(started=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)), finished=now(),
                           train_wall_s=time.time() - started, resumes=resumes,
                           startup=dict(phases.seconds, first_step_s=log.records[0]["step_time_s"]))
            write_json(out / "summary.json", summary)
        if not training.get("keep_checkpoints"):
            checkpoint.remove_all()  # finished: a rerun of this run starts again from step 0
    except BaseException:
        shutdown()
        raise
    shutdown()
    # Everything is written and the process group is gone: exit before this frame's objects are freed.
    # Freeing them tears down gloo (a rank forked by the rank server can hang there) and the interpreter
    # (~1 s of torch/transformers teardown, paid by every run of the study).
    exit_now(0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="shardlab.runner.worker", description=__doc__)
    parser.add_argument("--experiment-config", type=Path, required=True, help="resolved experiment JSON")
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="where checkpoints live across attempts")
    return parser.parse_args(argv)


@record  # an exception escaping a rank becomes torchrun's error file (runner.failures)
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
