"""Run torchrun as a process tree the launcher owns: output teed to the console and the log, a
deadline that holds even when the run prints nothing, and on every way out (finished, timed out,
SIGTERM/SIGINT to the launcher, an exception in the launcher) nothing of the run left running.

torchrun starts its ranks in sessions of their own, so killing torchrun's process group misses
them; and once torchrun is gone they are re-parented to init and no longer its children. The
tree is therefore found twice: the launcher's descendants, and every process whose command line
names the attempt folder (each rank gets `--out <attempt>`), which also finds orphans. A rank server's
agent and ranks are the server's children: its registry names them (`rank_server.forked_ranks`).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import psutil

from shardlab.errors import Interrupted
from shardlab.runner import rank_server

GRACE_S = 5.0  # between SIGTERM and SIGKILL: lets ranks flush their error files and logs
# Where torchrun's structured error files land in a run's folder (torch.distributed.elastic):
AGENT_ERROR_FILE = "torchrun_error.json"  # the agent's own: its failure, or its copy of the first rank's
RANK_LOG_DIR = "torchelastic"  # torchrun's --log-dir: <run id>_*/attempt_<n>/<local rank>/error.json per rank


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def run_processes(tag: str) -> list[psutil.Process]:
    """Every live process whose command line contains `tag` (the attempt folder), except this one, and
    every process a rank server forked for it (their command line is the server's)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.pid != psutil.Process().pid and any(tag in arg for arg in cmdline):
            found.append(proc)
    for pid, argv in rank_server.forked_ranks(tag).items():
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        proc.info = {"pid": pid, "cmdline": argv}  # what it runs, as process_iter's processes carry it
        found.append(proc)
    return found


def terminate_tree(root: subprocess.Popen, tag: str, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM the whole run (root, its descendants, any process naming `tag`), wait `grace_s`, then
    SIGKILL what is left. Returns the pids that had to be killed."""
    procs = {p.pid: p for p in run_processes(tag)}
    try:
        parent = psutil.Process(root.pid)
        procs.update({p.pid: p for p in [parent, *parent.children(recursive=True)]})
    except psutil.NoSuchProcess:
        pass
    for proc in procs.values():
        _signal(proc, signal.SIGTERM)
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    alive += [p for p in run_processes(tag) if p.pid not in procs]  # started while we waited
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)
    root.poll()
    return [p.pid for p in alive]


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def console(text: str) -> None:
    """Print, best effort: the console may be gone (a `| tee` killed by the same Ctrl-C), and losing
    it must not lose the run's log or its recorded outcome."""
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        pass


def _tee(stream, log) -> None:
    for line in stream:
        log.write(line)  # the log first: it is the record
        log.flush()
        console(line)


def run_logged(cmd: list[str], log_path: Path, env: dict, timeout_s: float, tag: str) -> tuple[int | None, str | None]:
    """Run `cmd`, teeing its output (decoded as UTF-8, bad bytes replaced) to the console and to
    `log_path`. Returns (exit code, why it was stopped: None, 'timeout' or the signal's name).
    Raises nothing on a timeout or a signal: the tree is gone when this returns."""
    stopped = None
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                encoding="utf-8", errors="replace", start_new_session=True)
        handlers = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
        reader = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stopped = "timeout"
        except Interrupted as err:
            stopped = signal.Signals(err.signum).name
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            terminate_tree(proc, tag)  # also on an exception of our own; a no-op for a finished run
            reader.join(timeout=GRACE_S)
    return proc.returncode, stopped


@dataclass(frozen=True)
class Outcome:
    """How one torchrun launch ended. `stopped`: None, 'timeout' or the name of the signal that
    interrupted the launcher; in every case nothing of the launch is still running."""

    run_dir: Path
    returncode: int | None
    stopped: str | None
    timeout_s: float

    @property
    def finished(self) -> bool:
        return self.returncode == 0 and self.stopped is None

    @property
    def interrupted(self) -> bool:
        """Stopped by SIGTERM/SIGINT to the launcher: the caller records what it can, then fails the job."""
        return self.stopped not in (None, "timeout")

    @property
    def log(self) -> Path:
        return self.run_dir / "run.log"


def run_torchrun(command: list[str], run_dir: Path, env: dict, timeout_s: float) -> Outcome:
    """Every torchrun launch of the study goes through here: `command` (torchrun or the study's agent,
    possibly behind srun) runs in a session of its own with its output teed to the console and to
    `run_dir`/run.log, and within `timeout_s`, or its whole tree is stopped.

    The ranks' command lines must name `run_dir` (their output file or folder lies in it): that is how
    ranks re-parented away from torchrun are still found and stopped. torchrun writes its structured
    error files into `run_dir` (AGENT_ERROR_FILE, and one per failed rank under RANK_LOG_DIR); both
    are set through the environment (PET_LOG_DIR is torchrun's --log-dir), so `command` stays as is."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(env, TORCHELASTIC_ERROR_FILE=str(run_dir / AGENT_ERROR_FILE), PET_LOG_DIR=str(run_dir / RANK_LOG_DIR))
    returncode, stopped = run_logged(command, run_dir / "run.log", env, timeout_s, tag=str(run_dir))
    return Outcome(run_dir, returncode, stopped, timeout_s)
