"""Launch one run under torchrun and turn ANY outcome into a recorded summary.

Snakemake calls this, never torchrun directly, so that an out-of-memory error, a crash or a
timeout becomes `summary.json` with `status: oom|failed` and a reason, and the DAG goes on.
Each attempt runs in its own folder under `attempts/` that Snakemake does not own, so a forced
rerun never deletes what an earlier attempt measured.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from shardlab import cli
from shardlab.config import config_hash, run_layout
from shardlab.core.model import SNAPSHOTS
from shardlab.costs.shapes import ModelShape
from shardlab.errors import ConfigError, Interrupted
from shardlab.runner import rank_server
from shardlab.runner.agent import ANY_PORT
from shardlab.runner.failures import failure_outcome, launch_failure
from shardlab.runner.metrics import attempt_resumes, now, write_json
from shardlab.runner.nodes import Rendezvous, slurm_job_id, slurm_rendezvous, srun_prefix
from shardlab.runner.process import console, run_torchrun
from shardlab.strategies import get_spec, threads_per_rank

RUN_FILES = ("summary.json", "metrics.jsonl", "run.log")


def resolve_world_size(exp: dict, strategy: str) -> int:
    world = get_spec(strategy).world_size(exp)
    if world != "auto":
        return int(world)
    if os.environ.get("RUNPOD_GPU_COUNT"):  # set on RunPod pods
        return int(os.environ["RUNPOD_GPU_COUNT"])
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


# One node alone: torch's static rendezvous (`runner.agent` puts a free port for the 0). `--standalone`'s c10d
# rendezvous (a random 0-0.3 s sleep to spread many nodes' joins, then its store's rounds) took 0.64 s of a
# launch at the median on 2 cores, this 0.08 s (docs/measurements.md, "Launch cost").
STANDALONE = ["--nnodes=1", "--node-rank=0", "--rdzv-backend=static", f"--rdzv-endpoint={ANY_PORT}"]


def torchrun_command(n_procs: int, run_args: list[str], module: str = "shardlab.runner.worker",
                     rendezvous: Rendezvous | None = None, server: Path | None = None) -> list[str]:
    """torchrun's command line for `module`, run by `shardlab.runner.agent` (torchrun without its teardown):
    `n_procs` ranks on this node, alone (`STANDALONE`) or as one of `rendezvous.nodes` agents; with a rank
    `server`'s socket, each rank is a client that the server forks the rank for (`runner.rank_server`)."""
    where = STANDALONE if rendezvous is None else rendezvous.torchrun_args()
    if server is None:
        return [sys.executable, "-m", "shardlab.runner.agent", *where, f"--nproc-per-node={n_procs}", "-m", module,
                *run_args]
    client = [sys.executable, "-S", "-I", str(rank_server.CLIENT), str(server)]
    return [*client, "shardlab.runner.agent", *where, f"--nproc-per-node={n_procs}", "--no-python", *client, module,
            *run_args]


def launch_module(world: int, module: str, module_args: list[str], run_dir: Path, output: Path, timeout_s: float,
                  timeout_setting: str, env: dict | None = None) -> str | None:
    """A benchmark's torchrun job: `module` on `world` ranks of this machine, owned as a run is (`run_torchrun`).
    None when it finished and wrote `output`, else why not (one line). `module_args` must name `run_dir`
    (`output` lies in it), so that no rank can outlive the launch. Raises Interrupted on SIGTERM/SIGINT."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    if "OMP_NUM_THREADS" in env:  # MKL's pool as the rank will set it too (torch.set_num_threads), as runs do
        env["MKL_NUM_THREADS"] = env["OMP_NUM_THREADS"]
    server = rank_server_for(env, "auto")
    outcome = run_torchrun(torchrun_command(world, module_args, module=module, server=server), run_dir, env, timeout_s)
    return launch_failure(outcome, output, timeout_setting)


def rank_server_for(env: dict, device: str, wanted: bool = True) -> Path | None:
    """The rank server's socket for a launch on this machine with `env`, or None: not `wanted`
    (launch.rank_server), a GPU run, or no server came up (said on the console; the ranks then start
    as torchrun starts them)."""
    if not wanted or not on_cpu(device):
        return None
    try:
        server = rank_server.server_for(env)
    except OSError as err:  # e.g. no writable folder for its socket
        console(f"[launch] no rank server ({err}): the ranks import for themselves")
        return None
    if server is None:
        console(f"[launch] no rank server came up within {rank_server.START_TIMEOUT_S:.0f} s (its log: "
                f"{rank_server.state_dir()}): the ranks import for themselves")
    return server


def agent_command(exp: dict, world: int, run_args: list[str], restart: int, env: dict) -> tuple[list[str], str]:
    """The command that starts a run of `world` ranks in `env`, and where it runs (for the log): under Slurm
    with more than one node of the layout (`config.run_layout`), `srun` one agent per node meeting at this
    job's rendezvous; otherwise every rank on this machine (forked by the rank server on CPU)."""
    nodes, per_node = run_layout(exp["launch"], world, f"experiments.{exp['name']}.launch.nodes")
    job = slurm_job_id()
    if nodes == 1 or job is None:
        where = "" if nodes == 1 else f" (launch.nodes: {nodes}, but no Slurm job: all on this machine)"
        server = rank_server_for(env, exp["launch"]["device"], exp["launch"].get("rank_server", True))
        return torchrun_command(world, run_args, server=server), where + (" via the rank server" if server else "")
    rdzv = slurm_rendezvous(nodes, job, restart)
    gpus = per_node if exp["launch"]["device"] == "cuda" else 0
    srun = srun_prefix(nodes, per_node * exp["launch"]["threads_per_rank"], gpus)
    return [*srun, *torchrun_command(per_node, run_args, rendezvous=rdzv)], \
        f" on {nodes} nodes x {per_node} (Slurm job {job}, rendezvous {rdzv.host}:{rdzv.port})"


