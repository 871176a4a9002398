"""Launch one run under torchrun and turn ANY outcome into a recorded summary.

Snakemake calls this, never torchrun directly, so that an out-of-memory error, a crash or a
timeout becomes `summary.json` with `status: oom|failed` and a reason, and the DAG goes on.
Each attempt runs in its own folder under `attempts/` that Snakemake does not own, so a forced
rerun never deletes what an earlier attempt measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from shardlab.config import config_hash
from shardlab.errors import ConfigError
from shardlab.runner.metrics import now, write_json
from shardlab.strategies import get_spec

RUN_FILES = ("summary.json", "metrics.jsonl", "run.log")


def resolve_world_size(exp: dict, strategy: str) -> int:
    world = get_spec(strategy).world_size(exp)
    if world != "auto":
        return int(world)
    if os.environ.get("RUNPOD_GPU_COUNT"):  # set on RunPod pods
        return int(os.environ["RUNPOD_GPU_COUNT"])
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def torchrun_command(n_procs: int, run_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n_procs}",
            "-m", "shardlab.runner.worker", *run_args]


def run_logged(cmd: list[str], log_path: Path, env: dict, timeout_s: int) -> tuple[int | None, bool]:
    """Run `cmd`, teeing its output to the console (progress) and to `log_path`. Returns (rc, timed_out)."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + timeout_s
        timed_out = False
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            if time.monotonic() > deadline:
                timed_out = True
                break
        if timed_out:
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
    return rc, timed_out


def failure_reason(attempt: Path, rc: int | None, timed_out: bool, timeout_s: int) -> tuple[str, str]:
    """(status, reason) from the ranks' error files, the exit code and the log."""
    if timed_out:
        return "failed", f"timed out after {timeout_s} s (launch.timeout_s)"
    errors = [json.loads(p.read_text()) for p in sorted(attempt.glob("error_rank*.json"))]
    first = next((e for e in errors if e["type"] != "DistBackendError"), errors[0] if errors else None)
    if first:
        status = "oom" if any(e["oom"] for e in errors) else "failed"
        return status, f"rank {first['rank']}: {first['type']}: {first['message'].splitlines()[0] if first['message'] else ''}"
    log = (attempt / "run.log").read_text().strip().splitlines() if (attempt / "run.log").exists() else []
    if (rc is not None and rc < 0) or rc == 137 or any("SIGKILL" in line for line in log):
        return "oom", "a rank was killed by SIGKILL (most often the kernel's out-of-memory killer)"
    tail = next((line for line in reversed(log) if "Error" in line), log[-1] if log else "no output")
    return "failed", f"exit code {rc}: {tail[:500]}"


def launch(exp: dict, exp_config: Path, strategy: str, model_dir: Path, tokens: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    attempt = out.parent.parent / "attempts" / strategy / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    attempt.mkdir(parents=True, exist_ok=True)
    timeout_s = exp["launch"]["timeout_s"]
    base = {"experiment": exp["name"], "strategy": strategy, "family": get_spec(strategy).family,
            "config_hash": config_hash(exp), "attempt": str(attempt), "finished": now(), "ranks": []}
    try:
        n_procs = resolve_world_size(exp, strategy)
        get_spec(strategy).check(exp, f"experiments.{exp['name']}", world=n_procs)
    except ConfigError as err:
        summary = dict(base, status="failed", reason=str(err), world_size=None)
    else:
        env = dict(os.environ, OMP_NUM_THREADS=str(exp["launch"]["threads_per_rank"]), PYTHONUNBUFFERED="1")
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS' deterministic mode (training.deterministic)
        if exp["launch"]["device"] == "cpu" or (exp["launch"]["device"] == "auto" and not _has_nvidia_driver()):
            env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed otherwise looks for a GPU
        cmd = torchrun_command(n_procs, ["--experiment-config", str(exp_config), "--strategy", strategy,
                                         "--model-dir", str(model_dir), "--tokens", str(tokens), "--out", str(attempt)])
        print(f"[launch] {exp['name']}/{strategy}: {n_procs} process(es) -> {attempt}", flush=True)
        rc, timed_out = run_logged(cmd, attempt / "run.log", env, timeout_s)
        if rc == 0 and (attempt / "summary.json").exists():
            summary = json.loads((attempt / "summary.json").read_text())
        else:
            status, reason = failure_reason(attempt, rc, timed_out, timeout_s)
            summary = dict(base, status=status, reason=reason, world_size=n_procs)
            print(f"[launch] {exp['name']}/{strategy}: recorded as {status}: {reason}", flush=True)
    summary["attempt"] = str(attempt)
    write_json(attempt / "summary.json", summary)
    (attempt / "metrics.jsonl").touch()
    for name in RUN_FILES:
        if (attempt / name).exists():
            shutil.copy2(attempt / name, out / name)
    if (attempt / "artifacts").is_dir():  # what the strategy saved to show what ran (e.g. ds_config.json)
        shutil.copytree(attempt / "artifacts", out / "artifacts", dirs_exist_ok=True)
    shutil.rmtree(out / "model", ignore_errors=True)  # never leave an earlier attempt's model behind
    if (attempt / "model").is_dir():  # training.save_model
        shutil.copytree(attempt / "model", out / "model")
    return summary


def share_reference(source: Path, out: Path, experiment: str) -> dict:
    """Record another experiment's single-device run as this experiment's reference.

    Experiments with identical model, data, training and launch settings would run the exact same
    deterministic single-device job; the workflow runs it once and shares it (`reused_from` says so).
    """
    out.mkdir(parents=True, exist_ok=True)
    summary = json.loads((source / "summary.json").read_text())
    summary.update(reused_from=summary["experiment"], experiment=experiment)
    write_json(out / "summary.json", summary)
    for name in ("metrics.jsonl", "run.log"):
        if (source / name).exists():
            shutil.copy2(source / name, out / name)
    return summary


def _has_nvidia_driver() -> bool:
    # Cheap check: importing torch here would add ~2 s to every run's launch.
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "share":  # share SOURCE_RUN_DIR OUT_RUN_DIR EXPERIMENT
        share_reference(Path(argv[1]), Path(argv[2]), argv[3])
        print(f"[launch] {argv[3]}/single: shares the identical reference run {argv[1]}")
        return 0
    parser = argparse.ArgumentParser(prog="shardlab.runner.launch", description=__doc__)
    parser.add_argument("--experiment-config", type=Path, required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokens", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="results/<experiment>/runs/<strategy>")
    args = parser.parse_args(argv)
    exp = json.loads(args.experiment_config.read_text())
    summary = launch(exp, args.experiment_config, args.strategy, args.model_dir, args.tokens, args.out)
    print(f"[launch] {exp['name']}/{args.strategy}: {summary['status']}", flush=True)
    return 0  # a failed run is a result, not a DAG failure


if __name__ == "__main__":
    raise SystemExit(main())