def attempt_stamp() -> str:
    """Local time to the millisecond: attempt folders sort by start and never share a name."""
    now_s = time.time()
    return f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(now_s))}.{int(now_s * 1000) % 1000:03d}"


def checkpoint_dir(out: Path, strategy: str) -> Path:
    """results/<exp>/checkpoints/<strategy>: beside the attempts, outlives any one of them."""
    return out.parent.parent / "checkpoints" / strategy


def model_summary(model_dir: Path) -> dict:
    """{name, parameters} from the prepared model's record, so failed runs still say what they trained."""
    path = Path(model_dir) / "shardlab_model.json"
    if not path.exists():
        return {}
    record = json.loads(path.read_text())
    return {"name": record.get("name"), "parameters": ModelShape.from_dict(record["shape"]).parameters()}


def clear_run_dir(out: Path) -> None:
    """Remove what an earlier attempt copied here: a failed rerun must not sit beside stale files."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for folder in ("artifacts", "model", SNAPSHOTS):
        shutil.rmtree(out / folder, ignore_errors=True)


def launch(exp: dict, exp_config: Path, strategy: str, model_dir: Path, tokens: Path, out: Path) -> dict:
    """Run one strategy and record its outcome; raises Interrupted (after recording) on SIGTERM/SIGINT.

    After a failure the run is started again, up to `launch.max_restarts` times, as a fresh torchrun
    (new rendezvous) in a new attempt folder; with checkpoints (`training.checkpoint_every`) the
    ranks resume from the latest complete one. (torchrun's own --max-restarts was tried first: its
    restarted gloo workers failed to connect their full mesh or hung, so restarts live here.)"""
    out.mkdir(parents=True, exist_ok=True)
    clear_run_dir(out)
    base = {"experiment": exp["name"], "strategy": strategy, "family": get_spec(strategy).family,
            "config_hash": config_hash(exp), "model": model_summary(model_dir), "started": now(), "ranks": []}
    earlier: list[str] = []
    for restart in range(exp["launch"].get("max_restarts", 0) + 1):
        attempt = out.parent.parent / "attempts" / strategy / f"{attempt_stamp()}-{os.getpid()}-{restart}"
        attempt.mkdir(parents=True)  # new every time: an attempt never writes into another's folder
        summary, stopped = run_attempt(exp, exp_config, strategy, model_dir, tokens, out, attempt, base, restart)
        summary.update(attempt=str(attempt), finished=now(), restarts=earlier)
        record_attempt(attempt, out, summary)
        if stopped and stopped != "timeout":
            raise Interrupted(signal.Signals[stopped])
        if summary["status"] == "ok" or stopped or summary.get("world_size") is None:
            break  # done, out of time, or rejected before launch: a restart would change nothing
        earlier = [*earlier, f"{attempt.name}: {summary['status']}: {summary['reason']}"]
        if restart < exp["launch"].get("max_restarts", 0):
            console(f"[launch] {exp['name']}/{strategy}: restart {restart + 1} after {summary['reason']}")
    return summary


def run_attempt(exp, exp_config, strategy, model_dir, tokens, out, attempt, base, restart) -> tuple[dict, str | None]:
    """One torchrun of the run in `attempt`: (summary, why it was stopped, if it was)."""
    run_args = ["--experiment-config", str(exp_config), "--strategy", strategy, "--model-dir", str(model_dir),
                "--tokens", str(tokens), "--out", str(attempt)]
    if exp["training"].get("checkpoint_every"):
        run_args += ["--checkpoint-dir", str(checkpoint_dir(out, strategy))]
    started = time.time()
    env = dict(run_environment(exp, strategy), SHARDLAB_RESTART=str(restart), SHARDLAB_LAUNCH_T0=repr(started))
    try:
        n_procs = resolve_world_size(exp, strategy)
        get_spec(strategy).check(exp, f"experiments.{exp['name']}", world=n_procs)
        command, where = agent_command(exp, n_procs, run_args, restart, env)
    except (ConfigError, RuntimeError) as err:  # RuntimeError: the Slurm allocation could not be read
        (attempt / "run.log").write_text(f"[launch] configuration rejected before launch: {err}\n")
        return dict(base, status="failed", reason=str(err), world_size=None), None
    console(f"[launch] {exp['name']}/{strategy}: {n_procs} process(es){where} -> {attempt}")
    outcome = run_torchrun(command, attempt, env, exp["launch"]["timeout_s"])
    if outcome.finished and (attempt / "summary.json").exists():
        summary = json.loads((attempt / "summary.json").read_text())
        summary.setdefault("startup", {})["launch_wall_s"] = time.time() - started  # torchrun start to exit
        return summary, None
    summary = dict(base, **failure_outcome(outcome), world_size=n_procs, resumes=attempt_resumes(attempt))
    console(f"[launch] {exp['name']}/{strategy}: recorded as {summary['status']}: {summary['reason']}")
    return summary, outcome.stopped


def run_environment(exp: dict, strategy: str) -> dict:
    # Both thread pools as the rank will set them (torch.set_num_threads in init_topology), whatever the
    # caller's environment says (Snakemake sets MKL's to the job's threads): ranks start in one rank server.
    threads = str(threads_per_rank(exp, strategy))
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS' deterministic mode (training.deterministic)
    if on_cpu(exp["launch"]["device"]):
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed otherwise looks for a GPU
    return env


def on_cpu(device: str) -> bool:
    """Whether a run with launch.device `device` runs on this machine's CPU."""
    return device == "cpu" or (device == "auto" and not _has_nvidia_driver())


def record_attempt(attempt: Path, out: Path, summary: dict) -> None:
    """The summary into the attempt folder (kept forever), then this attempt's files into the run folder."""
    write_json(attempt / "summary.json", summary)
    (attempt / "metrics.jsonl").touch()
    for name in RUN_FILES:
        if (attempt / name).exists():
            shutil.copy2(attempt / name, out / name)
    for folder in ("artifacts", "model"):  # what the strategy saved (ds_config.json), training.save_model
        shutil.rmtree(out / folder, ignore_errors=True)  # an earlier restart's copy
        if (attempt / folder).is_dir():
            shutil.copytree(attempt / folder, out / folder)
    # Snapshots accumulate over the restarts of one launch: a restart resumed past the earlier ones.
    if (attempt / SNAPSHOTS).is_dir():
        shutil.copytree(attempt / SNAPSHOTS, out / SNAPSHOTS, dirs_exist_ok=True)


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
    for folder in ("model", SNAPSHOTS):  # training.save_model(_every): the borrowing experiment evaluates them too
        shutil.rmtree(out / folder, ignore_errors=True)
        if (source / folder).is_dir():
            shutil.copytree(source / folder, out / folder)
    return summary


def _has_nvidia_driver() -> bool:
    # Cheap check: importing torch here would add ~2 s to every run's launch.
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def share_main(argv: list[str] | None = None) -> int:
    """`python -m shardlab share-run SOURCE OUT EXPERIMENT`: an experiment whose reference run is identical to
    another's records that run instead of training it again."""
    parser = cli.Parser(prog="shardlab share-run", description=share_main.__doc__)
    parser.add_argument("source", type=cli.existing_dir, help="the run folder that trained it")
    parser.add_argument("out", type=Path, help="this experiment's run folder")
    parser.add_argument("experiment", help="this experiment's name")
    args = parser.parse_args(argv)
    share_reference(args.source, args.out, args.experiment)
    console(f"[launch] {args.experiment}/single: shares the identical reference run {args.source}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="shardlab launch", description=__doc__)
    parser.add_argument("--experiment-config", type=cli.existing_file, required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--model-dir", type=cli.existing_dir, required=True)
    parser.add_argument("--tokens", type=cli.existing_file, required=True)
    parser.add_argument("--out", type=Path, required=True, help="results/<experiment>/runs/<strategy>")
    args = parser.parse_args(argv)
    exp = json.loads(args.experiment_config.read_text())
    try:
        get_spec(args.strategy)
    except KeyError as err:
        parser.error(f"--strategy: {err.args[0]}")
    try:
        summary = launch(exp, args.experiment_config, args.strategy, args.model_dir, args.tokens, args.out)
    except Interrupted as err:  # recorded in the attempt folder; the job itself must fail
        console(f"[launch] {exp['name']}/{args.strategy}: {err}; nothing of the run is left running")
        return 128 + err.signum
    console(f"[launch] {exp['name']}/{args.strategy}: {summary['status']}")
    return 0  # a failed run is a result, not a DAG failure
